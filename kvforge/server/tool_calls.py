"""Function calling by constraint: a chat request's ``tools`` with ``tool_choice`` ``"required"`` or a named
function, as vLLM serves them without a tool-call parser.

The functions reach the chat template as its ``tools`` variable (so a template that describes them to the
model does), and the output is held to a JSON schema (kvforge/structured/): a named function's output is
its arguments (the function's ``parameters`` schema); ``"required"`` makes the output a JSON array of one
or more ``{"name": ..., "parameters": {...}}`` calls, each to a listed function with its own schema.
The response then carries ``message.tool_calls`` (``content`` null), with ``finish_reason`` ``"tool_calls"``
for ``"required"`` and ``"stop"`` for a named function (OpenAI's answer to a forced call);
``parallel_tool_calls`` false holds ``"required"`` to one call (under ``"auto"``: kvforge/server/tool_parsers.py, ``FirstCallOnly``). A function declared without ``parameters``
takes none (its arguments are ``{}``), as OpenAI defines it. A stop string or stop token can also end the
output early (``finish_reason`` ``"stop"`` with its ``stop_reason``): a named call's arguments then do not
parse either. An output cut
short by ``max_tokens`` keeps ``finish_reason`` ``"length"``: the calls begun keep their arguments as far
as they went (a call's arguments are the model's text as written); a ``"required"`` array cut before its
first call's name comes back as ``content``. Streamed, each call goes out as its name is written and its
arguments as they are generated (:class:`ToolCallStream`).

``tool_choice`` ``"none"`` renders the tools and constrains nothing. ``"auto"`` (OpenAI's default when
``tools`` are sent) needs a parser of the model's own tool-call syntax (kvforge/server/tool_parsers.py),
which the server takes with ``--enable-auto-tool-choice --tool-call-parser NAME``; without one it is
refused with what to send instead.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from kvforge.errors import InvalidRequestError
from kvforge.server.request_fields import bad_field, get_array, get_typed, shown, type_name
from kvforge.structured.params import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: A function's parameters when its declaration has none: OpenAI's empty parameter list (the arguments ``{}``).
NO_PARAMETERS = {"type": "object", "properties": {}}
#: Where each function's schema sits inside a ``"required"`` array's schema, as compile errors name it.
_IN_ARRAY = re.compile(r"#/items/anyOf/(\d+)/properties/parameters")
_DEFINITIONS = ("$defs", "definitions")
#: Keys of a parameters schema without a ``type`` that let it describe something other than an object.
_NOT_AN_OBJECT = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const", "not", "if", "items"})


#: One call of a ``"required"`` array up to its name's closing quote (the constraint writes the name first), and
#: what comes between the name and the arguments.
_CALL_NAME = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]*)"')
_TO_ARGUMENTS = re.compile(r'\s*,\s*"parameters"\s*:\s*')


def _object_end(text: str, start: int) -> int:
    """The index after the JSON object opening at ``start``, or -1 where ``text`` ends inside it."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def array_calls(text: str) -> list[tuple[str, str, bool]]:
    """The calls of a ``"required"`` array so far, as the constraint writes it: (name, the arguments' text as
    far as it goes, "" before they begin, whether they are complete) for each call whose name is written; a
    stream reads them as they grow."""
    at = text.find("[")
    calls: list[tuple[str, str, bool]] = []
    if at < 0:
        return calls
    at += 1
    while True:
        name = _CALL_NAME.match(text, at)
        if name is None:
            return calls
        head = _TO_ARGUMENTS.match(text, name.end())
        if head is None or head.end() == len(text):  # the output ends before the arguments begin
            calls.append((name.group(1), "", False))
            return calls
        end = _object_end(text, head.end())
        if end < 0:
            calls.append((name.group(1), text[head.end():], False))
            return calls
        calls.append((name.group(1), text[head.end():end], True))
        at = text.find("}", end)  # the call object's own close
        if at < 0:
            return calls
        at += 1


