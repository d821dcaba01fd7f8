"""Draft-model proposals: a smaller model of the target's vocabulary guesses the next ``k`` tokens.

The draft's layers live in the target's KV pool: the plan places each in the target's group of the same
page layout or in groups of their own (``GroupPlan.draft_layers``), so a sequence's block tables (one per
group) hold the draft's KV beside the target's, allocated, shared, cached, trimmed and freed by the target's
one block manager. The draft keeps no blocks of its own and no rollback of its own: ``BlockManager.trim``
after verification drops the rejected positions of both.

Invariant: every position the target has computed holds the draft's KV of the same token. The engine keeps
it with :meth:`DraftModelProposer.follow`: after each target step, the draft runs over the step's chunks
that carry no proposals (prefill chunks, decodes without proposals), at the same positions in the same
blocks. So a block is registered in the prefix cache only once both models wrote it (registration follows
the step), a prefix hit skips the draft's layers for its tokens too, a sliding group frees a block only
after both used it, and a preempted sequence recomputes both.

A call of :meth:`DraftModelProposer.propose` (decoding sequences: all tokens but the last computed):

1. Rollback. The draft's KV holds the sequence's tokens, then the proposals it fed itself last step; those
   count only as far as they are the sequence's tokens now and the target has computed them (positions past
   the target's computed tokens may sit in blocks the target's trim freed). Positions past the valid length
   are never read before the next feed rewrites them: attention is causal from the fed position.
2. Blocks. The verify step writes the last token and the proposals at positions ``num_computed_tokens ..
   + room``; the draft writes its KV for exactly those positions first, so the proposer takes their blocks
   through the target's ``append_slots`` (the scheduler's own call for the step then adds none) and applies
   any copy-on-write at once. It takes only blocks the running sequences' next step does not need
   (``spare_blocks``, the scheduler's count), so proposals never cause a preemption; a sequence without
   room proposes nothing this step (its decode runs without proposals and ``follow`` feeds the draft).
3. Proposals. The last known token (and any token the draft has not seen) is fed; the last row's logits
   give proposal 1; one pass of one token per sequence for each further proposal gives proposals 2 .. k,
   and one last pass feeds proposal k, so the draft's KV covers every position the verify step writes and
   every accepted proposal is a computed position of both models. Each pass takes the previous pass's
   proposals as its ids on the device; the host reads all of a call's proposals once, after the last pass
   (at tensor parallelism every pass: the workers get their ids from the host). Proposals are picked by
   ``kvforge/speculative/pick.py`` (argmax for greedy requests, a draw from ``q`` for sampled ones); ``q``
   of every proposal is kept for the verifier's rejection sampling (:meth:`proposal_probs`).

A sequence gets at most as many proposals as ``max_tokens`` and ``max_model_len`` leave room to verify (the
scheduler's rule), so the draft never writes past position ``max_model_len - 1``. The engine calls
:meth:`discard` when a sequence finishes, is aborted or preempted (its blocks go with the target's).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import torch

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sequence import Sequence
from kvforge.speculative.pick import pick_proposal_tokens, read_passes


class DraftState:
    """What the draft has written for one sequence: positions ``0 .. num_real - 1`` hold the draft's KV of
    the sequence's tokens; the next ``len(fed)`` positions hold proposals it fed itself, not yet known to be
    the sequence's."""

    __slots__ = ("seq", "request_id", "num_real", "fed")

    def __init__(self, seq: Sequence, num_real: int):
        self.seq, self.request_id = seq, seq.request_id
        self.num_real = num_real
        self.fed: list[int] = []

    @property
    def num_written(self) -> int:
        return self.num_real + len(self.fed)


def _room(seq: Sequence, k: int, max_model_len: int) -> int:
    """Proposals the step can verify for ``seq``: every accepted one plus the target's token must fit within
    ``max_tokens`` and ``max_model_len`` (the scheduler's rule)."""
    room = min(k, max_model_len - seq.num_tokens - 1)
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(room, 0)


