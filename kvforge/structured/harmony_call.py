"""A forced function call in gpt-oss's harmony format: the matcher behind ``StructuredOutputsParams(harmony_call=...)``.

gpt-oss calls a function in a commentary message addressed to it, after its reasoning::

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGUMENTS<|call|>

(one line in the output; the analysis message is optional). :class:`HarmonyCallGate` holds an output to exactly
that: its message headers to the analysis channel (once) or to one of the listed functions, written as above;
the reasoning free but for the markers and special tokens that would end it another way than ``<|end|>``;
the arguments to the chosen function's JSON schema (an xgrammar matcher of its own, made when the header
names the function); and, once they are complete, ``<|call|>``, after which the output is complete (the engine
ends the request). The markers are special tokens, which the grammar's vocabulary leaves empty, so the gate
writes their bits itself. An output that starts right after the generation prompt's ``<|start|>assistant``
begins with ``<|channel|>`` (after ``<|channel|>``, with the header); one whose prompt ends elsewhere opens
its own message first.

The gate has a matcher's methods (``accept_token``, ``is_terminated``, ``fill_next_token_bitmask``,
``rollback``, ``fork``), as kvforge/structured/reasoning_gate.py's gates do.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvforge.errors import InvalidRequestError
from kvforge.structured.params import StructuredOutputsParams
from kvforge.structured.reasoning_gate import ROLLBACK_TOKENS
from kvforge.structured.token_masks import clear_bits, has_bit, set_bits

#: The harmony markers the gate reads and writes, each one special token of gpt-oss's tokenizer.
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>")
#: Where an output stands: forced tokens, a message header, the reasoning, a call's arguments, complete.
FORCED, HEADER, ANALYSIS, ARGUMENTS, DONE = "forced", "header", "analysis", "arguments", "done"


@dataclass(frozen=True)
class HarmonyCallTokens:
    """The token ids a forced call is written with in one tokenizer: the markers, the role ``assistant``, and
    per message header the tokens between ``<|channel|>`` and ``<|message|>`` (``analysis``, and
    ``commentary to=functions.NAME <|constrain|>json`` per function); ``forbidden_in_reasoning``: every special
    token but ``<|end|>``."""

    marker: dict[str, int]
    role: tuple[int, ...]
    analysis: tuple[int, ...]
    calls: dict[str, tuple[int, ...]]
    forbidden_in_reasoning: frozenset[int]


@functools.lru_cache(maxsize=64)  # a server's requests repeat their tools
def harmony_call_tokens(tokenizer, names: tuple[str, ...]) -> HarmonyCallTokens:
    """The ids of a call to one of ``names`` in ``tokenizer``; InvalidRequestError where a marker is not one
    special token of it (the model does not write harmony)."""
    marker = {}
    for text in MARKERS:
        token = tokenizer.convert_tokens_to_ids(text)
        if token is None or tokenizer.encode(text, add_special_tokens=False) != [token]:
            raise InvalidRequestError(f"a forced gpt-oss call is written with {text!r}, which is not one token of this "
                                      f"model's tokenizer", field="structured_outputs.harmony_call")
        marker[text] = token

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    calls = {name: (*encode(f"commentary to=functions.{name} "), marker["<|constrain|>"], *encode("json"))
             for name in names}
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    forbidden = frozenset((special | set(marker.values())) - {marker["<|end|>"]})
    return HarmonyCallTokens(marker, encode("assistant"), encode("analysis"), calls, forbidden)


@functools.lru_cache(maxsize=8)
def _reasoning_words(forbidden: frozenset[int], num_words: int) -> torch.Tensor:
    """A bitmask row (int32 words) with every bit set but those of ``forbidden``: AND-ed into a row at once."""
    words = torch.full((num_words,), -1, dtype=torch.int32)
    clear_bits(words[None], 0, forbidden)
    return words


@dataclass(frozen=True)
class _State:
    phase: str
    forced: tuple[int, ...] = ()  # FORCED: the tokens still to come, then a header
    header: tuple[int, ...] = ()  # HEADER: the tokens read after <|channel|>
    reasoned: bool = False  # an analysis message was written (one at most)
    name: str | None = None  # ARGUMENTS and after: the function called
    matcher: object = None  # that function's matcher


class HarmonyCallGate:
    """The matcher of a forced call to one of ``tokens.calls``' functions (module docstring).
    ``make_matcher(name)`` gives a fresh matcher of the function's arguments; ``stop_ids``: the end tokens
    that matcher allows once the arguments are complete (``<|call|>`` takes their place); ``vocab_size``: the
    width of its bitmasks; ``prompt_ids``: the prompt, whose end decides how the output begins."""

    def __init__(self, tokens: HarmonyCallTokens, make_matcher: Callable[[str], object], stop_ids,
                 vocab_size: int, prompt_ids: Sequence[int] = ()):  # fmt: skip
        self.tokens = tokens
        self.make_matcher = make_matcher
        self.stop_ids = tuple(stop_ids)
        self.vocab_size = vocab_size
        m = tokens.marker
        opening = (m["<|start|>"], *tokens.role)
        if tuple(prompt_ids[-len(opening) - 1:]) == (*opening, m["<|channel|>"]):
            self.state = _State(HEADER)
        elif tuple(prompt_ids[-len(opening):]) == opening:
            self.state = _State(FORCED, forced=(m["<|channel|>"],))
        else:
            self.state = _State(FORCED, forced=(*opening, m["<|channel|>"]))
        # Per accepted token: the state before it, and whether the function's matcher took it (for rollback).
        self._history: deque[tuple[_State, bool]] = deque(maxlen=ROLLBACK_TOKENS)

    def _headers(self, state: _State) -> list[tuple[tuple[int, ...], str | None]]:
        """The headers still allowed, each with the ``<|message|>`` that ends it: (tokens, function or None)."""
        message = self.tokens.marker["<|message|>"]
        out = [((*ids, message), name) for name, ids in self.tokens.calls.items()]
        if not state.reasoned:
            out.append(((*self.tokens.analysis, message), None))
        return out

    def _next(self, state: _State, token: int) -> tuple[_State, bool] | None:
        """The state after ``token`` and whether the function's matcher took it; None where it is refused."""
        m = self.tokens.marker
        if state.phase == FORCED:
            if token != state.forced[0]:
                return None
            rest = state.forced[1:]
            return (replace(state, forced=rest) if rest else replace(state, phase=HEADER, forced=(), header=())), False
        if state.phase == HEADER:
            read = (*state.header, token)
            matching = [(ids, name) for ids, name in self._headers(state) if ids[:len(read)] == read]
            if not matching:
                return None
            done = [name for ids, name in matching if len(ids) == len(read)]
            if not done:
                return replace(state, header=read), False
            if done[0] is None:
                return replace(state, phase=ANALYSIS, header=(), reasoned=True), False
            return replace(state, phase=ARGUMENTS, header=(), name=done[0], matcher=self.make_matcher(done[0])), False
        if state.phase == ANALYSIS:
            if token == m["<|end|>"]:
                return replace(state, phase=FORCED, forced=(m["<|start|>"], *self.tokens.role, m["<|channel|>"])), False
            return (None if token in self.tokens.forbidden_in_reasoning else (state, False))
        if state.phase == ARGUMENTS:
            if token == m["<|call|>"]:
                return (replace(state, phase=DONE), False) if self._arguments_complete(state) else None
            if token in self.stop_ids:
                return None
            return (state, True) if state.matcher.accept_token(token) else None
        return None

    def _arguments_complete(self, state: _State) -> bool:
        """Whether the function's matcher would take an end token now (its arguments are whole)."""
        import xgrammar

        probe = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        state.matcher.fill_next_token_bitmask(probe, 0)
        return any(has_bit(probe, 0, t) for t in self.stop_ids)

    def accept_token(self, token: int) -> bool:
        moved = self._next(self.state, token)
        if moved is None:
            return False
        self._history.append((self.state, moved[1]))
        self.state = moved[0]
        return True

    def is_terminated(self) -> bool:
        return self.state.phase == DONE

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask`` (allocated with every bit set): the tokens the output may take next."""
        state = self.state
        if state.phase == ANALYSIS:
            words = _reasoning_words(self.tokens.forbidden_in_reasoning, bitmask.shape[1])
            bitmask[row] &= words.to(bitmask.device)
            return
        if state.phase == ARGUMENTS:
            state.matcher.fill_next_token_bitmask(bitmask, row)
            complete = any(has_bit(bitmask, row, t) for t in self.stop_ids)
            clear_bits(bitmask, row, self.stop_ids)
            if complete:
                set_bits(bitmask, row, [self.tokens.marker["<|call|>"]])
            return
        bitmask[row] = 0
        if state.phase == FORCED:
            set_bits(bitmask, row, state.forced[:1])
        elif state.phase == HEADER:
            n = len(state.header)
            set_bits(bitmask, row, {ids[n] for ids, _ in self._headers(state) if ids[:n] == state.header})

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the gate holds the last {len(self._history)}")
        fed = 0
        current = self.state.matcher
        for _ in range(num_tokens):
            self.state, took = self._history.pop()
            fed += took
        if fed and self.state.matcher is current:  # else the matcher that took them is dropped with its state
            current.rollback(fed)

    def fork(self) -> HarmonyCallGate:
        child = object.__new__(HarmonyCallGate)
        child.tokens, child.make_matcher, child.stop_ids = self.tokens, self.make_matcher, self.stop_ids
        child.vocab_size = self.vocab_size
        matcher = self.state.matcher.fork() if self.state.matcher is not None else None
        # The child's history keeps the states before its matcher existed; later ones name the parent's matcher,
        # which the child's replaces (a rollback into them rolls the child's matcher back).
        child.state = replace(self.state, matcher=matcher)
        child._history = deque((((replace(s, matcher=matcher) if s.matcher is not None else s), took)
                                for s, took in self._history), maxlen=ROLLBACK_TOKENS)
        return child


def harmony_call_gate(backend, constraint: StructuredOutputsParams, tokenizer, prompt_ids: Sequence[int]):
    """The gate of ``constraint`` (``harmony_call``) for an output of ``prompt_ids``, the functions' arguments
    matched by ``backend`` (kvforge/structured/backend.py) for ``tokenizer``'s vocabulary."""
    schemas = dict(constraint.harmony_call)
    tokens = harmony_call_tokens(tokenizer, tuple(schemas))
    backend.compile(constraint)  # every function's grammar, refused by name before the output starts

    def make_matcher(name: str):
        return backend.matcher(StructuredOutputsParams(json=schemas[name]))

    return HarmonyCallGate(tokens, make_matcher, backend.stop_token_ids, backend.vocab_size, prompt_ids)
