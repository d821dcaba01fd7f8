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


_TERMINATORS = (END, START, CALL, RETURN)
_LONGEST = max(map(len, MARKERS))


def _past_terminator(text: str, at: int) -> int:
    """``at`` moved past a message's ``<|end|>`` (or ``<|call|>`` / ``<|return|>``, where they are text)."""
    for marker in (END, CALL, RETURN):
        if text.startswith(marker, at):
            return at + len(marker)
    return at


class _Messages:
    """The messages of a text that only grows (a stream's text so far), read once each: a message whose
    terminator has come is settled into ``reasoning`` / ``answer`` and never read again, and the search for
    the next marker resumes a marker's length before where the last search ended. So each :meth:`read` costs
    what the text grew by (and the joined answer), not the whole text."""

    def __init__(self):
        self.reasoning: list[str] = []  # settled pieces
        self.answer: list[str] = []
        self.answered = False
        self.at = -1  # where the first unsettled message's header begins (-1: no header seen yet)
        self.body = -1  # where its content begins once its <|message|> has come (-1: not yet)
        self.scan = 0  # no marker this reader looks for begins before here

    def read(self, text: str) -> tuple[list[str], list[str], bool]:
        """(reasoning pieces, answer pieces, whether an answer began) of ``text``, which extends every text
        read before. A header without its ``<|message|>`` yet (or ever: an output cut inside it) adds
        nothing; the last message's content counts as far as it has come."""
        if self.at < 0:
            found = [i for i in (text.find(CHANNEL, self.scan), text.find(START, self.scan)) if i >= 0]
            if not found:
                self.scan = max(0, len(text) - _LONGEST + 1)
                return [], [text] if text else [], bool(text)
            self.at = self.scan = min(found)
            if self.at > 0:
                self.answer.append(text[:self.at])
                self.answered = True
        while self.at < len(text):
            if self.body < 0:
                opens = text.find(MESSAGE, self.scan)
                if opens < 0:
                    self.scan = max(self.at, len(text) - len(MESSAGE) + 1)
                    break
                self.body = self.scan = opens + len(MESSAGE)
            ends = [i for i in (text.find(m, self.scan) for m in _TERMINATORS) if i >= 0]
            if not ends:  # the last message, still coming
                self.scan = max(self.body, len(text) - _LONGEST + 1)
                reasoning, answer, answered = self._sort(text, len(text))
                return self.reasoning + reasoning, self.answer + answer, self.answered or answered
            end = min(ends)
            reasoning, answer, answered = self._sort(text, end)
            self.reasoning += reasoning
            self.answer += answer
            self.answered = self.answered or answered
            self.at = self.scan = _past_terminator(text, end)
            self.body = -1
        return list(self.reasoning), list(self.answer), self.answered

    def _sort(self, text: str, end: int) -> tuple[list[str], list[str], bool]:
        """The unsettled message's content up to ``end``, as reasoning or answer by its header."""
        header = text[self.at:self.body - len(MESSAGE)]
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            return [], [text[self.at:end]], True  # a function call: as written, for the tool-call parser
        if recipient or _channel(header) == "analysis":
            return [text[self.body:end]], [], False  # thinking, or a built-in tool's call: not served
        return [], [text[self.body:end]], True  # final, a commentary preamble, or a channel not known here


def split_harmony(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole harmony output; reasoning None where it has no analysis message.
    Several messages of one kind are joined by newlines."""
    reasoning, answer, _ = _Messages().read(text)
    return ("\n".join(reasoning) if reasoning else None), "\n".join(answer)


class HarmonyStream:
    """:func:`split_harmony` of a streamed output: :meth:`feed` takes the text so far and returns (new
    reasoning, the answer so far); :meth:`finish` the same once the output has ended. ``phase`` is ANSWER
    once an answer message has begun, ``thought`` whether any analysis came. Each call reads only what the
    text grew by (:class:`_Messages`)."""

    def __init__(self):
        self.sent = 0  # characters of reasoning handed out
        self.phase = REASONING
        self.thought = False
        self._messages = _Messages()

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text[:len(text) - _partial_marker(text)])

    def finish(self, text: str) -> tuple[str, str]:
        return self._step(text)

    def _step(self, text: str) -> tuple[str, str]:
        reasoning, answer, answered = self._messages.read(text)
        new = _joined_from(reasoning, self.sent)
        self.sent += len(new)
        self.thought = self.thought or bool(reasoning)
        if answered:
            self.phase = ANSWER
        return new, "\n".join(answer)


def _joined_from(pieces: list[str], start: int) -> str:
    """``"\n".join(pieces)[start:]``, without joining the pieces that end before ``start``."""
    at = 0
    for i, piece in enumerate(pieces):
        if at + len(piece) >= start:
            return "\n".join([piece[start - at:], *pieces[i + 1:]])
        at += len(piece) + 1
    return ""
