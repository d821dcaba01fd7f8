"""A reasoning model's output text split into its reasoning and its answer, whole (:func:`split_reasoning`)
or as it streams (:class:`ReasoningStream`), by the rules of kvforge/reasoning.py. The streamed pieces
join to the whole split's: a tail that may begin a tag, and whitespace that may precede the answer, wait
until they are decided."""

from __future__ import annotations

from kvforge.reasoning import ANSWER, REASONING, UNDECIDED, ReasoningParser
from kvforge.server.harmony_split import HarmonyStream, split_harmony
from kvforge.server.tool_parsers import partial_tag


def split_reasoning(parser: ReasoningParser, text: str, phase: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole output that started in ``phase``: reasoning None where the output did
    not think, the answer "" where it has none."""
    if parser.harmony:
        return split_harmony(text)
    if phase == ANSWER:
        return None, text
    stripped = text.lstrip()
    if stripped.startswith(parser.start):
        text = stripped[len(parser.start):]
    elif phase == UNDECIDED:
        return None, text
    at = text.find(parser.end)
    if at < 0:
        return text, ""
    return text[:at], text[at + len(parser.end):].lstrip()


def reasoning_stream(parser: ReasoningParser, phase: str):
    """The stream split of ``parser``'s outputs (``feed``, ``finish``, ``phase``, ``thought``)."""
    return HarmonyStream() if parser.harmony else ReasoningStream(parser, phase)


class ReasoningStream:
    """:func:`split_reasoning` of a streamed output: :meth:`feed` takes the text so far and returns (new
    reasoning, the answer so far); :meth:`finish` does the same once the output has ended."""

    def __init__(self, parser: ReasoningParser, phase: str):
        self.parser = parser
        self.phase = phase
        self.opened = phase == ANSWER  # whether the start (an opening tag, or none) is decided
        self.sent = 0  # characters of the text handed out as reasoning, or skipped as the opening tag
        self.answer_from: int | None = 0 if phase == ANSWER else None
        self.thought = phase == REASONING  # whether the output has reasoning (maybe empty)

    def feed(self, text: str) -> tuple[str, str]:
        return self._step(text, finished=False)

    def finish(self, text: str) -> tuple[str, str]:
        return self._step(text, finished=True)

    def _open(self, text: str, finished: bool) -> bool:
        """Decide how the output starts; False while its beginning may still become the opening tag."""
        stripped = text.lstrip()
        tag = self.parser.start
        if not finished and len(stripped) < len(tag) and tag.startswith(stripped):
            return False
        self.opened = True
        if stripped.startswith(tag):
            self.sent = len(text) - len(stripped) + len(tag)
            self.phase, self.thought = REASONING, True
        elif self.phase == UNDECIDED:
            self.phase, self.answer_from = ANSWER, 0
        return True

    def _step(self, text: str, finished: bool) -> tuple[str, str]:
        if not self.opened and not self._open(text, finished):
            return "", ""
        reasoning = ""
        if self.phase == REASONING:
            at = text.find(self.parser.end, self.sent)
            if at >= 0:
                reasoning, self.sent = text[self.sent:at], at + len(self.parser.end)
                self.phase, self.answer_from = ANSWER, self.sent
            else:
                end = len(text) if finished else len(text) - partial_tag(text[self.sent:], self.parser.end)
                reasoning, self.sent = text[self.sent:end], end
        if self.answer_from is None:
            return reasoning, ""
        answer = text[self.answer_from:]
        return reasoning, answer.lstrip() if self.thought else answer
