"""Triton kernel: one decode step of the short causal conv1d over per-sequence conv-state slots.

The convolution and its state are those of :mod:`kvforge.attention.causal_conv1d`: sequence ``i``
has one new token ``x[i] [D]``; its slot ``conv_states[slot_ids[i]] [W - 1, D]`` holds the
previous ``W - 1`` inputs, oldest first. The output is
``act(bias + sum_j weight[:, j] * state[j] + weight[:, W - 1] * x[i])`` and the slot is shifted
in place (row ``j`` <- row ``j + 1``, the last row <- ``x[i]``). ``slot_ids[i] < 0`` is a padding
row (skipped); ``has_initial_state[i]`` False reads zeros instead of the slot.

Grid ``(N, cdiv(D, BLOCK_D))``: a program owns one sequence's channel block, so the shift needs
no synchronisation (slot ids of a batch are distinct). No host sync, fixed shapes for fixed
``N``: capturable in a CUDA graph. Arithmetic in float32; the output has ``x``'s dtype.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU engine never imports this module's kernels.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

_BLOCK_D = 256


if HAS_TRITON:

    @triton.jit
    def _conv1d_decode_kernel(
        x_ptr, out_ptr, state_ptr, slot_ptr, init_ptr, w_ptr, bias_ptr,
        D, stride_x, stride_o, stride_ss, stride_sr, stride_w,
        WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        HAS_INIT_FLAGS: tl.constexpr,
    ):
        i = tl.program_id(0)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = ds < D
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if slot >= 0:
            keep = 1.0
            if HAS_INIT_FLAGS:
                keep = (tl.load(init_ptr + i) != 0).to(tl.float32)
            x = tl.load(x_ptr + i.to(tl.int64) * stride_x + ds, mask=dmask, other=0.0)
            acc = tl.load(w_ptr + ds * stride_w + (WIDTH - 1), mask=dmask, other=0.0).to(tl.float32) * x.to(tl.float32)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
            row_ptr = state_ptr + slot * stride_ss + ds
            prev = tl.load(row_ptr, mask=dmask, other=0.0).to(tl.float32) * keep
            for j in tl.static_range(WIDTH - 1):
                w = tl.load(w_ptr + ds * stride_w + j, mask=dmask, other=0.0).to(tl.float32)
                acc += w * prev
                if j < WIDTH - 2:  # shift: row j <- row j + 1 (exact: a value of the state's own dtype)
                    nxt = tl.load(row_ptr + (j + 1) * stride_sr, mask=dmask, other=0.0).to(tl.float32) * keep
                    tl.store(row_ptr + j * stride_sr, nxt.to(state_ptr.dtype.element_ty), mask=dmask)
                    prev = nxt
            tl.store(row_ptr + (WIDTH - 2) * stride_sr, x.to(state_ptr.dtype.element_ty), mask=dmask)
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + i.to(tl.int64) * stride_o + ds, acc.to(out_ptr.dtype.element_ty), mask=dmask)


def conv1d_decode(x: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, activation: str | None = "silu", *,
                  has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """``out [N, D]`` for one token per sequence; ``conv_states [slots, W - 1, D]`` shifted in place."""
    if not HAS_TRITON:
        raise RuntimeError("conv1d_decode needs triton")
    if activation not in ("silu", None):
        raise ValueError(f"causal conv1d activation {activation!r} is not supported; supported: silu, None")
    n, d = x.shape
    width = weight.shape[1]
    if weight.shape != (d, width) or width < 2:
        raise ValueError(f"weight must be [D, W] = [{d}, W >= 2], got {tuple(weight.shape)}")
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (width - 1, d) or conv_states.stride(2) != 1:
        raise ValueError(f"conv_states must be [slots, {width - 1}, {d}] with a contiguous last dim, "
                         f"got {tuple(conv_states.shape)}")
    if slot_ids.shape != (n,) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("want slot_ids [N] and x, weight with contiguous last dims")
    out = torch.empty_like(x)
    if n == 0:
        return out
    _conv1d_decode_kernel[(n, triton.cdiv(d, _BLOCK_D))](
        x, out, conv_states, slot_ids, has_initial_state if has_initial_state is not None else slot_ids,
        weight, bias if bias is not None else weight,
        d, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1), weight.stride(0),
        WIDTH=width, BLOCK_D=_BLOCK_D, HAS_BIAS=bias is not None, SILU=activation == "silu",
        HAS_INIT_FLAGS=has_initial_state is not None, num_warps=4,
    )
    return out
