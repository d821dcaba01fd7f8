"""Continuous-batching scheduler (vLLM-v1 style: one token budget, no prefill/decode phases).

Each ``schedule()`` builds one step. The rule (docs/SCHEDULER.md): every running stream
gets its token in every step, and a stream waits behind at most one bounded prefill chunk.

1. RUNNING sequences in the order decodes first, then sequences mid-prefill (a
   prompt, down to its last token alone, or a recompute), each group oldest
   arrival first. A decode gets its token; a sequence mid-prefill gets its
   next chunk within the token budget and the step's prefill room. When the block manager cannot make room, the
   last sequence in that order not yet scheduled this step (the newest
   mid-prefill, else the newest decode) is preempted by recompute (its blocks
   freed, ``num_computed_tokens = 0``, put back at the FRONT of the waiting
   queue; its prompt for recompute is prompt + outputs so far, and nothing it
   generated is lost). If that sequence is the one being scheduled, the
   running pass stops.
2. If nothing was preempted, WAITING sequences (FIFO) are admitted while the
   budget, the prefill room, ``max_num_seqs`` and free blocks allow. Their
   prefix-cache hit is skipped, and with chunked prefill a prompt longer than
   the room is split over steps. Beside running sequences, a request is
   admitted only when the free blocks hold, at once, every block it needs for
   all of its known tokens (not only its first chunk), every block the running
   sequences still need for theirs, and one block a group for each of them and
   it (room to grow; none for one whose length limit ends inside the blocks it
   needs already): a request admitted into blocks that a running stream's
   next token will need is the first preempted, its prefill recomputed, and
   under memory pressure that repeats every few steps. With nothing running a
   request is admitted as soon as its first chunk fits (``add`` checked that
   it fits the cache at all), so the queue always moves.

Models with linear-attention state layers under prefix caching
(``state_prefix``, kvforge/engine/state_prefix.py): a hit ends only at a
block whose state snapshot is kept, and the admitted request's slot gets that
snapshot at once; the snapshots a prefill chunk passes are taken inside the
step (the engine asks ``state_prefix.plan_snapshots`` once the step is
scheduled), so no chunk is cut for them.

Under the ``priority`` policy (``--scheduling-policy priority``, vLLM's) each
request has a priority, lower first. Decodes still come first and the prefill
room is as above; within decodes, and within prefills, lower priority goes
first. The sequence preempted to make room is the least urgent one not yet
scheduled this step (the latest arrival among equals); the WAITING queue is
ordered by (priority, arrival), a preempted sequence going back to its place
there. A waiting request never preempts a running one.

Prefill room: ``max_num_batched_tokens`` minus the step's decode tokens; when
the step carries a decode token and ``long_prefill_token_threshold`` is set
(chunked prefill only), the step's prefill tokens together stay within that
threshold, so a decoding stream's inter-token gap is one step with at most
that many prefill tokens. A step without decodes uses the whole budget.

A token is sampled for a sequence only in the step whose tokens reach the end
of everything it knows (``ScheduledSequence.do_sample``). ``update()`` then
advances ``num_computed_tokens``, registers full blocks in the prefix cache,
appends sampled tokens, detokenizes, checks stop conditions and frees
finished sequences.

Requests that can never fit are rejected in ``add()`` with
``InvalidRequestError``: prompts with ``len(prompt) + 1 > max_model_len`` and
requests whose longest possible sequence needs more KV blocks than exist.
Nothing is ever truncated silently.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.scheduling_policy import SCHEDULING_POLICIES
from kvforge.engine.sequence import Sequence, SequenceStatus
from kvforge.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """One sequence's share of a step.

    The step computes KV for tokens ``start_pos .. start_pos + num_new_tokens - 1``
    of ``seq.all_token_ids`` (``start_pos`` = ``num_computed_tokens`` before
    the step). ``do_sample``: this step reaches the end of the sequence's known
    tokens (its prefill, or recompute, completes; always true for decode), so
    the logits of its last new token are sampled.

    ``spec_token_ids``: speculative proposals that follow the sequence's last token in this step (a
    decoding sequence only); they are the last ``len(spec_token_ids)`` of the ``num_new_tokens``, are
    not part of the sequence, and their logits rows are verified with the last real token's
    (kvforge/speculative/verify.py).
    """

    seq: Sequence
    num_new_tokens: int
    start_pos: int
    do_sample: bool
    spec_token_ids: list[int] | tuple[()] = ()  # a shared empty tuple: no list built per step and sequence

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        spec = self.spec_token_ids
        if spec:
            return self.seq.token_ids_slice(self.start_pos, self.start_pos + self.num_new_tokens - len(spec)) + spec
        return self.seq.token_ids_slice(self.start_pos, self.start_pos + self.num_new_tokens)

    @property
    def context_len(self) -> int:
        """Tokens in the context after this step (``seq_lens`` in AttentionMetadata)."""
        return self.start_pos + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step. ``scheduled`` is in the order the model runner should batch them.

    ``blocks_to_copy``: (src, dst) copy-on-write block copies to apply before
    running the step. ``preempted``: sequences preempted while building it.
    ``num_decode_tokens`` / ``num_prefill_tokens``: the step's tokens of decoding
    sequences and of prompt (or recompute) chunks; they sum to ``num_batched_tokens``.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def sampled_sequences(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled if s.do_sample]


class Scheduler:
    """See the module docstring.

    ``eos_token_ids``: ids that end a request unless ``ignore_eos``.
    ``tokenizer``: enables incremental detokenization and stop strings
    (requests with ``stop`` strings are rejected without one).
    ``long_prefill_token_threshold``: with chunked prefill, the most prefill
    tokens a step that carries a decode token may hold (0: the whole budget).
    """

    #: Admit a request beside running ones only when its whole known tokens, the running sequences' own,
    #: and a block of growth (in every group) for each of them that can grow fit in the free blocks (module
    #: docstring, rule 2). False: admit while the first chunk's blocks are free, as vLLM does.
    admit_whole_prompts: bool = True

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        eos_token_ids=(),
        tokenizer=None,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        state_prefix=None,
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        if long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0: off), got {long_prefill_token_threshold}")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) < max_model_len ({max_model_len}) "
                "without chunked prefill: long prompts could never be scheduled; raise "
                "--max-num-batched-tokens or enable chunked prefill"
            )
        self.block_manager = block_manager
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Prompts are split only with chunked prefill; without it the threshold could starve a long prompt.
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer
        self.state_prefix = state_prefix  # StatePrefixCache, or None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.prompt_tokens_admitted = 0  # prompt tokens of every request admitted so far (recomputes not again)

    # ---- queries -----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- requests ----------------------------------------------------------
    def max_blocks_needed(self, seq: Sequence) -> int:
        """KV blocks (all groups) the sequence holds at its longest (its last token is never computed)."""
        total = self.max_model_len
        if seq.params.max_tokens is not None:
            total = min(total, seq.num_prompt_tokens + seq.params.max_tokens)
        # A sliding-window group holds a whole chunk for its step: count the largest chunk the budget allows.
        chunk = min(self.max_num_batched_tokens, total - 1)
        return self.block_manager.max_blocks_per_sequence(total - 1, chunk)

    def add(self, seq: Sequence) -> None:
        """Queue a request, or raise InvalidRequestError if it can never be served."""
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use", field="request_id")
        n = seq.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("prompt is empty: at least one token is needed", field="prompt")
        if n + 1 > self.max_model_len:
            raise InvalidRequestError(
                f"prompt is too long: {n} tokens + 1 generated token exceeds max_model_len={self.max_model_len}; "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens",
                field="prompt",
            )
        need = self.max_blocks_needed(seq)
        if need > self.block_manager.num_blocks:
            bs = self.block_manager.block_size
            prompt_blocks = self.block_manager.max_blocks_per_sequence(n, min(n, self.max_num_batched_tokens))
            fld = "prompt" if prompt_blocks > self.block_manager.num_blocks else "max_tokens"
            raise InvalidRequestError(
                f"request needs up to {need} KV-cache blocks ({n} prompt tokens, max_tokens="
                f"{seq.params.max_tokens}, max_model_len={self.max_model_len}, block size {bs}) but the "
                f"cache has only {self.block_manager.num_blocks} blocks "
                f"({self.block_manager.num_blocks * bs} tokens); lower {fld}",
                field=fld,
            )
        if seq.params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this engine has none", field="stop")
        if self.tokenizer is not None and seq.detokenizer is None and seq.params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens,
                include_stop=seq.params.include_stop_str_in_output, min_tokens=seq.params.min_tokens,
            )
        if seq.holds_blocks:
            raise InvalidRequestError(
                f"request {seq.request_id!r} already holds KV blocks", field="request_id"
            )
        if seq.priority and not self.by_priority:
            raise InvalidRequestError(f"priority {seq.priority} needs the priority scheduling policy; start the "
                                      f"engine with --scheduling-policy priority (LLM(scheduling_policy=\"priority\")), "
                                      f"or leave priority at 0", field="priority")
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self._queue(seq)
        self.requests[seq.request_id] = seq

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Put ``seq`` in the waiting queue: at its back (or, preempted, its front), or by priority."""
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, (seq.priority, seq.arrival),
                                                    key=lambda s: (s.priority, s.arrival)), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request and free its blocks; returns it (None if unknown or already finished)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.finish(SequenceStatus.FINISHED_ABORTED)
        return seq

    # ---- scheduling ----------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq, front=True)

    @staticmethod
    def _tokens_to_compute(seq: Sequence) -> int:
        """Known tokens of ``seq`` whose KV is not computed yet (1 for a decoding sequence)."""
        return seq.num_tokens + seq.num_pending - seq.num_computed_tokens

    @staticmethod
    def _is_prefill(seq: Sequence, n: int) -> bool:
        """Whether computing ``seq``'s next ``n`` tokens is prefill: more than one token (a prompt chunk or a
        recompute), or the prompt's last token (a decode computes exactly one generated token)."""
        return n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens

    def _order_running(self) -> None:
        """Schedule order: decodes first, then sequences mid-prefill; each oldest arrival first (under the
        priority policy, each lowest priority first, then oldest)."""
        def prefill(s: Sequence) -> bool:
            return self._is_prefill(s, self._tokens_to_compute(s))

        if self.by_priority:
            self.running.sort(key=lambda s: (prefill(s), s.priority, s.arrival))
        else:
            self.running.sort(key=lambda s: (prefill(s), s.arrival))

    def _pop_victim(self, first: int) -> Sequence:
        """Take the sequence to preempt out of ``running[first:]`` (not scheduled this step): the last in
        schedule order, or under the priority policy the least urgent (highest priority, then latest arrival)."""
        if not self.by_priority:
            return self.running.pop()
        at = max(range(first, len(self.running)), key=lambda k: (self.running[k].priority, self.running[k].arrival))
        return self.running.pop(at)

    def _prefill_room(self, num_decode_tokens: int) -> int:
        """Prefill tokens a step may hold given its decode tokens (see the module docstring)."""
        room = self.max_num_batched_tokens - num_decode_tokens
        if num_decode_tokens and self.long_prefill_token_threshold:
            room = min(room, self.long_prefill_token_threshold)
        return room

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_room = None  # set when the first prefill chunk is considered: every decode precedes it
        self._order_running()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and self._reaches_length_limit(seq):
                i += 1  # its in-flight token ends it (max_tokens / max_model_len): nothing more to compute
                continue
            n = self._tokens_to_compute(seq)
            is_prefill = self._is_prefill(seq, n)
            if is_prefill:
                if prefill_room is None:
                    prefill_room = self._prefill_room(out.num_decode_tokens)
                room = min(budget, prefill_room)
                if room <= 0:
                    break  # only sequences mid-prefill are left
                if n > room:
                    if not self.enable_chunked_prefill:
                        i += 1
                        continue
                    n = room
            spec = self._proposals_to_verify(seq, n, budget) if seq.spec_token_ids else ()
            m = n + len(spec) if spec else n  # with the proposals
            self_preempted = False
            while not bm.append_slots(seq, m):
                if spec:  # never preempt a request to make room for proposals: verify none this step
                    spec, m = (), n
                    continue
                victim = self._pop_victim(i)  # index >= i: not yet scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    self_preempted = True
                    break
            if self_preempted:
                break
            start = seq.num_computed_tokens
            out.scheduled.append(ScheduledSequence(seq, m, start, start + n == seq.num_tokens + seq.num_pending,
                                                   spec))
            budget -= m
            if is_prefill:
                prefill_room -= n
                out.num_prefill_tokens += n
            else:
                out.num_decode_tokens += m
            i += 1

        if not out.preempted:
            if prefill_room is None:
                prefill_room = self._prefill_room(out.num_decode_tokens)
            committed = None
            while self.waiting and min(budget, prefill_room) > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_pending:
                    break  # preempted while its token was in flight: admitted after resolve() (next step)
                # A request that still needs prompt logprobs computes its whole prompt (no cache hit).
                state = self.state_prefix
                cached = (bm.no_hit() if seq.needs_prompt_logprobs
                          else bm.lookup_prefix(seq, state.resumable if state is not None else None))
                num_cached = len(cached) * bm.block_size
                n = seq.num_tokens - num_cached
                room = min(budget, prefill_room)
                if n > room:
                    if not self.enable_chunked_prefill:
                        break
                    n = room
                if self.admit_whole_prompts and self.running:
                    need = self._blocks_to_take(seq, cached) + self._growth_room(seq)
                    free = bm.free_after_hit(cached)
                    if need > free:  # short even before the running sequences' own needs are counted
                        break
                    if committed is None:
                        committed = sum(self._blocks_to_take(s) + self._growth_room(s) for s in self.running)
                    if need + committed > free:
                        break
                if state is not None:
                    state.find_branch_point(seq, num_cached)
                if not bm.allocate(seq, n, cached):
                    break
                if committed is not None:
                    committed += self._blocks_to_take(seq) + self._growth_room(seq)
                if state is not None:
                    state.restore(seq)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = num_cached
                    seq.first_scheduled_time = time.monotonic()
                    self.prompt_tokens_admitted += seq.num_prompt_tokens  # once per request, cached or not
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n, num_cached, num_cached + n == seq.num_tokens))
                budget -= n
                prefill_room -= n
                out.num_prefill_tokens += n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.blocks_to_copy = bm.take_copies()
        return out

    def _blocks_to_take(self, seq: Sequence, hit=None) -> int:
        """Blocks (all groups) ``seq`` has yet to take to hold the KV of every token it knows, its chunks at
        most the token budget; ``hit``: the prefix hit it would be admitted with (not yet admitted)."""
        bm = self.block_manager
        if hit is None:
            todo, held = self._tokens_to_compute(seq), None
            if todo <= 1:  # a decode: a new row of blocks (one a group) when its table has no slot left
                return bm.new_blocks_for_step(seq, todo)
        else:
            todo, held = seq.num_tokens - len(hit) * bm.block_size, sum(len(t) for t in hit.tables)
        return bm.blocks_to_hold(seq, seq.num_tokens + seq.num_pending, min(todo, self.max_num_batched_tokens),
                                 held=held)

    def _growth_room(self, seq: Sequence) -> int:
        """Blocks (all groups) the sequence's next ``block_size`` tokens add past those of every token it knows:
        one row of blocks, or none when its length limit (``max_tokens``, ``max_model_len``; the last token's KV
        is never computed) ends it inside the blocks it needs already."""
        B = self.block_manager.block_size
        known = seq.num_tokens + seq.num_pending
        limit = self.max_model_len
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + seq.params.max_tokens)
        grown = min(known + B, limit - 1)
        return self.block_manager.num_groups if -(-grown // B) > -(-known // B) else 0

    def trim_to_computed(self) -> None:
        """Free every running sequence's blocks past its computed tokens: blocks a proposer took for positions
        a step did not verify (proposals the budget cut, or a sequence not scheduled). They hold no token of
        the sequence; between steps a sequence holds exactly the blocks of its computed tokens."""
        for seq in self.running:
            self.block_manager.trim(seq, seq.num_computed_tokens)

    def _proposals_to_verify(self, seq: Sequence, n: int, budget: int) -> list[int] | tuple[()]:
        """The leading proposals of a decoding sequence (``n == 1``) this step verifies: as many as the token
        budget and the length limits leave room for (every accepted proposal plus the target's token must
        fit within ``max_tokens`` and ``max_model_len``)."""
        if n != 1 or seq.num_pending:
            return ()
        room = min(budget, self.max_model_len - seq.num_tokens) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return seq.spec_token_ids[:room] if room > 0 else ()

    def next_step_may_preempt(self) -> bool:
        """True when the running sequences' next chunks (in schedule order, within the token budget)
        could need more new blocks than are free, i.e. :meth:`schedule` might preempt now. Ignores
        copy-on-write and the length-limit skip, so it errs towards True. The overlapped engine then
        resolves its in-flight step first: sequences that step finishes free their blocks, and a
        preemption (a recompute) costs far more than one step of lost overlap."""
        return self.spare_blocks() < 0

    def spare_blocks(self) -> int:
        """Free blocks minus the new blocks the running sequences' next chunks need (in schedule order, within
        the token budget, without proposals): what a speculative proposer may take for its proposals' positions
        without making :meth:`schedule` preempt (negative: it might preempt already)."""
        bm = self.block_manager
        budget, need = self.max_num_batched_tokens, 0
        self._order_running()
        decode_tokens, prefill_room = 0, None
        for seq in self.running:
            n = self._tokens_to_compute(seq)
            if self._is_prefill(seq, n):
                if prefill_room is None:
                    prefill_room = self._prefill_room(decode_tokens)
                n = min(n, prefill_room)
                prefill_room -= n
            else:
                decode_tokens += n
            n = min(n, budget)
            if n <= 0:
                break
            budget -= n
            need += bm.new_blocks_for_step(seq, n)
        return bm.num_free_blocks - need

    # ---- results -------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict) -> list[Sequence]:
        """Apply a finished step (synchronous engine): :meth:`advance` then :meth:`resolve`.
        ``sampled[request_id] = (token_id, logprobs | None)`` (or just a token id) for every
        scheduled sequence with ``do_sample``.

        Returns the sequences that finished in this step (their blocks are freed).
        Sequences aborted after ``schedule()`` are skipped.
        """
        self.advance(output)
        return self.resolve(output, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """The step was launched: its tokens count as computed, and each sequence due a sample
        now has one token in flight (``num_pending``) until :meth:`resolve` gives its value.
        The overlapped engine calls this at launch and schedules the next step before the
        sampled tokens are known (kvforge/engine/overlap.py)."""
        sliding = self.block_manager.has_sliding_groups
        for s in output.scheduled:
            seq = s.seq
            if seq.is_finished or seq.status != SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens != s.start_pos:
                raise RuntimeError(
                    f"advance: {seq.request_id} has {seq.num_computed_tokens} computed tokens, "
                    f"the step started at {s.start_pos} (step applied twice?)"
                )
            # Proposals count as computed only once verified (resolve() adds the accepted ones).
            seq.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            # Register now, not only in resolve(): a sequence preempted (or aborted) before this step
            # resolves must leave its computed blocks in the prefix cache, as the synchronous engine does
            # (stream order makes them valid for any later step).
            self.block_manager.cache_full_blocks(seq)
            if sliding:  # sliding-window groups: free the blocks no query can see any more
                self.block_manager.release_out_of_window(seq)
            if s.do_sample:
                seq.num_pending += 1

    def resolve(self, output: SchedulerOutput, sampled: dict) -> list[Sequence]:
        """Give an advanced step's sampled tokens their values: append, detokenize, check stop
        conditions, register full blocks in the prefix cache, free finished sequences.

        A sequence preempted after its step was launched (it is WAITING again) still gets its
        token: the token was sampled from a correct context, and its recompute prompt is
        prompt + outputs. Finished (e.g. aborted) sequences are skipped.
        """
        bm = self.block_manager
        finished: list[Sequence] = []
        for s in output.scheduled:
            seq = s.seq
            if seq.is_finished or not s.do_sample:  # advance() already registered the computed blocks
                continue
            if seq.num_pending < 1:
                raise RuntimeError(f"resolve: {seq.request_id} has no token in flight (resolved twice?)")
            try:
                entry = sampled[seq.request_id]
            except KeyError:
                raise KeyError(f"resolve: no sampled token for {seq.request_id!r}, which was due one") from None
            seq.num_pending -= 1
            if isinstance(entry, list):  # verified proposals, then the target's token: [(token, logprobs)]
                self._roll_back_rejected(s, len(entry) - 1)
                status = None
                for token, lps in entry:
                    status, reason = self._append(seq, int(token), lps)
                    if status is not None:
                        break
            else:
                token, lps = entry if isinstance(entry, tuple) else (entry, None)
                status, reason = self._append(seq, int(token), lps)
            if status is not None:
                if seq.status == SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                seq.finish(status, reason)
                bm.free(seq)
                self.requests.pop(seq.request_id, None)
                finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished

    def _append(self, seq: Sequence, token: int, lps) -> tuple:
        """Append one sampled token; (status, reason) when it ends the sequence, else (None, None). A stop
        token (EOS unless ignored, or one of ``stop_token_ids``) stays in the token ids but adds no text,
        as a stop string adds none, unless the request includes stop strings in its output (vLLM's rule)."""
        seq.append_token(token, lps)
        stop_token, token_reason = self._stop_token(seq, token)
        if seq.grammar is not None:
            stop_token, token_reason = self._advance_grammar(seq, token, stop_token, token_reason)
        if seq.detokenizer is not None and (seq.params.include_stop_str_in_output or not stop_token):
            seq.detokenizer.add_tokens([token])
        # Async: the next step may already have computed this token (it was in flight), so a block it
        # completes can be registered only now that its id is known; before a finish frees it.
        self.block_manager.cache_full_blocks(seq)
        if stop_token:
            return SequenceStatus.FINISHED_STOPPED, token_reason
        return self._stop_reason(seq)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int, stop_token: bool, reason) -> tuple[bool, int | None]:
        """Feed ``token`` to the request's grammar matcher; a token that completes the grammar's output (an
        end token, even under ``ignore_eos``) stops the request as a stop token does. The sampler only picks
        tokens the grammar allows; one it refuses (an internal fault) ends the request, logged. A token the
        engine fed to the matcher while it was in flight (``Sequence.grammar_ahead``) is not fed again."""
        if seq.grammar_ahead:
            fed, accepted = seq.grammar_ahead.pop(0)
            if fed != token:
                raise RuntimeError(f"{seq.request_id}: token {token} resolved where {fed} was fed to the grammar")
        else:
            accepted = seq.grammar.accept_token(token)
        if accepted:
            if seq.grammar.is_terminated() and not stop_token:
                return True, None
            return stop_token, reason
        logger.error("%s: the grammar refused sampled token %d; the request ends here", seq.request_id, token)
        return True, None

    def _roll_back_rejected(self, s: ScheduledSequence, num_accepted: int) -> None:
        """After verification: the accepted proposals' KV counts as computed; the rejected ones' KV
        (written past ``num_computed_tokens``) is dropped with the blocks that hold nothing else, so the
        sequence holds exactly the blocks of its computed tokens, as without speculation. Positions past
        ``num_computed_tokens`` are rewritten before anything reads them, and the prefix cache only ever
        hashes known tokens up to ``num_computed_tokens``."""
        if not 0 <= num_accepted <= len(s.spec_token_ids):
            raise RuntimeError(f"{s.request_id}: {num_accepted} accepted of {len(s.spec_token_ids)} proposals")
        seq = s.seq
        seq.num_computed_tokens += num_accepted
        self.block_manager.trim(seq, seq.num_computed_tokens)

    def _reaches_length_limit(self, seq: Sequence) -> bool:
        """Whether the tokens in flight already reach ``max_tokens`` or ``max_model_len``."""
        p = seq.params
        if p.max_tokens is not None and seq.num_output_tokens + seq.num_pending >= p.max_tokens:
            return True
        return seq.num_tokens + seq.num_pending >= self.max_model_len

    def _stop_token(self, seq: Sequence, token: int) -> tuple[bool, int | None]:
        """Whether ``token`` ends the sequence by itself (EOS unless ignored, or one of ``stop_token_ids``),
        and the ``stop_reason`` it reports: None for EOS, the id for a ``stop_token_ids`` entry."""
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return True, None
        if token in p.stop_token_ids:
            return True, token
        return False, None

    def _stop_reason(self, seq: Sequence):
        """(status, stop_reason) when a stop string, ``max_tokens`` or ``max_model_len`` ends ``seq`` after its
        last token (not a stop token), else (None, None)."""
        p = seq.params
        if seq.detokenizer is not None and seq.detokenizer.stopped_on is not None:
            return SequenceStatus.FINISHED_STOPPED, seq.detokenizer.stopped_on
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None
