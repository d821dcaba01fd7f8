"""Per-request state slots (one ring page per layer for CsaRingTest models).

Invariant: a request holds at most one slot, a slot belongs to at most one
request, and ``num_free + len(held) == num_slots``. The engine caps
``max_num_seqs`` at ``num_slots`` so running requests always find one;
preempted and finished requests give theirs back.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: str) -> int:
        slot = self.held.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"no free state slot for {request_id!r} ({self.num_slots} slots all held)")
            slot = self.held[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> int | None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot
