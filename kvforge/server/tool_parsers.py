"""Tool-call parsers for ``tool_choice`` ``"auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``, vLLM's
flags): the model decides whether to call, in its own syntax, and the parser finds the calls in its text.

``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3 and others trained on that format): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text outside the
blocks is the message's content (whitespace at its end dropped when there are calls). A block whose JSON
is not a call (an object with a string ``name`` and an object of ``arguments``) stays in the content as the
model wrote it, as does an unterminated block at the end of the output. Streamed, content goes out as it is
generated except a tail that may begin a ``<tool_call>`` tag or is whitespace (each held until decided),
and each call goes out whole, as one ``tool_calls`` entry, once its block closes: the streamed content
equals the whole parse's.

``llama3_json`` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): an output that begins (after whitespace,
and the ``<|python_tag|>`` text if present) with ``{`` is one or more calls ``{"name": ..., "parameters":
{...}}`` separated by ``;``, and has no content; one that does not parse that way whole is content.
Streamed, an output that begins with ``{`` is held to its end and goes out as calls (or, not parsing, as
content); any other streams as content.

``pythonic`` (Llama 3.2 and 4, and models trained on that format): an output that is (after whitespace) a
Python list of calls with keyword arguments of literal values, ``[get_weather(city="Paris"), get_time()]``,
is those calls, each call's keywords its JSON arguments (tuples as arrays; ``True``, ``False`` and ``None``
as JSON's literals), and has no content; any other output is content, a list that is not all such calls
(``[1, 2]``, ``[f(x)]`` with a positional argument, ``[f(**kw)]``) too. Streamed like ``llama3_json``: an
output that begins with ``[`` is held to its end.

``mistral`` (Mistral's instruct models): the output's content, then ``[TOOL_CALLS]`` and the calls, either a
JSON array of ``{"name": ..., "arguments": {...}}`` (tokenizers up to v7) or ``name[ARGS]{...}`` per call,
each after its own ``[TOOL_CALLS]`` (v11 and later). ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so
a request this parser serves is detokenized with them (``skip_special_tokens`` false unless the request
says otherwise: ``KEEPS_SPECIAL_TOKENS``). What follows the first ``[TOOL_CALLS]`` is calls only if it
parses whole; else the whole output is content. Streamed, content goes out as generated (a tail that may
begin ``[TOOL_CALLS]``, or is whitespace, waits), then the calls at the end.

``openai`` (gpt-oss, with ``--reasoning-parser openai_gptoss``): a harmony message addressed to a function,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS``, is a call (its recipient
may also stand before the channel); the harmony split leaves such messages in the answer as written, and
the rest of the answer is the content. Its markers are special tokens (``KEEPS_SPECIAL_TOKENS``). Streamed,
content goes out up to the first marker, the calls at the end.

Each parser gives ``parse(text) -> (content, [(name, arguments JSON)])`` and ``stream()``, an object whose
``feed(text so far)`` returns (new content, new calls) and ``finish(text)`` the content still held.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
from collections.abc import Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's JSON, None when it is not a call: a call is an object
    with a string ``name`` and an object of ``arguments`` (or ``parameters``), which may come as its JSON
    text; any other JSON (``{"name": "Alice", "age": 30}``, say) is an answer, not a call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    arguments = value.get(key) if key else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole output: calls as (name, arguments JSON) in order, content the text outside
    the call blocks (stripped where calls were taken)."""
    content, calls, rest = [], [], text
    while True:
        start = rest.find(OPEN)
        end = rest.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(rest)
            break
        call = _call(rest[start + len(OPEN):end])
        content.append(rest[:start])
        if call is None:
            content.append(rest[start:end + len(CLOSE)])
        else:
            calls.append(call)
        rest = rest[end + len(CLOSE):]
    joined = "".join(content)
    return (joined.rstrip() if calls else joined), calls


class HermesStream:
    """Incremental :func:`parse_hermes` over a streamed output: :meth:`feed` takes the text so far and returns
    (new content, new calls) to send; :meth:`finish` the rest once the output ends."""

    def __init__(self):
        self.done = 0  # characters of the text already handed out (as content or as calls)
        self.calls = 0
        self.spaces = ""  # whitespace at the end of the content so far, held until more content follows

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        content, calls = self._feed(text)
        return self._release(content), calls

    def _release(self, content: str) -> str:
        """``content`` to send now: whitespace at its end waits (a whole parse drops it after the last call)."""
        combined = self.spaces + content
        kept = combined.rstrip()
        self.spaces = combined[len(kept):]
        return kept

    def _feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        content, calls = [], []
        while True:
            rest = text[self.done:]
            start = rest.find(OPEN)
            if start < 0:
                keep = partial_tag(rest)
                content.append(rest[:len(rest) - keep])
                self.done += len(rest) - keep
                break
            end = rest.find(CLOSE, start + len(OPEN))
            content.append(rest[:start])
            if end < 0:  # inside a block: wait for its close
                self.done += start
                break
            call = _call(rest[start + len(OPEN):end])
            if call is None:
                content.append(rest[start:end + len(CLOSE)])
            else:
                calls.append(call)
            self.done += end + len(CLOSE)
        self.calls += len(calls)
        return "".join(content), calls

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """(content, calls) still held when the output ends: a partial tag or an unterminated block, as
        content."""
        content, calls = self._feed(text)
        rest = text[self.done:]
        self.done = len(text)
        out = self._release(content + rest)
        if not self.calls:  # no call: the content is the text as written, trailing whitespace too
            out, self.spaces = out + self.spaces, ""
        return out, calls


def partial_tag(text: str, tag: str = OPEN) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back until it is decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_llama3_json(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole Llama 3 JSON output (module docstring)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(json.dumps(value))
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return "", calls


def _llama3_json_start(start: str) -> bool | None:
    """Whether an output beginning with ``start`` (not empty, whitespace stripped) is held for the Llama 3
    JSON parse; None while it may still become the python tag."""
    if len(start) < len(PYTHON_TAG) and PYTHON_TAG.startswith(start):
        return None
    return start.startswith("{") or start.startswith(PYTHON_TAG)


class HeldStream:
    """Incremental parse of a format whose calls are the whole output: content streams until the output's
    beginning (``starts``: True, False, or None while undecided) shows it may be calls, after which
    everything waits for the end and ``parse`` decides."""

    def __init__(self, starts, parse):
        self.starts, self.parse = starts, parse
        self.sent = 0
        self.calls = 0
        self.held: bool | None = None  # None: undecided (only whitespace so far)

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        if self.held is None:
            start = text.lstrip()
            if not start or (held := self.starts(start)) is None:
                return "", []
            self.held = held
        if self.held:
            return "", []
        new, self.sent = text[self.sent:], len(text)
        return new, []

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """(content, calls) still to send once the output ends."""
        if not self.held:
            new, self.sent = text[self.sent:], len(text)
            return new, []
        content, calls = self.parse(text)
        self.calls += len(calls)
        return content, calls


class Llama3JsonStream(HeldStream):
    """Incremental :func:`parse_llama3_json`: content streams until the output shows it begins with ``{``,
    after which everything waits for the end."""

    def __init__(self):
        super().__init__(_llama3_json_start, parse_llama3_json)


def parse_pythonic(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole pythonic output (module docstring)."""
    body = text.strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return text, []
        arguments = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return text, []
            try:
                arguments[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return text, []
        try:
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):  # a set, bytes or a complex number: no JSON for it
            return text, []
    return "", calls


class PythonicStream(HeldStream):
    """Incremental :func:`parse_pythonic`: an output that begins with ``[`` is held to its end."""

    def __init__(self):
        super().__init__(lambda start: start.startswith("["), parse_pythonic)


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _mistral_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls after the first ``[TOOL_CALLS]`` (either syntax of the module docstring); None where it is not
    calls only."""
    stripped = body.strip()
    if stripped.startswith(("[", "{")):
        try:
            value = json.loads(stripped)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_call(json.dumps(item)) for item in items]
        return calls if calls and None not in calls else None
    calls = []
    for part in body.split(MISTRAL_CALLS):
        name, sep, arguments = part.partition(MISTRAL_ARGS)
        call = _call(json.dumps({"name": name.strip(), "arguments": arguments.strip()})) if sep else None
        if call is None or not _TOOL_NAME_CHARS.issuperset(call[0]) or not call[0]:
            return None
        calls.append(call)
    return calls



def parse_mistral(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole Mistral output (module docstring): content is the text before
    ``[TOOL_CALLS]``, its trailing whitespace dropped."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return text, []
    calls = _mistral_calls(text[at + len(MISTRAL_CALLS):])
    return (text[:at].rstrip(), calls) if calls else (text, [])


class TaggedStream:
    """Incremental parse of a format whose calls follow a tag (``tags``: any of them begins the calls):
    content streams up to the first tag (a tail that may begin one, or is whitespace, held until decided);
    from there the output waits for its end, where ``parse`` decides."""

    def __init__(self, tags: tuple[str, ...], parse: Callable[[str], tuple[str, list[tuple[str, str]]]]):
        self.tags, self.parse = tags, parse
        self.sent = 0  # characters of the text handed out as content or held as whitespace
        self.handed = ""  # the content handed out
        self.calls = 0
        self.spaces = ""
        self.tagged = False

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        if self.tagged:
            return "", []
        rest = text[self.sent:]
        at = min((i for i in (rest.find(tag) for tag in self.tags) if i >= 0), default=-1)
        if at >= 0:
            self.tagged = True
            new = rest[:at]
        else:
            new = rest[:len(rest) - max(partial_tag(rest, tag) for tag in self.tags)]
        self.sent += len(new)
        combined = self.spaces + new
        kept = combined.rstrip()
        self.spaces = combined[len(kept):]
        self.handed += kept
        return kept, []

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The content the whole parse has beyond what went out, and the calls."""
        content, _ = self.feed(text)
        whole, calls = self.parse(text)
        self.calls += len(calls)
        rest = whole[len(self.handed):] if whole.startswith(self.handed) else whole
        self.handed, self.sent, self.spaces = whole, len(text), ""
        return content + rest, calls


HARMONY_MARKERS = ("<|start|>", "<|channel|>")
_HARMONY_HEADER = re.compile(r"(?:<\|start\|>[^<]*)?<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")
_HARMONY_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_\-.]+)")
#: What ends a harmony message's body.
HARMONY_CALL_ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")


def harmony_call_header(text: str) -> tuple[str, int] | None:
    """The first harmony message of ``text`` addressed to a function: (its name, where its body starts), once
    its header is whole; None before (or where no message addresses one)."""
    for header in _HARMONY_HEADER.finditer(text):
        recipient = _HARMONY_RECIPIENT.search(header.group(0))
        if recipient is not None:
            return recipient.group(1), header.end()
    return None


def parse_openai(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of an answer holding harmony messages (module docstring): each message addressed to a
    function whose arguments parse as a JSON object is a call; one that does not (cut short, broken) is
    dropped with its markers; the rest is the content (its trailing whitespace dropped where calls were
    taken)."""
    content, calls, at = [], [], 0
    for header in _HARMONY_HEADER.finditer(text):
        recipient = _HARMONY_RECIPIENT.search(header.group(0))
        if recipient is None or header.start() < at:
            continue
        body = header.end()
        ends = [i for i in (text.find(m, body) for m in HARMONY_CALL_ENDS) if i >= 0]
        end = min(ends) if ends else len(text)
        call = _call(json.dumps({"name": recipient.group(1), "arguments": text[body:end].strip()}))
        content.append(text[at:header.start()])
        if call is not None:
            calls.append(call)
        at = end
        for marker in ("<|end|>", "<|call|>", "<|return|>"):
            if text.startswith(marker, at):
                at += len(marker)
                break
    content.append(text[at:])
    joined = "".join(content)
    return (joined.rstrip() if calls else joined), calls


@dataclasses.dataclass(frozen=True)
class ToolParser:
    """One ``--tool-call-parser``: ``parse(text) -> (content, calls)`` of a whole output, and ``stream()``, a
    new incremental parse of one streamed output."""

    parse: Callable[[str], tuple[str, list[tuple[str, str]]]]
    stream: Callable[[], object]


#: --tool-call-parser NAME -> its parser.
PARSERS = {
    "hermes": ToolParser(parse_hermes, HermesStream),
    "llama3_json": ToolParser(parse_llama3_json, Llama3JsonStream),
    "mistral": ToolParser(parse_mistral, functools.partial(TaggedStream, (MISTRAL_CALLS,), parse_mistral)),
    "openai": ToolParser(parse_openai, functools.partial(TaggedStream, HARMONY_MARKERS, parse_openai)),
    "pythonic": ToolParser(parse_pythonic, PythonicStream),
}
#: Parsers whose syntax is made of special tokens: their requests are detokenized with them by default.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "openai"})


class FirstCallOnly:
    """A parser's stream that hands out its content and only the first call it finds (OpenAI's
    ``parallel_tool_calls`` false under ``"auto"``: the model may still write more, which are dropped)."""

    def __init__(self, stream):
        self.inner = stream
        self.calls = 0

    def _first(self, found: tuple[str, list[tuple[str, str]]]) -> tuple[str, list[tuple[str, str]]]:
        content, calls = found
        calls = calls[:max(0, 1 - self.calls)]
        self.calls += len(calls)
        return content, calls

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        return self._first(self.inner.feed(text))

    def finish(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        return self._first(self.inner.finish(text))


def parse_calls(parser: str, text: str, parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of a whole output under ``parser``; the first call only where ``parallel`` is False."""
    content, calls = PARSERS[parser].parse(text)
    return content, calls if parallel else calls[:1]


def stream_calls(parser: str, parallel: bool = True):
    """A stream of ``parser`` (``feed``, ``finish``, ``calls``); the first call only where ``parallel`` is False."""
    stream = PARSERS[parser].stream()
    return stream if parallel else FirstCallOnly(stream)
