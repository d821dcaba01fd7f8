"""Prefix caching for models with linear-attention state layers.

A paged layer resumes a request from the cached KV blocks of its prompt's prefix; a state layer holds one
running state per request, which a cached prefix must supply as well. So the state is kept, as a
snapshot in a state slot no request holds (kvforge/engine/state_slots.py), at chosen block boundaries,
keyed by that block's chained hash; a hit ends only at a block with a snapshot.

Rules (one place each):

- **Where snapshots are taken.** At ``snapshot_boundary(seq)``, the last block boundary before the
  sequence's last known token (a hit never covers every token, kvforge/engine/block_manager.py), at
  the sequence's branch point (below) and every ``interval`` tokens before the snapshot boundary (cadence
  points, so that a request sharing only part of a prompt resumes near where they part), wherever a
  prefill chunk passes them, and where a prefill chunk ends on a block boundary at or before the snapshot
  boundary. A step takes at most ``SNAPSHOTS_PER_SEQUENCE`` inside one sequence's chunk: the snapshot
  boundary, the branch point, then cadence points spread over the chunk where more pass (never at the
  defaults: an interval of 2048 leaves at most three inside a chunk of 8192). A point inside a chunk is taken inside
  the step (``plan_snapshots``, once the step is scheduled: the state layers store the state after that
  token into the snapshot's slot, kvforge/attention/linear_state.py); a chunk's end is a copy after the
  step (``take_snapshots``). So a prompt longer than a block leaves a snapshot at its last block boundary
  before its last token, in the step that computes it. The snapshots of one step never evict each
  other. Decode steps take none (a copy of the whole state every block of generated tokens would cost
  more than the KV it saves).
- **Branch points.** A shared system prompt followed by different messages ends no chunk where the
  messages part: at admission, ``find_branch_point`` marks the end of the request's cached KV blocks past
  its hit when the cache holds another continuation of that prefix (another request went on from there;
  a chat's previous turn just stopped there), and a snapshot is taken there too: the first request of a
  shared prefix leaves none where the prefix ends, the second computes it again and leaves one, every
  later one resumes there.
- **What a hit needs.** ``lookup_prefix`` gets ``resumable``: the hit is the longest cached KV prefix
  that ends at a block with a snapshot.
- **Restoring.** When the scheduler admits a request with a hit, ``restore`` gives it a slot and copies
  the snapshot into it at once (the copy runs before the step's layers, in stream order); when no other
  slot is left, the request takes the snapshot's own slot.
- **Eviction.** Snapshots live in slots no request holds and go least recently used first when a
  request or a newer snapshot needs a slot; the plan's state slots are never exceeded.

Every copy goes through the runner's ``copy_state_slots`` (at tensor parallelism > 1 every rank applies
it, in the same order as the verification replays); the snapshots taken inside a step go with the step's
inputs to every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvforge.attention.linear_state import SNAPSHOTS_PER_SEQUENCE
from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sequence import Sequence
from kvforge.engine.state_slots import StateSlots


class StatePrefixCache:
    def __init__(self, slots: StateSlots, block_manager: BlockManager,
                 copy_state_slots: Callable[[list[tuple[int, int]]], None], interval: int = 0):
        """``interval``: tokens between cadence snapshots, rounded up to whole blocks (0: none)."""
        self.slots = slots
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.interval = -(-interval // self.block_size) * self.block_size if interval > 0 else 0
        self.copy_state_slots = copy_state_slots
        self.snapshots_taken = 0
        self.snapshots_restored = 0
        self._made: set[bytes] = set()  # keys of the snapshots the step being run takes inside its chunks

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

    def plan_snapshots(self, chunks: Iterable[tuple[Sequence, int, int]]) -> list[tuple[int, int, int]]:
        """Before a step of ``(sequence, start, tokens)`` chunks (in the step's order): the snapshots its state
        layers take inside the chunks, ``(chunk index, offset, slot)`` (the state after the chunk's token
        ``offset`` goes to ``slot``): at the sequence's snapshot boundary, branch point and cadence points where
        they lie strictly inside its chunk (``_points_inside``), each registered now under its block's hash in a
        slot no request holds."""
        out, self._made = [], set()
        for index, (seq, start, n) in enumerate(chunks):
            for point in self._points_inside(seq, start, start + n):
                key = self.block_manager.block_hashes(seq, point // self.block_size)[-1]
                if key in self._made:
                    continue  # another sequence of the step stores the same prefix's state
                dest = self.slots.snapshot_slot(key, protected=self._made)
                if dest is not None:
                    out.append((index, point - start - 1, dest))
                    self._made.add(key)
        self.snapshots_taken += len(out)
        return out

    def _points_inside(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The snapshot points strictly inside tokens ``start..end`` of ``seq``, at most
        ``SNAPSHOTS_PER_SEQUENCE``: its snapshot boundary and branch point, then its cadence points, spread over
        the chunk from its first where more pass than the room left."""
        boundary = self.snapshot_boundary(seq)
        first = [p for p in dict.fromkeys((boundary, seq.state_branch_point)) if start < p < end]
        cadence = []
        if self.interval:
            last = min(end - 1, boundary - 1) // self.interval * self.interval
            cadence = [p for p in range(start // self.interval * self.interval + self.interval, last + 1,
                                        self.interval) if p not in first]
        room = SNAPSHOTS_PER_SEQUENCE - len(first)
        if len(cadence) > room:
            cadence = [cadence[i * len(cadence) // room] for i in range(room)]
        return sorted(first + cadence)

    def take_snapshots(self, chunks: Iterable[tuple[Sequence, int, int]]) -> None:
        """After a step of ``(sequence, start, tokens)`` chunks: copy the state of each sequence whose chunk
        ended at a block boundary at or before its snapshot boundary into a snapshot slot (never evicting one
        the step took inside its chunks)."""
        pairs, made = [], set(self._made)
        self._made = set()
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
