"""The per-request ring's backend object (CsaRingTest): rows written into a ring inside one page."""

from __future__ import annotations

import torch

from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.ring_backend import RING


@register_backend
class RingBackend(AttentionBackend):
    """``kv.cache`` is the layer's rings, ``[state slots, ring rows, row bytes]`` uint8 (a view into the ring
    pages); a row is stored as its raw bytes. The rings are write-only: nothing attends over them."""

    declaration = RING

    def write_cache(self, kv, slot_mapping, ring_rows, rows):
        """Row ``i`` of ``rows`` goes to ring row ``ring_rows[i]`` of slot ``slot_mapping[i]``; no two rows of
        one call may share a (slot, ring row) (indexed stores with duplicates have no defined order)."""
        data = rows.contiguous().view(torch.uint8).view(rows.shape[0], kv.cache.shape[-1])
        kv.cache[slot_mapping, ring_rows] = data

    def attend(self, kv, meta, *query, num_splits=None):
        raise NotImplementedError("per-request rings are write-only: nothing attends over them")
