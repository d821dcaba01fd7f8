"""Triton kernel: ``silu(gate) * up`` on the fused ``gate_up_proj`` output.

Input ``[T, 2 * I]``: columns ``[:I]`` are the gate, ``[I:]`` the up
projection (the layout of :class:`kvforge.models.layers.GatedMLP`). Output
``[T, I]``, contiguous, in the input dtype.

Numerics reproduce ``F.silu(gate) * up`` as PyTorch evaluates it in a reduced
dtype: ``silu(g) = g / (1 + exp(-g))`` in float32, rounded to the model dtype,
then the product in float32 rounded once more. The only differences from the
PyTorch path come from the hardware ``exp`` and division (a few float32 ulps),
which can move a result by at most one model-dtype rounding step.

Grid ``(T, cdiv(I, BLOCK))``: tokens on the first axis (no 65535 limit), one
contiguous column block per program. Rows may be strided (last dim
contiguous); offsets are int64. No host sync, only ``torch.empty``: safe
inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

_BLOCK = 1024


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(in_ptr, out_ptr, INTER, stride_in, stride_out, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        ty = out_ptr.dtype.element_ty
        src = in_ptr + t * stride_in + cols
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + INTER, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # F.silu rounds to the model dtype
        tl.store(out_ptr + t * stride_out + cols, (act * u).to(ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up [T, 2I]`` (see module docstring)."""
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul needs triton")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul wants [T, 2*I], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        raise ValueError("silu_and_mul needs a contiguous last dimension")
    t, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or i == 0:
        return out
    _silu_and_mul_kernel[(t, triton.cdiv(i, _BLOCK))](
        gate_up, out, i, gate_up.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4
    )
    return out
