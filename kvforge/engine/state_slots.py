"""Per-request state slots (one ring page per layer for CsaRingTest models, every linear-attention layer's
conv and recurrent state for linear-attention models), and the prefix snapshots kept in the slots no
request holds.

Invariants: a request holds at most one slot, a slot belongs to at most one request or one snapshot, and
``num_free + len(held) == num_slots`` where ``num_free`` counts the empty slots and the snapshots (a
snapshot is evicted, least recently used first, whenever a request needs its slot). The engine caps
``max_num_seqs`` at ``num_slots`` so running requests always find one; preempted and finished requests
give theirs back.

A snapshot is a sequence's state where its computed tokens reach a block boundary (stored by the step that
passes it, or copied after a step that ends there), keyed by that block's chained hash
(kvforge/engine/block_manager.py): a later request whose prompt starts with the same blocks resumes from it
(kvforge/engine/state_prefix.py).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._empty = list(range(num_slots - 1, -1, -1))
        self.held: dict[str, int] = {}
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    @property
    def num_free(self) -> int:
        """Slots a request can take: empty ones and those holding only a snapshot."""
        return len(self._empty) + len(self._snapshots)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def _take(self, keep: bytes | None = None, protected=()) -> int | None:
        """An empty slot, else the least recently used snapshot's slot (``keep``'s only when no other is
        left, never one in ``protected``); None when every slot is held by a request or protected."""
        if self._empty:
            return self._empty.pop()
        for key in self._snapshots:
            if key != keep and key not in protected:
                return self._snapshots.pop(key)
        if keep is not None and keep in self._snapshots:
            return self._snapshots.pop(keep)
        return None

    def acquire(self, request_id: str) -> int:
        slot = self.held.get(request_id)
        if slot is None:
            slot = self._take()
            if slot is None:
                raise RuntimeError(f"no free state slot for {request_id!r} ({self.num_slots} slots all held)")
            self.held[request_id] = slot
        return slot

    def acquire_from(self, request_id: str, key: bytes) -> tuple[int, int | None]:
        """A slot for ``request_id`` (which holds none) that is to start from snapshot ``key``:
        ``(slot, source)`` where the caller copies slot ``source`` into ``slot``, or ``source`` None when
        no other slot was left and the request took the snapshot's own slot (the snapshot is then gone)."""
        if request_id in self.held:
            raise RuntimeError(f"{request_id!r} already holds state slot {self.held[request_id]}")
        source = self._snapshots.get(key)
        if source is None:
            raise KeyError(f"no state snapshot for the block {key.hex()[:16]}")
        self._snapshots.move_to_end(key)
        slot = self._take(keep=key)
        self.held[request_id] = slot
        return slot, (None if slot == source else source)

    def release(self, request_id: str) -> int | None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self._empty.append(slot)
        return slot

    # ---- snapshots -----------------------------------------------------------
    def has_snapshot(self, key: bytes) -> bool:
        return key in self._snapshots

    def snapshot_slot(self, key: bytes, protected=()) -> int | None:
        """The slot to copy a state into as snapshot ``key`` (an empty slot, else the least recently used
        snapshot's but those in ``protected``); None when ``key`` is kept already (now the most recently
        used) or every slot is held by a request or a protected snapshot."""
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return None
        slot = self._take(protected=protected)
        if slot is not None:
            self._snapshots[key] = slot
        return slot

    def drop_snapshots(self) -> int:
        """Forget every snapshot (their slots become empty); how many there were."""
        n = len(self._snapshots)
        self._empty.extend(self._snapshots.values())
        self._snapshots.clear()
        return n
