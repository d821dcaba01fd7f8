"""Prefix caching for models with linear-attention state layers.

A paged layer resumes a request from the cached KV blocks of its prompt's prefix; a state layer holds one
running state per request, which a cached prefix must supply as well. So the state is kept, as a
snapshot in a state slot no request holds (kvforge/engine/state_slots.py), where a prefill chunk ends at
a block boundary, keyed by that block's chained hash; a hit ends only at a block with a snapshot.

Rules (one place each):

- **Where snapshots are taken.** After a step, for every prefill chunk whose end is a block boundary at
  or before ``snapshot_boundary(seq)``: the last block boundary before the sequence's last known token
  (a hit never covers every token, kvforge/engine/block_manager.py). ``chunk_tokens`` cuts the chunk
  that would run past that boundary to end on it when a slot besides the sequence's own could keep the
  snapshot, so a prompt longer than a block leaves a snapshot at its last block boundary before its last
  token; the remaining tokens run in the next step. The snapshots of one step never evict each other.
  Decode steps take none (a copy of the whole state every block of generated tokens would cost more
  than the KV it saves).
- **What a hit needs.** ``lookup_prefix`` gets ``resumable``: the hit is the longest cached KV prefix
  that ends at a block with a snapshot.
- **Restoring.** When the scheduler admits a request with a hit, ``restore`` gives it a slot and copies
  the snapshot into it at once (the copy runs before the step's layers, in stream order); when no other
  slot is left, the request takes the snapshot's own slot.
- **Eviction.** Snapshots live in slots no request holds and go least recently used first when a
  request or a newer snapshot needs a slot; the plan's state slots are never exceeded.

Every copy goes through the runner's ``copy_state_slots`` (at tensor parallelism > 1 every rank applies
it, in the same order as the verification replays).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sequence import Sequence
from kvforge.engine.state_slots import StateSlots


class StatePrefixCache:
    def __init__(self, slots: StateSlots, block_manager: BlockManager,
                 copy_state_slots: Callable[[list[tuple[int, int]]], None]):
        self.slots = slots
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.copy_state_slots = copy_state_slots
        self.snapshots_taken = 0
        self.snapshots_restored = 0

    def counters(self) -> dict:
        """Snapshots kept now, taken and restored so far."""
        return {"kept": self.slots.num_snapshots, "taken": self.snapshots_taken, "restored": self.snapshots_restored}

    def resumable(self, block_hash: bytes) -> bool:
        """Whether a prefix-cache hit may end with the block of ``block_hash``."""
        return self.slots.has_snapshot(block_hash)

    def snapshot_boundary(self, seq: Sequence) -> int:
        """The last block boundary a hit of ``seq``'s tokens could end at (0: none)."""
        return (seq.num_tokens - 1) // self.block_size * self.block_size

    def find_branch_point(self, seq: Sequence, num_cached: int) -> None:
        """Set ``seq.state_branch_point`` at admission, ``num_cached`` tokens being its hit: the end of its
        cached KV blocks when that lies past the hit, before its snapshot boundary, and another cached
        request branches off there; else 0."""
        seq.state_branch_point = 0
        kv_blocks = len(self.block_manager.lookup_prefix(seq))
        point = kv_blocks * self.block_size
        if (num_cached < point < self.snapshot_boundary(seq)
                and self.block_manager.has_other_continuation(seq, kv_blocks)):
            seq.state_branch_point = point

    def chunk_tokens(self, seq: Sequence, start: int, num_tokens: int) -> int:
        """``num_tokens`` of a prefill chunk from ``start``, cut to end at the first of
        ``seq.state_branch_point`` and ``snapshot_boundary(seq)`` the chunk would run past, when a slot
        could keep the snapshot (one besides the sequence's own: with every slot held by running requests
        nothing would be kept, so nothing is cut)."""
        end = start + num_tokens
        cuts = [b for b in (seq.state_branch_point, self.snapshot_boundary(seq)) if start < b < end]
        if not cuts:
            return num_tokens
        spare = self.slots.num_free - (seq.request_id not in self.slots.held)
        return min(cuts) - start if spare > 0 else num_tokens

    def restore(self, seq: Sequence) -> None:
        """Give ``seq`` (just admitted with ``seq.num_computed_tokens`` from the prefix cache, which ends at
        a block with a snapshot) its state slot holding that snapshot."""
        if seq.num_computed_tokens == 0:
            return
        n = seq.num_computed_tokens // self.block_size
        key = self.block_manager.block_hashes(seq, n)[n - 1]
        slot, source = self.slots.acquire_from(seq.request_id, key)
        if source is not None:
            self.copy_state_slots([(source, slot)])
        self.snapshots_restored += 1

    def take_snapshots(self, chunks: Iterable[tuple[Sequence, int, int]]) -> None:
        """After a step of ``(sequence, start, tokens)`` chunks: copy the state of each sequence whose chunk
        ended at a block boundary at or before its snapshot boundary into a snapshot slot."""
        pairs, made = [], set()
        for seq, start, n in chunks:
            end = start + n
            if end == 0 or end % self.block_size or end > self.snapshot_boundary(seq):
                continue
            key = self.block_manager.block_hashes(seq, end // self.block_size)[-1]
            dest = self.slots.snapshot_slot(key, protected=made)  # never a slot this call copies into
            if dest is not None:
                pairs.append((self.slots.held[seq.request_id], dest))
                made.add(key)
        if pairs:
            self.copy_state_slots(pairs)
            self.snapshots_taken += len(pairs)
