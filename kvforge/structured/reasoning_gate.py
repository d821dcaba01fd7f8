"""A structured-output matcher that holds a reasoning model's answer only (kvforge/reasoning.py): while the
output thinks, every token is allowed and none reaches the grammar; from the token after the closing tag
on, the grammar decides. An output that starts undecided may open the think block with its first token
or begin the answer under the grammar.

:class:`ReasoningGate` has the matcher methods the engine calls (``accept_token``, ``is_terminated``,
``fill_next_token_bitmask``, ``rollback``, ``fork``), so a gated request goes through the same masks,
verification and forks as any other.
"""

from __future__ import annotations

from collections import deque

from kvforge.reasoning import ANSWER, REASONING, UNDECIDED, ReasoningTokens
from kvforge.structured.token_masks import set_bits

#: Tokens a gate can roll back (verification rolls back at most a step's proposals).
ROLLBACK_TOKENS = 256


class ReasoningGate:
    """``inner`` (an xgrammar GrammarMatcher) behind the reasoning phases of ``tokens``, starting in ``phase``."""

    def __init__(self, inner, tokens: ReasoningTokens, phase: str):
        self.inner = inner
        self.tokens = tokens
        self.phase = phase
        # Per accepted token: the state before it, and whether the grammar took it (for rollback).
        self._history: deque[tuple[object, bool]] = deque(maxlen=ROLLBACK_TOKENS)

    def _state(self) -> object:
        return self.phase

    def _restore(self, state: object) -> None:
        self.phase = state

    def _think(self, token: int) -> None:
        """Advance the reasoning phase past ``token`` (none of it reaches the grammar)."""
        if self.phase == UNDECIDED:
            self.phase = REASONING
        elif token == self.tokens.end_id:
            self.phase = ANSWER

    def accept_token(self, token: int) -> bool:
        before = self._state()
        if self.phase == ANSWER or (self.phase == UNDECIDED and token != self.tokens.start_id):
            accepted = self.inner.accept_token(token)
            if accepted:
                self.phase = ANSWER
                self._history.append((before, True))
            return accepted
        self._think(token)
        self._history.append((before, False))
        return True

    def is_terminated(self) -> bool:
        return self.phase == ANSWER and self.inner.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask`` (allocated with every bit set): the grammar's tokens once the answer has
        begun, those and the opening tag while undecided, left as it is (everything) while thinking."""
        if self.phase == REASONING:
            return
        self.inner.fill_next_token_bitmask(bitmask, row)
        if self.phase == UNDECIDED:
            set_bits(bitmask, row, (self.tokens.start_id,))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the gate holds the last {len(self._history)}")
        fed = 0
        for _ in range(num_tokens):
            state, took = self._history.pop()
            self._restore(state)
            fed += took
        if fed:
            self.inner.rollback(fed)

    def fork(self) -> ReasoningGate:
        child = type(self)(self.inner.fork(), self.tokens, self.phase)
        child._restore(self._state())
        child._history = deque(self._history, maxlen=ROLLBACK_TOKENS)
        return child


class HarmonyGate(ReasoningGate):
    """The gate of gpt-oss's harmony channels: the grammar decides from the token after the header of an
    answer-channel message (``<|channel|>final ... <|message|>``); analysis and commentary messages, and
    headers, are free."""

    def __init__(self, inner, tokens: ReasoningTokens, phase: str):
        super().__init__(inner, tokens, REASONING if phase == UNDECIDED else phase)
        self.header: tuple[int, ...] | None = None  # the tokens after <|channel|> while a header is read

    def _state(self) -> object:
        return self.phase, self.header

    def _restore(self, state: object) -> None:
        self.phase, self.header = state

    def _think(self, token: int) -> None:
        if token == self.tokens.start_id:
            self.header = ()
        elif self.header is not None and token == self.tokens.end_id:
            channel = self.tokens.answer_channel_ids
            if self.header[:len(channel)] == channel:
                self.phase = ANSWER
            self.header = None
        elif self.header is not None:
            self.header += (token,)


def gate_for(inner, tokens: ReasoningTokens, phase: str) -> ReasoningGate:
    """The gate of ``tokens``' parser around the matcher ``inner``."""
    return (HarmonyGate if tokens.parser.harmony else ReasoningGate)(inner, tokens, phase)
