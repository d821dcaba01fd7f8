"""Triton kernel: RMSNorm, optionally fused with the residual add before it.

Numerics are those of :meth:`kvforge.models.layers.RMSNorm.forward` (the HF
Llama convention), reproduced step by step so the result differs from the
PyTorch path only through the reduction order of ``mean(x^2)`` and the
hardware ``rsqrt``:

* residual (fused form only): ``s = x + residual`` computed in float32 and
  rounded once to the input dtype (round-to-nearest-even), which is exactly
  what torch's bf16/fp16 add does; ``s`` is written out as the new residual and
  is the value that gets normalized;
* ``y = s_f32 * rsqrt(mean(s_f32^2) + eps)`` in float32, rounded to the input
  dtype *before* the weight multiply;
* ``out = weight * y`` computed in float32 and rounded to the output dtype
  (``torch.promote_types(weight.dtype, x.dtype)``, as torch's ``*`` gives).

The zero-centred form (``zero_centred=True``; Gemma, Qwen3-Next:
:class:`kvforge.models.gemma3.GemmaRMSNorm`) keeps ``y`` in float32 and rounds
once: ``out = (y * (1 + weight_f32)).to(x.dtype)``.

One program normalizes one row (one token, or one token's head for per-head
norms) over a single tile of ``next_power_of_2(N)`` columns, masked to ``N``,
so any hidden size works. Rows are addressed through two strides (an outer
and an inner row index), so strided 2-D rows and ``[T, H, D]`` head views of a
fused projection work without a copy; the last dimension must be contiguous.
Offsets are int64. No host synchronization, only ``torch.empty`` allocations:
safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        out_ptr,
        res_out_ptr,
        w_ptr,
        INNER,
        N,
        eps,
        stride_x0,
        stride_x1,
        stride_r0,
        stride_r1,
        stride_o0,
        stride_o1,
        stride_s0,
        stride_s1,
        BLOCK_N: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        ZERO_CENTRED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        r0 = row // INNER
        r1 = row % INNER
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        in_ty = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + r0 * stride_r0 + r1 * stride_r1 + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)  # one rounding, as torch's add
            tl.store(res_out_ptr + r0 * stride_s0 + r1 * stride_s1 + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            out = xf * inv * (1.0 + w)  # float32 throughout, one rounding (Gemma)
        else:
            out = w * (xf * inv).to(in_ty).to(tl.float32)  # cast back BEFORE the weight (HF Llama)
        tl.store(out_ptr + r0 * stride_o0 + r1 * stride_o1 + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> tuple[int, int, int, int]:
    """``(rows, inner, outer stride, inner stride)`` addressing every length-``n`` row of ``t``.

    2-D (or 1-D) tensors have ``inner == 1``; 3-D tensors index rows as
    ``(i // inner, i % inner)``. Higher ranks must be reshapeable to 3-D as a view.
    """
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError("rms_norm needs a contiguous last dimension")
    if t.dim() == 1:
        return 1, 1, n, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() > 3:
        t = t.view(-1, t.shape[-2], n)
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def _num_warps(block_n: int) -> int:
    return 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)


def _launch(x, residual, weight, eps, zero_centred):
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    weight = weight.contiguous()
    out_dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    rows, inner, sx0, sx1 = _rows(x, n)
    if rows == 0:
        return out, res_out
    _, _, so0, so1 = _rows(out, n)
    if residual is not None:
        _, _, sr0, sr1 = _rows(residual, n)
        _, _, ss0, ss1 = _rows(res_out, n)
    else:
        sr0 = sr1 = ss0 = ss1 = 0
    block_n = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        out,
        res_out if res_out is not None else out,
        weight,
        inner,
        n,
        float(eps),
        sx0,
        sx1,
        sr0,
        sr1,
        so0,
        so1,
        ss0,
        ss1,
        BLOCK_N=block_n,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTRED=zero_centred,
        num_warps=_num_warps(block_n),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim (float32 math).

    ``x``: ``[..., N]`` with a contiguous last dim (rows may be strided; up to
    two leading row dims without a copy). ``weight``: ``[N]``. Returns a new
    contiguous tensor of dtype ``promote_types(weight.dtype, x.dtype)``; with
    ``zero_centred``, ``(x / sqrt(mean(x^2) + eps) * (1 + weight))`` in float32
    rounded once to ``x.dtype``.
    """
    if not HAS_TRITON:
        raise RuntimeError("rms_norm needs triton")
    return _launch(x, None, weight, eps, zero_centred)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s, weight, eps, zero_centred), s)`` with ``s = x + residual`` rounded to ``x.dtype``.

    ``x`` and ``residual`` have the same shape and dtype (the model dtype);
    both outputs are new contiguous tensors (inputs are not modified).
    """
    if not HAS_TRITON:
        raise RuntimeError("fused_add_rms_norm needs triton")
    return _launch(x, residual, weight, eps, zero_centred)
