"""gpt-oss's harmony format split into reasoning and answer (``--reasoning-parser openai_gptoss``, vLLM's name),
whole (:func:`split_harmony`) or as it streams (:class:`HarmonyStream`).

A harmony output is a run of messages, each a header and its content: ``<|channel|>NAME[ to=RECIPIENT][
<|constrain|>TYPE]<|message|>CONTENT``, ended by ``<|end|>`` (or the end of the output: ``<|return|>`` and
``<|call|>`` end generation and add no text); a later message starts with ``<|start|>assistant``. The text
is read with its special tokens (the server keeps them for these requests).

- ``analysis`` messages are the reasoning, and so are calls to built-in tools (``to=browser.search``,
  ``to=python``), which the server does not run;
- ``final`` messages, and ``commentary`` messages without a recipient (preambles shown to the user), are
  the answer: their contents;
- a call to a function (``to=functions.NAME``) stays in the answer as written, header and all, for the
  ``openai`` tool-call parser.

Several messages of one kind join with newlines. Text before the first header, or an output without any,
is answer; a header the output never finished adds nothing, so no marker reaches the answer but a function
call's. Streamed, a header is read once its ``<|message|>`` has come, and a tail that may begin a marker
waits; the pieces join to the whole split.
"""

from __future__ import annotations

import re

from kvforge.reasoning import ANSWER, REASONING

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
CALL, RETURN = "<|call|>", "<|return|>"
MARKERS = (CHANNEL, MESSAGE, END, START, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=(\S+)")


def _partial_marker(text: str) -> int:
    """Length of the longest end of ``text`` that begins a marker."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


def _channel(header: str) -> str:
    """The channel a header names (its first word after ``<|channel|>``), "" for none."""
    _, marker, rest = header.partition(CHANNEL)
    words = rest.replace("<|constrain|>", " ").split()
    return words[0] if marker and words else ""


def _content_end(text: str, at: int) -> int:
    ends = [i for i in (text.find(m, at) for m in (END, START, CALL, RETURN)) if i >= 0]
    return min(ends) if ends else len(text)


def _past_terminator(text: str, at: int) -> int:
    """``at`` moved past a message's ``<|end|>`` (or ``<|call|>`` / ``<|return|>``, where they are text)."""
    for marker in (END, CALL, RETURN):
        if text.startswith(marker, at):
            return at + len(marker)
    return at


def _parse(text: str) -> tuple[list[str], list[str], bool]:
    """(reasoning pieces, answer pieces, whether an answer began) of ``text``. A header without its
    ``<|message|>`` yet (or ever: an output cut inside it) adds nothing."""
    reasoning, answer = [], []
    first = min((i for i in (text.find(CHANNEL), text.find(START)) if i >= 0), default=-1)
    if first < 0:
        return reasoning, [text] if text else [], bool(text)
    if first > 0:
        answer.append(text[:first])
    at, answered = first, first > 0
    while at < len(text):
        opens = text.find(MESSAGE, at)
        if opens < 0:
            break
        header = text[at:opens]
        body = opens + len(MESSAGE)
        ends = _content_end(text, body)
        content = text[body:ends]
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            answer.append(text[at:ends])  # a function call: as written, for the tool-call parser
            answered = True
        elif recipient or _channel(header) == "analysis":
            reasoning.append(content)  # thinking, or a built-in tool's call (browser, python): not served
        else:
            answer.append(content)  # final, a commentary preamble, or a channel this split does not know
            answered = True
        at = _past_terminator(text, ends)
    return reasoning, answer, answered


def split_harmony(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole harmony output; reasoning None where it has no analysis message.
    Several messages of one kind are joined by newlines."""
    reasoning, answer, _ = _parse(text)
    return ("\n".join(reasoning) if reasoning else None), "\n".join(answer)


class HarmonyStream:
    """:func:`split_harmony` of a streamed output: :meth:`feed` takes the text so far and returns (new
    reasoning, the answer so far); :meth:`finish` the same once the output has ended. ``phase`` is ANSWER
    once an answer message has begun, ``thought`` whether any analysis came."""

    def __init__(self):
        self.sent = 0  # characters of reasoning handed out
        self.phase = REASONING
        self.thought = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text[:len(text) - _partial_marker(text)])

    def finish(self, text: str) -> tuple[str, str]:
        return self._step(text)

    def _step(self, text: str) -> tuple[str, str]:
        reasoning, answer, answered = _parse(text)
        joined = "\n".join(reasoning)
        new, self.sent = joined[self.sent:], len(joined)
        self.thought = self.thought or bool(reasoning)
        if answered:
            self.phase = ANSWER
        return new, "\n".join(answer)
