"""Draft-model proposals: a smaller model of the target's vocabulary guesses the next ``k`` tokens.

The draft keeps its KV in a pool of its own (the plan's ``draft``: its groups, carved out of the same KV
memory as the target's) with its own block manager; each decoding sequence has one draft state there
(its block tables, its computed length). A call of :meth:`DraftModelProposer.propose`:

1. Rollback. The draft's KV holds the sequence's tokens it has seen, then the proposals it fed itself
   last step. Those count only as far as they are the sequence's tokens now (the target accepted them);
   the draft's computed length falls back to there and ``BlockManager.trim`` frees the blocks past it,
   as for the target's rejected positions. Positions past the computed length are never read: the next
   pass rewrites them first. The last known token is always fed again (its logits give proposal 1).
2. Catch-up. One batched pass over every sequence's tokens the draft has not seen (the whole prompt the
   first time, then the target's token and any accepted proposal it did not feed), within
   ``max_num_batched_tokens`` tokens like a prefill chunk; a sequence whose catch-up does not fit this
   step continues in the next and proposes nothing meanwhile.
3. Proposals. The last row's logits give proposal 1; ``k - 1`` more passes of one token per sequence give
   proposals 2 .. k, picked by ``kvforge/speculative/pick.py`` (argmax for greedy requests, a draw from
   ``q`` for sampled ones); ``q`` of every proposal is kept for the verifier's rejection sampling
   (:meth:`proposal_probs`).

A sequence gets at most as many proposals as ``max_tokens`` and ``max_model_len`` leave room to verify, so
the draft never writes past position ``max_model_len - 2``. A state is freed when its sequence finishes,
is aborted or preempted (:meth:`discard`, called by the engine), so the draft's blocks follow the
target's.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sequence import Sequence
from kvforge.speculative.pick import pick_proposals


class DraftState:
    """One sequence's KV in the draft's pool, in the shape ``BlockManager`` hands blocks to.

    Positions ``0 .. num_computed_tokens - 1`` hold KV: the sequence's tokens up to ``num_real``, then
    ``fed`` (proposals the draft fed itself, not yet known to be the sequence's)."""

    __slots__ = ("seq", "request_id", "block_tables", "num_skipped_blocks", "num_registered_blocks",
                 "num_computed_tokens", "num_real", "fed")

    def __init__(self, seq: Sequence, num_groups: int):
        self.seq, self.request_id = seq, seq.request_id
        self.block_tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_skipped_blocks = [0] * num_groups
        self.num_registered_blocks = 0
        self.num_computed_tokens = 0
        self.num_real = 0
        self.fed: list[int] = []

    @property
    def holds_blocks(self) -> bool:
        return any(self.block_tables)


def _room(seq: Sequence, k: int, max_model_len: int) -> int:
    """Proposals the step can verify for ``seq``: every accepted one plus the target's token must fit within
    ``max_tokens`` and ``max_model_len`` (the scheduler's rule)."""
    room = min(k, max_model_len - seq.num_tokens - 1)
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(room, 0)


class DraftModelProposer:
    """See the module docstring; implements :class:`kvforge.speculative.proposer.Proposer`. ``runner``: a
    ModelRunner over the draft model and its pool; ``block_manager``: the draft pool's block ids."""

    def __init__(self, num_speculative_tokens: int, runner, block_manager: BlockManager, max_model_len: int,
                 max_num_batched_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.runner, self.block_manager = runner, block_manager
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self._states: dict[str, DraftState] = {}
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q [proposals, vocab] of its latest proposals

    # ---- state ------------------------------------------------------------------------------------------
    def discard(self, request_id: str) -> None:
        """Free the draft's blocks of a finished, aborted or preempted request (a later call starts over)."""
        state = self._states.pop(request_id, None)
        self._probs.pop(request_id, None)
        if state is not None:
            self.block_manager.free(state)

    def _state(self, seq: Sequence) -> DraftState:
        state = self._states.get(seq.request_id)
        if state is not None and state.seq is not seq:
            self.discard(seq.request_id)
            state = None
        if state is None:
            state = self._states[seq.request_id] = DraftState(seq, self.block_manager.num_groups)
        return state

    def _roll_back(self, state: DraftState) -> int:
        """Drop the KV of proposals the sequence did not take (module docstring, 1); returns the tokens to feed."""
        seq = state.seq
        valid = state.num_real
        for j, token in enumerate(state.fed):
            if valid >= seq.num_tokens or seq.token_ids_slice(valid, valid + 1)[0] != token:
                break
            valid = state.num_real + j + 1
        valid = min(valid, state.num_computed_tokens, seq.num_tokens - 1)  # the last token is always fed
        if valid < state.num_computed_tokens:
            state.num_computed_tokens = valid
            self.block_manager.trim(state, valid)
        state.num_real, state.fed = valid, []
        return seq.num_tokens - valid

    # ---- proposing --------------------------------------------------------------------------------------
    def proposal_probs(self, seq: Sequence, num_proposals: int) -> torch.Tensor | None:
        """``q`` [num_proposals, vocab] of the sequence's first proposals (None for a greedy request)."""
        probs = self._probs.get(seq.request_id)
        return probs[:num_proposals] if probs is not None else None

    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]:
        k, bm = self.num_speculative_tokens, self.block_manager
        self._probs = {}
        out: list[list[int]] = [[] for _ in seqs]
        budget = self.max_num_batched_tokens
        chunks, rows, going = [], [], []  # going: (output index, state, proposals wanted, chunk index)
        offset = 0
        for i, seq in enumerate(seqs):
            room = _room(seq, k, self.max_model_len)
            if room == 0 or budget == 0:
                continue
            state = self._state(seq)
            need = self._roll_back(state)
            chunk = min(need, budget)
            wanted = room if chunk == need else 0
            start = state.num_computed_tokens
            if not bm.append_slots(state, chunk + max(wanted - 1, 0)):
                if not wanted or not bm.append_slots(state, chunk):
                    continue  # the draft's pool is full: no proposal for this sequence this step
                wanted = 0
            budget -= chunk
            chunks.append((seq.token_ids_slice(start, start + chunk), start, state.block_tables))
            offset += chunk
            rows.append(offset - 1)
            state.num_computed_tokens = state.num_real = start + chunk
            if wanted:
                going.append((i, state, wanted, len(chunks) - 1))
        if not chunks:
            return out
        logits = self.runner.run(chunks, rows)
        if not going:
            return out
        logits = logits[torch.tensor([j for *_, j in going], device=logits.device)]
        active = [(i, state, wanted) for i, state, wanted, _ in going]
        probs: dict[int, list[torch.Tensor]] = {}
        step = 1
        while True:
            tokens, q = pick_proposals(logits, [state.seq for _, state, _ in active])
            for (i, _, _), token, row in zip(active, tokens, q):
                out[i].append(token)
                if row is not None:
                    probs.setdefault(i, []).append(row)
            active = [(i, state, wanted) for i, state, wanted in active if wanted > step]
            if not active:
                break
            chunks = []
            for i, state, _ in active:
                pos = state.num_computed_tokens
                token = out[i][-1]
                chunks.append(([token], pos, state.block_tables))
                state.fed.append(token)
                state.num_computed_tokens = pos + 1
            logits = self.runner.run(chunks, list(range(len(chunks))))
            step += 1
        for i, rows_q in probs.items():
            self._probs[seqs[i].request_id] = torch.stack(rows_q)
        return out