@dataclass(frozen=True)
class ToolChoice:
    """A request's forced tool call: ``name`` for a named function, None for ``"required"`` (any listed
    function, one or more calls); ``parameters``: each listed function's parameters schema, by name."""

    name: str | None
    parameters: tuple[tuple[str, str], ...]
    #: OpenAI's ``parallel_tool_calls``: False holds a ``"required"`` output to one call.
    parallel: bool = True
    #: gpt-oss (``--reasoning-parser openai_gptoss``): the output is one harmony call (:meth:`harmony_constraint`)
    #: whose arguments follow its header, in place of the JSON of the calls.
    harmony: bool = False

    def harmony_call(self, text: str) -> tuple[str, str] | None:
        """A harmony output's call: (function, its arguments as far as they are written), once the header that
        addresses it is whole; None before."""
        from kvforge.server.tool_parsers import HARMONY_CALL_ENDS, harmony_call_header

        header = harmony_call_header(text)
        if header is None:
            return None
        name, body = header
        ends = [i for i in (text.find(m, body) for m in HARMONY_CALL_ENDS) if i >= 0]
        return name, text[body:min(ends) if ends else len(text)]

    def finish_reason(self, reason: str | None, text: str) -> str | None:
        """The choice's finish reason: a ``"required"`` output that ended complete is ``"tool_calls"``; the
        engine's reason otherwise (a named call's complete output stays ``"stop"``, OpenAI's answer)."""
        if reason == "stop" and self.name is None and self.complete(text):
            return "tool_calls"
        return reason

    def complete(self, text: str) -> bool:
        """Whether ``text`` is a whole ``"required"`` array of calls (a named call: whole arguments; harmony:
        a call whose arguments are whole)."""
        if self.harmony:
            call = self.harmony_call(text)
            if call is None:
                return False
            text = call[1]
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    def last_call_open(self, text: str) -> bool:
        """Whether the last call's arguments are unfinished: a named call's where the output (its arguments)
        does not parse, a ``"required"`` array's where the output ended before they closed, a harmony call's
        where its header is whole and its arguments are not."""
        if self.harmony:
            return self.harmony_call(text) is not None and not self.complete(text)
        if self.name is not None:
            return not self.complete(text)
        calls = array_calls(text)
        return bool(calls) and not calls[-1][2]

    def constraint(self) -> StructuredOutputsParams:
        """The JSON schema the output is held to (module docstring). In a ``"required"`` array each function's
        ``$defs`` (and ``definitions``) move to the array schema's root, where their ``#/$defs/...``
        references find them (pydantic writes every nested model and enum there); two functions defining one
        name differently, or a reference to another part of a function's own schema, are refused."""
        schemas = {name: json.loads(text) for name, text in self.parameters}
        if self.name is not None:
            return StructuredOutputsParams(json=schemas[self.name])
        shared: dict[str, dict] = {}
        calls = []
        for i, (name, schema) in enumerate(schemas.items()):
            schema = dict(schema)
            for key in _DEFINITIONS:
                for def_name, definition in (schema.pop(key, None) or {}).items():
                    seen = shared.setdefault(key, {})
                    if seen.get(def_name, definition) != definition:
                        bad_field("tools", f"two functions define {key}/{def_name} differently; rename one of them")
                    seen[def_name] = definition
            for ref in _refs(schema):
                if ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
                    bad_field(f"tools[{i}].function.parameters", f"$ref {shown(ref)} points into the function's own "
                                                                 f"schema, which a required call array cannot keep: "
                                                                 f"move the target under $defs")
            calls.append({"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                          "required": ["name", "parameters"]})
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **shared}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def harmony_constraint(self) -> StructuredOutputsParams:
        """The constraint of a gpt-oss output forced to call: the named function, or (``"required"``) any listed
        one, in harmony's commentary message (kvforge/structured/harmony_call.py); one call, the format's own
        (a harmony call ends the turn)."""
        functions = self.parameters if self.name is None else [p for p in self.parameters if p[0] == self.name]
        return StructuredOutputsParams(harmony_call=tuple((name, json.loads(text)) for name, text in functions))

    def explain(self, error: InvalidRequestError, index: int | None = None) -> InvalidRequestError:
        """``error`` (about the constraint, named as the compiler saw it) told in the request's terms: the
        function whose parameters it is about, ``tools[i].function.parameters``: the named one, ``index``
        where the caller found it (a ``"required"`` array's function refused alone), else the one the paths
        in the message point into (``tools`` where they name none or several)."""
        message = str(error)
        if index is None and self.name is not None:
            index = [name for name, _ in self.parameters].index(self.name)
        if index is None:
            pointed = {m.group(1) for m in _IN_ARRAY.finditer(message)}
            message = _IN_ARRAY.sub(lambda m: f"tools[{m.group(1)}].function.parameters#", message)
            field = f"tools[{pointed.pop()}].function.parameters" if len(pointed) == 1 else "tools"
        else:
            field = f"tools[{index}].function.parameters"
            message = re.sub(r"(?<![\w\]])#", f"{field}#", message)
        message = message.replace(error.field or "", field, 1)
        return InvalidRequestError(message, field=field)

    def functions(self) -> list[StructuredOutputsParams]:
        """Each listed function's parameters as a constraint of its own, in ``tools`` order: where a
        ``"required"`` array is refused, the first of these the compiler refuses names the function."""
        return [StructuredOutputsParams(json=json.loads(text)) for _, text in self.parameters]

    def calls(self, text: str) -> list[dict] | None:
        """The ``tool_calls`` of output ``text``: a named function's call with ``text`` as its arguments; the
        calls of a ``"required"`` array with their arguments as written (the last one's as far as they go
        where the output was cut inside them), or None where no call's name was written; harmony: its one
        call as far as it goes, none where the output ended inside the header (no content either: the
        header is format, not text)."""
        if self.harmony:
            call = self.harmony_call(text)
            return [call_object(*call)] if call is not None else []
        if self.name is not None:
            return [call_object(self.name, text)]
        return [call_object(name, arguments) for name, arguments, _ in array_calls(text)] or None


def _refs(schema) -> list[str]:
    """Every ``$ref`` string inside ``schema``."""
    if isinstance(schema, dict):
        found = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return found + [r for value in schema.values() for r in _refs(value)]
    if isinstance(schema, list):
        return [r for value in schema for r in _refs(value)]
    return []


def call_object(name: str, arguments: str) -> dict:
    """One entry of OpenAI's ``tool_calls``."""
    from kvforge.server.protocol import random_id

    return {"id": random_id("chatcmpl-tool"), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tools(body: dict, parser: str | None = None,
                harmony: bool = False) -> tuple[list[dict] | None, ToolChoice | None, bool]:  # fmt: skip
    """A chat body's ``tools`` (as the template gets them, None for none), its forced call (None for no
    constraint), and whether the model chooses (``"auto"``, served where the server has a tool-call
    ``parser``: kvforge/server/tool_parsers.py); InvalidRequestError naming the field for a malformed
    declaration or a choice this server cannot honour. ``harmony``: the model is gpt-oss, whose forced call
    is its own harmony call (:attr:`ToolChoice.harmony`). ``parallel_tool_calls`` is read as the request's
    other fields are (its type checked there): only false holds a ``"required"`` array to one call."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        bad_field(name, "is OpenAI's deprecated spelling: send the functions as 'tools' and the choice as 'tool_choice'")
    tools = get_array(body, "tools", None)
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls") is not False
    if not tools:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            bad_field("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "function": '
                                     f'{{"name": ...}}}}, got {shown(choice)}')
        if choice not in (None, "none", "auto"):
            bad_field("tool_choice", "names a tool call but the request sends no 'tools'")
        return None, None, False
    parameters = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            bad_field(f"tools[{i}]", 'expected {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            bad_field(f"tools[{i}].function.name", "must be 1-64 letters, digits, underscores or dashes")
        if any(name == other for other, _ in parameters):
            bad_field(f"tools[{i}].function.name", f"{shown(name)} is declared twice")
        schema = function.get("parameters")
        if schema is not None and (not isinstance(schema, dict) or schema.get("type", "object") != "object"
                                   or ("type" not in schema and _NOT_AN_OBJECT & set(schema))):
            bad_field(f"tools[{i}].function.parameters", 'must be a JSON schema of an object ({"type": "object", '
                                                         '"properties": {...}}), the arguments\' shape')
        parameters.append((name, json.dumps(schema if schema else NO_PARAMETERS)))
    if choice is None or choice == "auto":
        if parser is not None:
            return tools, None, True
        bad_field("tool_choice", f'"auto" (the default with tools) needs a parser of the model\'s tool-call syntax, '
                                 f'which this server was not started with (--enable-auto-tool-choice --tool-call-parser '
                                 f'{"openai" if harmony else "hermes"}): send "required" or {{"type": "function", '
                                 f'"function": {{"name": ...}}}} to have the output constrained to a call, or "none"')
    if choice == "none":
        return tools, None, False
    if choice == "required":
        forced = ToolChoice(None, tuple(parameters), parallel)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str):
            bad_field("tool_choice.function.name", f"expected a string, got {type_name(name)}")
        if name not in dict(parameters):
            bad_field("tool_choice", f"names function {shown(name)}, which 'tools' does not declare")
        forced = ToolChoice(name, tuple(parameters), parallel)
    else:
        bad_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if harmony:
        forced = dataclasses.replace(forced, harmony=True)
    for index, (name, text) in enumerate(parameters):  # each schema the constraint holds, refused by its own path
        if forced.name in (None, name):
            try:
                StructuredOutputsParams(json=json.loads(text))
            except InvalidRequestError as e:
                raise forced.explain(e, index) from None
    try:
        forced.harmony_constraint() if harmony else forced.constraint()
    except InvalidRequestError as e:  # a parameters schema that is not valid JSON-schema input
        if (e.field or "").startswith("tools"):
            raise
        raise forced.explain(e) from None
    return tools, forced, False


def template_message(message: dict, index: int) -> dict:
    """The tool fields of one chat message as a template reads them: an assistant turn's ``tool_calls``
    (``arguments`` parsed from their JSON text into objects, as vLLM hands them to templates that write
    them with ``tojson``) and a tool turn's ``tool_call_id`` and ``name``; {} for other messages. ``name``
    and ``tool_call_id`` are strings on any message."""
    out: dict[str, Any] = {}
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            bad_field(f"messages[{index}].tool_calls", "expected an array of tool calls")
        clean = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                bad_field(f"messages[{index}].tool_calls[{j}]", 'expected {"id": ..., "type": "function", "function": '
                                                                '{"name": ..., "arguments": "..."}}')
            # OpenAI's arguments are a string of JSON; vLLM takes them as an object too. None or "": no arguments.
            arguments = get_typed(function, "arguments", None, "string", "object",
                                  where=f"messages[{index}].tool_calls[{j}].function.") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass  # kept as its text: the template writes what the client sent
            clean.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
        out["tool_calls"] = clean
    for key in ("tool_call_id", "name"):  # strings on every message; a tool turn's reach the template
        value = get_typed(message, key, None, "string", where=f"messages[{index}].")
        if role == "tool" and value is not None:
            out[key] = value
    return out


class ToolCallStream:
    """The ``delta`` objects of one streamed choice under a forced call, each call's arguments streamed as
    they are generated (a call's first fragment with its id, type and name, as OpenAI streams calls): a
    named call's are the output; a ``"required"`` array's calls go out as their names are written. An
    array that never wrote a call's name comes out as ``content`` when the output ends."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.sent: list[int] = []  # per call begun: characters of its arguments sent

    def delta(self, new_text: str, text: str, finished: bool) -> dict:
        """The delta for ``new_text`` (this chunk's text), ``text`` being all of it so far."""
        if self.choice.harmony:
            call = self.choice.harmony_call(text)
            calls = [call] if call is not None else []
        elif self.choice.name is not None:
            calls = [(self.choice.name, text)] if text or finished else []
        else:
            calls = [(name, arguments) for name, arguments, _ in array_calls(text)]
            if finished and not calls:
                return {"content": text} if text else {}
        out = []
        for k, (name, arguments) in enumerate(calls):
            if k == len(self.sent):
                self.sent.append(len(arguments))
                out.append({"index": k, **call_object(name, arguments)})
            elif len(arguments) > self.sent[k]:
                out.append({"index": k, "function": {"arguments": arguments[self.sent[k]:]}})
                self.sent[k] = len(arguments)
        return {"tool_calls": out} if out else {}


def with_tools(options, tools) -> object:
    """Chat template ``options`` (ChatTemplateOptions) with ``tools`` (checked as a chat request's are) as the
    template's ``tools`` variable; ``options`` unchanged for none. For renderings that take tools without a
    tool choice (``/tokenize``, ``LLM.chat``)."""
    if not tools:
        return options
    checked, _, _ = parse_tools({"tools": tools, "tool_choice": "none"})
    if any(key == "tools" for key, _ in options.template_kwargs):
        bad_field("chat_template_kwargs", "may not set tools (the 'tools' argument sets it)")
    return dataclasses.replace(options, template_kwargs=(*options.template_kwargs, ("tools", checked)))
