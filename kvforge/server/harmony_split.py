"""gpt-oss's harmony format split into reasoning and answer (``--reasoning-parser openai_gptoss``, vLLM's name),
whole (:func:`split_harmony`) or as it streams (:class:`HarmonyStream`).

A harmony output is a run of messages, each a header and its content: ``<|channel|>NAME[ to=RECIPIENT][
<|constrain|>TYPE]<|message|>CONTENT``, ended by ``<|end|>`` (or the end of the output: ``<|return|>`` and
``<|call|>`` end generation and add no text); a later message starts with ``<|start|>assistant``. The text
is read with its special tokens (the server keeps them for these requests).

- ``analysis`` messages are the reasoning (joined in order);
- ``final`` messages, and ``commentary`` messages without a recipient (preambles shown to the user), are
  the answer: their contents;
- a message with a recipient (a tool call, ``to=functions.NAME``) stays in the answer as written, header
  and all, for a tool-call parser; a message of an unknown channel too.

Text before the first header, or an output without any, is answer. Streamed, a header is read once its
``<|message|>`` has come, and a tail that may begin a marker waits; the pieces join to the whole split.
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
    ends = [i for i in (text.find(END, at), text.find(START, at), text.find(CALL, at), text.find(RETURN, at))
            if i >= 0]
    return min(ends) if ends else len(text)


def _parse(text: str, complete: bool) -> tuple[list[str], list[str]]:
    """(reasoning pieces, answer pieces) of ``text``; where not ``complete``, a header still without its
    ``<|message|>`` adds nothing yet."""
    reasoning, answer = [], []
    first = min((i for i in (text.find(CHANNEL), text.find(START)) if i >= 0), default=-1)
    if first < 0:
        return reasoning, [text]
    if first > 0:
        answer.append(text[:first])
    at = first
    while at < len(text):
        opens = text.find(MESSAGE, at)
        if opens < 0:
            if complete:  # a header the output never finished: as written
                answer.append(text[at:])
            break
        header = text[at:opens]
        body = opens + len(MESSAGE)
        ends = _content_end(text, body)
        content = text[body:ends]
        channel = _channel(header)
        if _RECIPIENT.search(header) or channel not in ("analysis", "final", "commentary"):
            answer.append(text[at:ends])  # a tool call (or a channel this split does not know): as written
        elif channel == "analysis":
            reasoning.append(content)
        else:
            answer.append(content)
        at = ends + len(END) if text.startswith(END, ends) else ends
    return reasoning, answer


def split_harmony(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole harmony output; reasoning None where it has no analysis message."""
    reasoning, answer = _parse(text, complete=True)
    return ("".join(reasoning) if reasoning else None), "".join(answer)


class HarmonyStream:
    """:func:`split_harmony` of a streamed output: :meth:`feed` takes the text so far and returns (new
    reasoning, the answer so far); :meth:`finish` the same once the output has ended. ``phase`` is ANSWER
    once an answer message has begun, ``thought`` whether any analysis came."""

    def __init__(self):
        self.sent = 0  # characters of reasoning handed out
        self.phase = REASONING
        self.thought = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text[:len(text) - _partial_marker(text)], complete=False)

    def finish(self, text: str) -> tuple[str, str]:
        return self._step(text, complete=True)

    def _step(self, text: str, complete: bool) -> tuple[str, str]:
        reasoning, answer = _parse(text, complete)
        joined = "".join(reasoning)
        new, self.sent = joined[self.sent:], len(joined)
        self.thought = self.thought or bool(reasoning)
        if answer:
            self.phase = ANSWER
        return new, "".join(answer)
