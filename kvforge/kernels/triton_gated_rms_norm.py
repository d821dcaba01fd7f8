"""Triton kernel: the gated RMSNorm of linear-attention outputs, ``weight * rms_norm(x) * act(gate)``, in one
launch (PyTorch takes ten: the casts, the square, the mean, the rsqrt, the products, the activation).

Numerics are those of :class:`kvforge.models.qwen3_next.GatedRMSNorm` step by step, so the result differs
from the PyTorch path only through the reduction order of ``mean(x^2)``, the hardware ``rsqrt`` and ``exp``:

* ``y = x_f32 * rsqrt(mean(x_f32^2) + eps)`` in float32;
* ``ROUND_NORMED`` (Qwen3-Next): ``y`` rounded to x's dtype, multiplied by the weight and rounded again (a
  product of two tensors of x's dtype, as torch computes it); otherwise (Kimi-Linear) ``weight_f32 * y``;
* ``out = normed * act(gate_f32)`` in float32 (``act``: sigmoid, or SiLU ``g * sigmoid(g)``), rounded once
  to x's dtype.

One program normalizes one row of ``D`` values (one token's head); rows of ``x`` and ``gate`` are addressed
through two strides each (kvforge/kernels/triton_rms_norm.py, ``_rows``), so ``[T, H, D]`` views of a fused
projection need no copy; the last dimension must be contiguous. No host synchronization: safe inside
CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton
from kvforge.kernels.triton_rms_norm import _rows

#: The activations the gate takes.
ACTIVATIONS = ("sigmoid", "silu")

if HAS_TRITON:

    @triton.jit
    def _gated_rms_norm_kernel(
        x_ptr, gate_ptr, w_ptr, out_ptr, INNER_X, INNER_G, D, eps,
        stride_x0, stride_x1, stride_g0, stride_g1,
        BLOCK_D: tl.constexpr, ROUND_NORMED: tl.constexpr, SILU: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        in_ty = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + (row // INNER_X) * stride_x0 + (row % INNER_X) * stride_x1 + cols, mask=mask,
                    other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_NORMED:
            normed = (w * y.to(in_ty).to(tl.float32)).to(in_ty).to(tl.float32)
        else:
            normed = w * y
        g = tl.load(gate_ptr + (row // INNER_G) * stride_g0 + (row % INNER_G) * stride_g1 + cols, mask=mask,
                    other=0.0).to(tl.float32)
        act = 1.0 / (1.0 + tl.exp(-g))
        if SILU:
            act = g * act
        tl.store(out_ptr + row * D + cols, (normed * act).to(in_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str,
                   round_normed: bool) -> torch.Tensor:
    """``weight * rms_norm(x) * act(gate)`` over the last dimension (the module docstring), a contiguous tensor
    of ``x``'s shape and dtype. ``x`` and ``gate``: the same shape, at most 3-D, the last dimension
    contiguous; ``weight``: ``[D]``; ``activation``: "sigmoid" or "silu"."""
    if not HAS_TRITON:
        raise RuntimeError("gated_rms_norm needs triton")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    d = x.shape[-1]
    if gate.shape != x.shape or x.dim() > 3:
        raise ValueError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must have one shape of at most 3 dims")
    if weight.shape != (d,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the normalized size {d}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, inner_x, sx0, sx1 = _rows(x, d)
    if rows == 0:
        return out
    _, inner_g, sg0, sg1 = _rows(gate, d)
    block_d = triton.next_power_of_2(d)
    _gated_rms_norm_kernel[(rows,)](
        x, gate, weight.contiguous(), out, inner_x, inner_g, d, float(eps), sx0, sx1, sg0, sg1,
        BLOCK_D=block_d, ROUND_NORMED=round_normed, SILU=activation == "silu",
        num_warps=4 if block_d <= 1024 else 8,
    )  # fmt: skip
    return out