class DraftModelProposer:
    """See the module docstring; implements :class:`kvforge.speculative.proposer.Proposer`. ``runner``: a
    ModelRunner over the draft model and its layers of the target's pool (``KVPool.draft_view``);
    ``block_manager``: the target's; ``copy_blocks``: applies copy-on-write block copies to the pool now
    (the engine's, which also tells both runners their tables changed); ``spare_blocks``: how many free
    blocks the running sequences' next step does not need (the scheduler's ``spare_blocks``; without it,
    every free block)."""

    def __init__(self, num_speculative_tokens: int, runner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int, copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None,
                 spare_blocks: Callable[[], int] | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        self.runner, self.block_manager = runner, block_manager
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self.copy_blocks = copy_blocks
        self.spare_blocks = spare_blocks or (lambda: block_manager.num_free_blocks)
        self._states: dict[str, DraftState] = {}
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q [proposals, vocab] of its latest proposals

    # ---- state ------------------------------------------------------------------------------------------
    def discard(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request (its blocks are the target's, freed with it)."""
        self._states.pop(request_id, None)
        self._probs.pop(request_id, None)

    def _state(self, seq: Sequence, start: int) -> DraftState:
        """The sequence's state; a new one trusts the ``start`` positions the target computed (the invariant:
        a prefix-cache hit's blocks hold the draft's KV too)."""
        state = self._states.get(seq.request_id)
        if state is not None and state.seq is not seq:
            self.discard(seq.request_id)
            state = None
        if state is None:
            state = self._states[seq.request_id] = DraftState(seq, start)
        return state

    @staticmethod
    def _roll_back(state: DraftState, limit: int) -> int:
        """The valid length (module docstring, 1): the fed proposals the sequence took, at most ``limit``."""
        seq = state.seq
        valid = state.num_real
        for token in state.fed:
            if valid >= seq.num_tokens or seq.token_ids_slice(valid, valid + 1)[0] != token:
                break
            valid += 1
        valid = min(valid, limit)
        state.num_real, state.fed = valid, []
        return valid

    def follow(self, scheduled, prev=None) -> None:
        """Run the draft over a target step's chunks without proposals (``ScheduledSequence`` list), so the
        draft's KV covers every position the target computed (the module's invariant). Chunks with proposals
        were written by :meth:`propose` already. ``prev``: the step still in flight under async scheduling
        (``InflightStep``); a chunk's last token that it samples is gathered on the device from its
        ``token_ids``, as for the target's step."""
        chunks, ph_rows, ph_src, offset = [], [], [], 0
        for s in scheduled:
            if s.spec_token_ids:
                continue
            seq = s.seq
            end = s.start_pos + s.num_new_tokens
            state = self._state(seq, s.start_pos)
            valid = self._roll_back(state, end)
            if valid < end:
                tokens = seq.token_ids_slice(valid, min(end, seq.num_tokens))
                if end > seq.num_tokens:  # the last token is in flight: a placeholder
                    tokens = tokens + [0]
                    ph_rows.append(offset + len(tokens) - 1)
                    ph_src.append(prev.row_of[seq.request_id])
                chunks.append((tokens, valid, seq.block_tables))
                offset += len(tokens)
                state.num_real = end
        if chunks:
            self.runner.run(chunks, [], placeholders=(ph_rows, ph_src, prev.token_ids) if ph_rows else None)

    # ---- proposing --------------------------------------------------------------------------------------
    def proposal_probs(self, seq: Sequence, num_proposals: int) -> torch.Tensor | None:
        """``q`` [num_proposals, vocab] of the sequence's first proposals (None for a greedy request)."""
        probs = self._probs.get(seq.request_id)
        return probs[:num_proposals] if probs is not None else None

    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]:
        k, bm = self.num_speculative_tokens, self.block_manager
        self._probs = {}
        out: list[list[int]] = [[] for _ in seqs]
        budget, spare = self.max_num_batched_tokens, self.spare_blocks()
        chunks, going = [], []  # going: (output index, state, proposals wanted)
        for i, seq in enumerate(seqs):
            room = _room(seq, k, self.max_model_len)
            if room == 0:
                continue
            state = self._state(seq, seq.num_computed_tokens)
            start = self._roll_back(state, seq.num_computed_tokens)
            chunk = seq.num_tokens - start
            # Blocks for every position the verify step writes: num_computed_tokens .. num_tokens - 1 + room;
            # beyond the step's own (without proposals), only spare ones.
            own = seq.num_tokens - seq.num_computed_tokens
            extra = bm.new_blocks_for_step(seq, own + room) - bm.new_blocks_for_step(seq, own)
            if chunk > budget or extra > spare or not bm.append_slots(seq, own + room):
                continue  # no proposal this step; the decode feeds the draft (follow)
            budget -= chunk
            spare -= extra
            chunks.append((seq.token_ids_slice(start, seq.num_tokens), start, seq.block_tables))
            state.num_real = seq.num_tokens
            going.append((i, state, room))
        if not chunks:
            return out
        copies = bm.take_copies()
        if copies:
            self.copy_blocks(copies)
        offsets, total = [], 0
        for tokens, _, _ in chunks:
            total += len(tokens)
            offsets.append(total - 1)
        logits = self.runner.run(chunks, offsets)
        active = going
        probs: dict[int, list[torch.Tensor]] = {}
        passes = []  # per pass: the output index of each row, the rows' proposals on the device
        step = 1
        while True:
            tokens, q = pick_proposal_tokens(logits, [state.seq for _, state, _ in active])
            passes.append(([i for i, _, _ in active], tokens))
            # Feed each new proposal: the draft's KV at the position the verify step gives it, its id gathered
            # on the device from ``tokens`` (row j of the pass is chunk j).
            chunks = []
            for (i, state, _), row in zip(active, q):
                if row is not None:
                    probs.setdefault(i, []).append(row)
                chunks.append(([0], state.num_written, state.seq.block_tables))
                state.fed.append(0)  # a placeholder until the read below
            still = [j for j, (_, _, wanted) in enumerate(active) if wanted > step]
            logits = self.runner.run_picked(chunks, still, tokens)
            active = [active[j] for j in still]
            if not active:
                break
            step += 1
        out = read_passes(passes, len(seqs))
        for i, state, _ in going:
            state.fed = list(out[i])
        for i, rows_q in probs.items():
            self._probs[seqs[i].request_id] = torch.stack(rows_q)
        return out
