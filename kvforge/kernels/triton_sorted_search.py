"""Triton helper: which segment of a batch an index falls in, by binary search over the segments' starts.

Varlen kernels find a token's sequence (over ``query_start_loc``) or a chunk's sequence (over each sequence's
first chunk number) this way, with a run-time count of halvings, so one compiled variant serves every batch.
"""

from __future__ import annotations

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def last_start_at_or_below(starts_ptr, x, lo, hi, steps):
        """The last index ``i`` in ``[lo, hi)`` with ``starts[i] <= x``, elementwise over ``x`` (a scalar or a
        block), for nondecreasing ``starts`` with ``starts[lo] <= x``: ``steps`` halvings, at least
        ``ceil(log2(hi - lo))`` of them, each one load of ``starts``."""
        step = 0
        while step < steps:
            mid = (lo + hi) // 2
            below = tl.load(starts_ptr + mid) <= x
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
            step += 1
        return lo
