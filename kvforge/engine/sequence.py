"""Sequence: the engine's per-request state (tokens, cache blocks, status, text).

A ``Sequence`` is owned by the scheduler from ``add`` until it finishes. Its
token ids only ever grow (``prompt_token_ids`` + ``output_token_ids``), which
is what lets the block manager keep the chained block hashes of its full blocks
(``block_hashes``) incrementally and lets preemption-by-recompute re-use them.

``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose KV
is in the cache. The newest sampled token is never computed when it is
appended; it is fed to the model on the next step. So a decoding sequence has
``num_tokens - num_computed_tokens == 1``.
"""

from __future__ import annotations

import enum
import itertools

import numpy as np
import torch

from kvforge.engine.logprob import label_entry
from kvforge.engine.outputs import RequestOutput, _SnapshotCompletionOutput, _SnapshotRequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.speculative.stats import SpeculativeStats

_arrival_counter = itertools.count()



def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a torch generator on ``device`` gets for a request's 64-bit ``seed``. CUDA's generator keeps
    all 64 bits; torch's CPU generator keeps only the low 32, so there a seed outside [0, 2^32) is first
    mixed down to 32 bits (splitmix64's finalizer), so seeds that differ only above bit 32 draw different
    numbers (but for a 2^-32 chance). Seeds in [0, 2^32) are used as they are on every device."""
    if device.type != "cpu" or 0 <= seed < 1 << 32:
        return seed
    z = seed & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF

class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        # Identity tests: Enum.__hash__ is Python code, so a set lookup costs more (hot path).
        return self is _STOPPED or self is _LENGTH or self is _ABORTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_STOPPED, _LENGTH = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
_ABORTED = SequenceStatus.FINISHED_ABORTED
_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """One request being generated (n=1, so request == sequence).

    Attributes the scheduler and block manager maintain:

    - ``status``: WAITING -> RUNNING -> FINISHED_* (RUNNING -> WAITING on
      preemption).
    - ``num_computed_tokens``: tokens whose KV is in the cache.
    - ``block_tables``: one list of cache block ids per KV-cache group (one
      group for most models); entry ``i`` holds tokens
      ``i*block_size .. (i+1)*block_size-1`` of that group's layers.
      ``block_table`` is the first group's list.
    - ``num_skipped_blocks``: per group, leading entries that hold no block
      (a sliding-window group's blocks whose tokens all left the window);
      they read 0 and are never attended to.
    - ``block_hashes``: chained hashes of the full blocks of ``all_token_ids``
      computed so far (a cache of the block manager; valid forever because
      tokens are never rewritten).
    - ``num_registered_blocks``: leading blocks of ``block_table`` already
      registered in (or taken from) the prefix cache.
    - ``num_cached_prompt_tokens``: prefix-cache hit, in tokens, at the first
      admission.
    - ``state_branch_point``: models with state layers: the block boundary past
      the admission's hit where another cached request's tokens branch off
      this one's, whose state a snapshot should keep (0: none;
      kvforge/engine/state_prefix.py).
    - ``arrival``: a process-wide increasing counter; preemption picks the
      running sequence with the largest one.
    - ``first_scheduled_time``: ``time.monotonic()`` at the first admission
      (None while it waits for it).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        arrival: int | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.priority = priority  # the priority scheduling policy's order: lower first
        self.prompt = prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrival_counter) if arrival is None else arrival
        self.num_computed_tokens = 0
        # Sampled tokens whose values are not known yet (the overlapped engine: 0 or 1).
        self.num_pending = 0
        # token_arrays()'s caches.
        self._prompt_array: np.ndarray | None = None
        self._output_array = np.empty(0, dtype=np.int64)
        self._output_array_len = 0
        self.block_tables: list[list[int]] = [[]]
        self.num_skipped_blocks: list[int] = [0]
        # The block manager's: computed tokens from which a sliding group has a block to release (0: unknown).
        self.window_release_at = 0
        # Per sliding group, by position: the cached block it freed as it left the window (-1: none).
        self.out_of_window_blocks: list = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_prompt_tokens = 0
        self.state_branch_point = 0
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: float = 0.0
        # Prompt logprobs (params.prompt_logprobs): entry i for prompt token i, filled in order as the
        # prefill computes them; the first token has none. Entries are never rewritten (a recompute
        # after preemption skips those already there).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if self.params.prompt_logprobs is not None else None)
        # Incremental detokenizer (set by the scheduler when it has a tokenizer).
        self.detokenizer = None
        # Speculative decoding: the proposals for the next step (set by the engine before each schedule, read
        # by the scheduler only for a decoding sequence), and the acceptance record (None: no speculation).
        self.spec_token_ids: list[int] = []
        self.speculative: SpeculativeStats | None = None
        # Structured outputs: the request's grammar matcher (xgrammar), at the end of its output tokens and
        # of ``grammar_ahead``: the token in flight (async scheduling), fed to it before it resolves, with
        # whether the matcher took it.
        self.grammar = None
        self.grammar_ahead: list[tuple[int, bool]] = []
        # ``params.bad_words`` as token sequences (kvforge/engine/bad_words.py), set by the engine.
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()
        self._generators: dict[str, torch.Generator] = {}

    # ---- blocks -------------------------------------------------------------
    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's block ids (the only group of a single-group model)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def holds_blocks(self) -> bool:
        return any(self.block_tables)

    # ---- tokens -------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list when possible."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(prompt ids, output ids)`` as int64 arrays (for the sampler's penalties). The prompt's is made
        once; the output's is a view of a buffer that doubles as it fills and copies only the tokens
        appended since the last call (the ids only ever grow)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        n, done = len(self.output_token_ids), self._output_array_len
        if n > len(self._output_array):
            grown = np.empty(max(2 * len(self._output_array), n, 16), dtype=np.int64)
            grown[:done] = self._output_array[:done]
            self._output_array = grown
        if n > done:
            self._output_array[done:n] = self.output_token_ids[done:n]
            self._output_array_len = n
        return self._prompt_array, self._output_array[:n]

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(int(token_id))
        if self.logprobs is not None:
            self.logprobs.append(self._labelled(logprobs) if logprobs is not None else {})
        if logprobs is not None and int(token_id) in logprobs:
            self.cumulative_logprob += float(logprobs[int(token_id)])

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are not computed yet."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < len(self.prompt_token_ids)

    def add_prompt_logprobs(self, first_token: int, entries: list[dict[int, float]]) -> None:
        """Record the logprobs of prompt tokens ``first_token ..`` (one dict per token); tokens
        already recorded (a recompute) are skipped, a gap is an error."""
        pl = self.prompt_logprobs
        have = len(pl)
        if first_token > have:
            raise RuntimeError(f"{self.request_id}: prompt logprobs from token {first_token}, but only "
                               f"{have} are recorded")
        pl.extend(self._labelled(e) if e is not None else None for e in entries[have - first_token:])

    def _labelled(self, entry: dict[int, float]) -> dict[int, float]:
        """A copy of a logprobs entry, each value carrying its token's text where the sequence has a tokenizer
        (``Logprob.decoded_token``)."""
        if self.detokenizer is None:
            return dict(entry)
        return label_entry(entry, self.detokenizer.tokenizer)

    # ---- status -------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        st = self.status
        return st is _STOPPED or st is _LENGTH or st is _ABORTED

    def finish(self, status: SequenceStatus, stop_reason: str | int | None = None) -> None:
        assert status.is_finished
        self.status = status
        self.finish_reason = status.finish_reason
        self.stop_reason = stop_reason

    # ---- sampling -----------------------------------------------------------
    def generator_for(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The per-request generator on ``device`` (None when no seed is set).

        Created on first use per device and seeded with ``params.seed``; the
        same generator object is returned on later calls so its state advances
        one draw per sampled token, independent of batch composition.
        """
        if self.params.seed is None:
            return None
        dev = torch.device(device)
        key = str(dev)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=dev)
            g.manual_seed(generator_seed(self.params.seed, dev))
            self._generators[key] = g
        return g

    # ---- text / outputs -----------------------------------------------------
    @property
    def output_text(self) -> str:
        if self.detokenizer is None:
            return ""
        return self.detokenizer.output_text(finished=self.is_finished)

    def fork(self, request_id: str) -> Sequence:
        """A copy with the same tokens and progress but no blocks.

        Call ``BlockManager.fork(parent, child)`` afterwards to share blocks.
        """
        child = Sequence(request_id, self.prompt_token_ids, self.params, prompt=self.prompt, priority=self.priority)
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_registered_blocks = self.num_registered_blocks
        child.num_cached_prompt_tokens = self.num_cached_prompt_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.logprobs = [dict(d) for d in self.logprobs] if self.logprobs is not None else None
        child.cumulative_logprob = self.cumulative_logprob
        child.prompt_logprobs = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def to_request_output(self) -> RequestOutput:
        """The request's state now. Token lists are not copied here: the
        output copies the first ``num_output_tokens`` entries (and the prompt)
        when they are first read, which gives the same lists because the
        sequence only ever appends (see ``_SnapshotCompletionOutput``)."""
        finished = self.is_finished
        lps = self.logprobs
        comp = _SnapshotCompletionOutput.snapshot(
            0,
            self.detokenizer.output_text(finished=finished) if self.detokenizer is not None else "",
            self.output_token_ids,
            len(self.output_token_ids),
            self.finish_reason,
            self.stop_reason,
            lps,
            self.cumulative_logprob if lps is not None else None,
        )
        return _SnapshotRequestOutput.snapshot(self.request_id, self.prompt, self.prompt_token_ids, [comp], finished,
                                               self.num_cached_prompt_tokens, self.prompt_logprobs, self.speculative,
                                               self.first_scheduled_time)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table if len(self.block_tables) == 1 else self.block_tables})"
        )
