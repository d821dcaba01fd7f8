"""MTP proposals: the target checkpoint's multi-token-prediction layer guesses the next ``k`` tokens.

The MTP layer (kvforge/models/deepseek_mtp.py) at position ``i`` reads the target's hidden state
``h_i`` and the token ``t_{i+1}`` and guesses ``t_{i+2}``. Its KV is the plan's proposer layer in the
target's MLA group, written through the target sequence's own block tables, so it has no pool, block
manager or rollback of its own: the target's positions and the MTP layer's are the same, and positions
past a sequence's computed tokens are rewritten before anything reads them (the target's trim frees
their blocks).

Two calls per engine step:

1. :meth:`MTPProposer.observe`, right after the target's step and its verification: for every chunk
   of the step, the positions whose next token is now known (a prefill chunk's positions; a sampled
   chunk's real positions and its accepted proposals, whose next tokens are the verified ones) run
   through the MTP layer with the step's hidden states of those rows (the target runner's
   ``last_hidden``).
   This writes the MTP layer's KV of every position the target computed, in the same step (so a block
   the prefix cache registers holds both), and the last row of a sequence that got a token gives the
   head input its first proposal comes from (kept until the next ``propose``).
2. :meth:`MTPProposer.propose`, before the next schedule, for the decoding sequences: proposal 1 from
   that head input's logits; proposals 2 .. k apply the layer again to its own output (its hidden state and the
   previous proposal, one position further), batched over sequences. Those positions
   (``num_computed_tokens`` onwards) are the ones the next step verifies. Each pass reads the proposals of
   the pass before on the device; the host reads all of them once, after the last pass, or for greedy
   sequences not at all (:meth:`MTPProposer.propose_on_device`: verification reads them with the target's
   argmax, kvforge/speculative/device_proposals.py). The blocks of the whole verify
   step are taken now (``BlockManager.append_slots``, which the scheduler's own call then finds in
   place), beyond the step's own only from the spare blocks (the scheduler's ``spare_blocks``), so
   proposals never cause a preemption; a sequence without them gets one proposal. Their KV is scratch:
   the next ``observe`` rewrites every position it keeps, from the target's hidden states.

Greedy requests take the argmax; sampled ones draw from ``q`` and hand it to the verifier
(kvforge/speculative/pick.py). A sequence gets at most as many proposals as ``max_tokens`` and
``max_model_len`` leave room to verify. Prefix caching: a cached block's MTP KV of its last position
was computed with the token that followed it in the sequence that filled the block; a later sequence
sharing the block but not that token gets slightly different proposals (never different output).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import torch

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sequence import Sequence
from kvforge.speculative.device_proposals import DeviceProposals
from kvforge.speculative.draft_model import _room
from kvforge.speculative.pick import pick_proposal_tokens, read_passes


class MTPProposer:
    """See the module docstring; implements :class:`kvforge.speculative.proposer.Proposer`.

    ``runner``: a ModelRunner of the target model (which has ``mtp_forward``) over the plan's proposer
    layers, linked to ``target_runner``, the target's (``ModelRunner.link_mtp``: it keeps each step's hidden
    states). The runner holds every tensor of the proposals (a request's head input in its head slot, one of
    ``runner.max_num_seqs``), so at tensor parallelism each rank runs the same calls on its own copies.
    ``block_manager``: the target's; ``copy_blocks``: applies copy-on-write copies to the pool now;
    ``spare_blocks``: how many free blocks the running sequences' next step does not need."""

    def __init__(self, num_speculative_tokens: int, runner, target_runner, block_manager: BlockManager,
                 max_model_len: int, copy_blocks: Callable[[list[tuple[int, int]]], None],
                 spare_blocks: Callable[[], int] | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        self.runner, self.target_runner = runner, target_runner
        self.block_manager, self.max_model_len = block_manager, max_model_len
        self.copy_blocks = copy_blocks
        self.spare_blocks = spare_blocks or (lambda: block_manager.num_free_blocks)
        runner.link_mtp(target_runner)
        # request id -> (the sequence, its token count then): the runner keeps the head input of its last MTP
        # position in the request's head slot, the start of its next proposals.
        self._heads: dict[str, tuple[Sequence, int]] = {}
        self._slot_of: dict[str, int] = {}  # request id -> head slot, held until the request is discarded
        self._free_slots = list(range(runner.max_num_seqs - 1, -1, -1))
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q [proposals, vocab] of its latest proposals

    def discard(self, request_id: str) -> None:
        self._heads.pop(request_id, None)
        self._probs.pop(request_id, None)
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _head_slot(self, request_id: str) -> int | None:
        slot = self._slot_of.get(request_id)
        if slot is None and self._free_slots:
            slot = self._slot_of[request_id] = self._free_slots.pop()
        return slot

    def proposal_probs(self, seq: Sequence, num_proposals: int) -> torch.Tensor | None:
        """``q`` [num_proposals, vocab] of the sequence's first proposals (None for a greedy request)."""
        probs = self._probs.get(seq.request_id)
        return probs[:num_proposals] if probs is not None else None

    # ---- after each target step ---------------------------------------------------------------------
    def observe(self, scheduled, new_tokens: dict[str, list[int]]) -> None:
        """Run the MTP layer over the step's positions whose next token is known (module docstring, 1).
        ``scheduled``: the step's ``ScheduledSequence`` entries in run order; ``new_tokens``: per sampled
        request, the tokens the step appends (accepted proposals, then the target's token)."""
        chunks, rows, head_rows, head_slots, heads = [], [], [], [], []
        offset = 0
        for s in scheduled:
            seq, start = s.seq, s.start_pos
            real = s.num_new_tokens - len(s.spec_token_ids)
            if s.do_sample:
                appended = new_tokens.get(seq.request_id) or []
                if not appended:
                    offset += s.num_new_tokens
                    continue
                following = list(s.token_ids[1:real]) + appended
            else:  # a prefill chunk before the prompt's end: the next prompt token follows it
                following = list(s.token_ids[1:real]) + seq.token_ids_slice(start + real, start + real + 1)
            rows.extend(range(offset, offset + len(following)))
            chunks.append((following, start, seq.block_tables))
            slot = self._head_slot(seq.request_id) if s.do_sample else None
            if slot is not None:
                head_rows.append(len(rows) - 1)
                head_slots.append(slot)
                heads.append(seq)
            offset += s.num_new_tokens
        if not chunks:
            self.target_runner.last_hidden = None  # not held past this step
            return
        self.runner.mtp_observe(chunks, rows, head_rows, head_slots)
        for seq in heads:
            self._heads[seq.request_id] = (seq, seq.num_tokens + len(new_tokens[seq.request_id]))

    # ---- before each schedule -----------------------------------------------------------------------
    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]:
        passes, probs = self._passes(seqs)
        self._probs = {seqs[i].request_id: torch.stack(rows_q) for i, rows_q in probs.items()}
        return read_passes(passes, len(seqs))

    def propose_on_device(self, seqs: SequenceOf[Sequence]) -> DeviceProposals | None:
        """:meth:`propose` for greedy sequences, without reading the proposals: they stay on the device
        (kvforge/speculative/device_proposals.py); None when no sequence gets any."""
        if any(not seq.params.is_greedy for seq in seqs):
            raise ValueError("proposals stay on the device for greedy sequences only (sampled ones hand q over)")
        self._probs = {}
        passes, _ = self._passes(seqs)
        if not passes:
            return None
        index: dict[str, list[int]] = {}
        at = 0
        for indices, tokens in passes:
            for row, i in enumerate(indices):
                index.setdefault(seqs[i].request_id, []).append(at + row)
            at += tokens.shape[0]
        return DeviceProposals(torch.cat([tokens for _, tokens in passes]), index)

    def _passes(self, seqs: SequenceOf[Sequence]) -> tuple[list[tuple[list[int], torch.Tensor]],
                                                          dict[int, list[torch.Tensor]]]:
        """The MTP passes of a propose call: per pass, the indices into ``seqs`` of its rows and their
        proposals on the device; and per sampled sequence index, the ``q`` row of each of its proposals."""
        active = []  # (index into seqs, sequence, proposals wanted)
        slots = []
        bm, spare = self.block_manager, self.spare_blocks()
        for i, seq in enumerate(seqs):
            head = self._heads.pop(seq.request_id, None)
            if head is None or head[0] is not seq or head[1] != seq.num_tokens:
                continue  # no MTP output for this sequence's current last position (e.g. it was preempted)
            room = _room(seq, self.num_speculative_tokens, self.max_model_len)
            if room == 0:
                continue
            if room > 1:  # blocks of the verify step's positions, beyond its own token's only spare ones
                own = seq.num_tokens - seq.num_computed_tokens
                extra = bm.new_blocks_for_step(seq, own + room) - bm.new_blocks_for_step(seq, own)
                if extra > spare or not bm.append_slots(seq, own + room):
                    room = 1  # one proposal: it writes no position past the step's own
                else:
                    spare -= extra
            active.append((i, seq, room))
            slots.append(self._slot_of[seq.request_id])
        probs: dict[int, list[torch.Tensor]] = {}
        passes: list[tuple[list[int], torch.Tensor]] = []
        if not active:
            return passes, probs
        copies = bm.take_copies()
        if copies:
            self.copy_blocks(copies)
        logits = self.runner.mtp_first(slots)
        step = 1
        while True:
            tokens, q = pick_proposal_tokens(logits, [seq for _, seq, _ in active])
            passes.append(([i for i, _, _ in active], tokens))
            for (i, _, _), row in zip(active, q):
                if row is not None:
                    probs.setdefault(i, []).append(row)
            keep = [j for j, (_, _, wanted) in enumerate(active) if wanted > step]
            if not keep:
                return passes, probs
            active = [active[j] for j in keep]
            # The layer again at the next position: its own output in place of the target's hidden state, and
            # as its token the proposal just picked (row keep[j] of ``tokens``, on the device; 0 a placeholder).
            chunks = [([0], seq.num_tokens - 2 + step, seq.block_tables) for _, seq, _ in active]
            logits = self.runner.mtp_next(chunks, keep, tokens)
            step += 1
