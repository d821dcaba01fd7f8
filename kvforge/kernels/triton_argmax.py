"""Triton kernels: each row's argmax over a large vocabulary, spread over many programs.

Greedy decoding of a few rows reads a few hundred KB of logits, which one program per row (a row
reduction's usual grid) walks one slice after another, latency-bound. Here the first kernel gives each
``SLICE``-wide slice of a row its own program, which writes the slice's maximum and the index of its
first occurrence; the second reduces a row's slices in slice order. So the result is the first index of
the row's maximum, as ``torch.argmax`` gives it, for every finite or infinite value; a NaN counts as
``+inf`` here (``torch.argmax`` ranks NaN above ``+inf``).

:func:`row_argmax` is the entry; :func:`use_sliced_argmax` the rule for when it beats one program a row.
No host synchronization; allocations are ``torch.empty``.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: Values one program of the first kernel reduces.
SLICE = 4096
#: Rows at most, and values per row at least, for which the sliced kernels serve (few rows over a
#: vocabulary: a row's one program would walk it alone).
MAX_ROWS = 16
MIN_VOCAB = 4 * SLICE


if HAS_TRITON:

    @triton.jit
    def _slice_max_kernel(x_ptr, part_v_ptr, part_i_ptr, V, stride_x, NUM_SLICES, SLICE: tl.constexpr):
        row = tl.program_id(0)
        sl = tl.program_id(1)
        offs = sl * SLICE + tl.arange(0, SLICE)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN -> +inf
        v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(part_v_ptr + row * NUM_SLICES + sl, v)
        tl.store(part_i_ptr + row * NUM_SLICES + sl, (i + sl * SLICE).to(tl.int64))

    @triton.jit
    def _slices_argmax_kernel(part_v_ptr, part_i_ptr, out_ptr, NUM_SLICES, S_PAD: tl.constexpr):
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        v = tl.load(part_v_ptr + row * NUM_SLICES + s, mask=s < NUM_SLICES, other=float("-inf"))
        _, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(part_i_ptr + row * NUM_SLICES + j))


def use_sliced_argmax(x: torch.Tensor) -> bool:
    """Whether :func:`row_argmax` takes ``x`` (else ``torch.argmax``): a CUDA float tensor ``[N, V]`` with at
    most :data:`MAX_ROWS` rows of at least :data:`MIN_VOCAB` values, contiguous along V."""
    return (HAS_TRITON and x.device.type == "cuda" and x.dim() == 2 and x.dtype.is_floating_point
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] >= MIN_VOCAB and x.stride(1) == 1)  # fmt: skip


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the first index of each row's maximum of ``x [N, V]`` (module docstring)."""
    if not HAS_TRITON:
        raise RuntimeError("row_argmax needs triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"row_argmax takes [N, V] contiguous along V, got {tuple(x.shape)} strides {x.stride()}")
    n, v = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    if v == 0:
        raise ValueError("row_argmax of an empty row")
    slices = triton.cdiv(v, SLICE)
    part_v = torch.empty((n, slices), dtype=torch.float32, device=x.device)
    part_i = torch.empty((n, slices), dtype=torch.int64, device=x.device)
    _slice_max_kernel[(n, slices)](x, part_v, part_i, v, x.stride(0), slices, SLICE=SLICE, num_warps=4)
    _slices_argmax_kernel[(n,)](part_v, part_i, out, slices, S_PAD=max(2, triton.next_power_of_2(slices)),
                                num_warps=1)  # fmt: skip
    return out
