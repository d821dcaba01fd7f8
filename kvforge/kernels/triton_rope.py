"""Triton kernel: NeoX-style (rotate-half) rope on q and k in one launch.

Layout: the one :class:`kvforge.models.layers.RotaryEmbedding` uses. Each
head's first ``rotary_dim`` features rotate as pairs ``(x[j], x[j + R/2])``
for ``j < R/2`` (``R = rotary_dim``); features ``[R:]`` pass through.
``cos``/``sin`` are the per-step tables from ``RotaryEmbedding.cos_sin``:
``[T, 1, R]`` (or ``[T, R]``) in the activation dtype, whose two halves are
equal (``cat(freqs, freqs)``); the kernel reads the first half.

Numerics reproduce ``x * cos + rotate_half(x) * sin`` as PyTorch evaluates it
in the activation dtype: each product is rounded to that dtype, then the sum
is rounded again::

    out[j]       = rnd(rnd(x[j] * c[j]) - rnd(x[j + R/2] * s[j]))
    out[j + R/2] = rnd(rnd(x[j + R/2] * c[j]) + rnd(x[j] * s[j]))

(the products of two bf16/fp16 values are exact in float32, so the rounded
products equal PyTorch's). On GPU, outputs still differ from PyTorch's by one
rounding step in some elements: measured on Llama-3.1-8B shapes (H200, Triton
3.6, bf16) 87% are bit-identical and the rest one ulp apart. The likely cause
(the PTX was not inspected) is the compiler fusing a product and the sum into
one FMA, which skips that product's rounding. Either way every output stays
within ``eps * (|a| + |b|)`` of the exact value for products ``a``, ``b``, as
PyTorch's does, so the two differ by at most ``2 * eps * (|a| + |b|)``. In the
interpreter the result is bit-identical.

:func:`rope_qk_pairs` is the same kernel for DeepSeek's rope features: half-width angle tables, and
optionally interleaved pairs ``(x[2j], x[2j + 1])`` whose rotations are stored de-interleaved (at ``j``
and ``j + R/2``), as DeepSeek's reference rotates them.

One program per token rotates every q head and every k head of that token
(two ``[heads, R/2]`` tiles), so q and k cost one launch. ``q`` ``[T, Hq, D]``
and ``k`` ``[T, Hk, D]`` may be strided views (e.g. of a fused qkv output)
with a contiguous last dim; outputs are new contiguous tensors and the inputs
are not modified. int64 offsets, no host sync, only ``torch.empty``: safe
inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def angle_tables(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD: tl.constexpr):
        """Token ``t``'s ``HALF`` cos and sin values as float32 ``[HALF_PAD]`` vectors (0 on the padding)."""
        j = tl.arange(0, HALF_PAD)
        c = tl.load(cos_ptr + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_st + j, mask=j < HALF, other=0.0).to(tl.float32)
        return c, s

    @triton.jit
    def rotated_heads(src_ptr, c, s, t, stride_st, stride_sh, H, HALF, ty: tl.constexpr,
                      H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
        """``(lo, hi, h, j, mask)``: the rotated pairs of the ``H`` heads of token ``t`` as ``[H_PAD, HALF_PAD]``
        tiles in ``ty`` (``lo`` is stored at feature ``j``, ``hi`` at ``j + HALF``), with the head and pair
        indices and the mask of real elements. The pairs are ``(x[j], x[j + HALF])``, or ``(x[2j], x[2j + 1])``
        when ``INTERLEAVED``; the numerics are the module docstring's."""
        h = tl.arange(0, H_PAD).to(tl.int64)
        j = tl.arange(0, HALF_PAD)
        m = (h[:, None] < H) & (j[None, :] < HALF)
        src_row = src_ptr + t * stride_st + h[:, None] * stride_sh
        if INTERLEAVED:
            x1 = tl.load(src_row + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src_row + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(src_row + j[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src_row + j[None, :] + HALF, mask=m, other=0.0).to(tl.float32)
        x1c = (x1 * c[None, :]).to(ty).to(tl.float32)
        x2s = (x2 * s[None, :]).to(ty).to(tl.float32)
        x2c = (x2 * c[None, :]).to(ty).to(tl.float32)
        x1s = (x1 * s[None, :]).to(ty).to(tl.float32)
        return (x1c - x2s).to(ty), (x2c + x1s).to(ty), h, j, m

    @triton.jit
    def _rope_heads(
        src_ptr,
        dst_ptr,
        c,
        s,
        t,
        stride_st,
        stride_sh,
        stride_dt,
        stride_dh,
        H,
        HALF,
        HEAD_D,
        H_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        TAIL_PAD: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        """Rotate all ``H`` heads of token ``t`` (:func:`rotated_heads`) into ``dst``; copy features
        ``[2 * HALF, HEAD_D)`` through."""
        ty = dst_ptr.dtype.element_ty
        lo, hi, h, j, m = rotated_heads(src_ptr, c, s, t, stride_st, stride_sh, H, HALF, ty, H_PAD, HALF_PAD,
                                        INTERLEAVED)
        dst = dst_ptr + t * stride_dt + h[:, None] * stride_dh + j[None, :]
        tl.store(dst, lo, mask=m)
        tl.store(dst + HALF, hi, mask=m)
        if TAIL_PAD > 0:
            e = 2 * HALF + tl.arange(0, TAIL_PAD)
            mt = (h[:, None] < H) & (e[None, :] < HEAD_D)
            tail = tl.load(src_ptr + t * stride_st + h[:, None] * stride_sh + e[None, :], mask=mt, other=0.0)
            tl.store(dst_ptr + t * stride_dt + h[:, None] * stride_dh + e[None, :], tail.to(ty), mask=mt)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr,
        k_ptr,
        qo_ptr,
        ko_ptr,
        cos_ptr,
        sin_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_qot,
        stride_qoh,
        stride_kot,
        stride_koh,
        stride_ct,
        stride_st,
        HQ,
        HK,
        HALF,
        HEAD_D,
        HQ_PAD: tl.constexpr,
        HK_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        TAIL_PAD: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        c, s = angle_tables(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD)
        _rope_heads(q_ptr, qo_ptr, c, s, t, stride_qt, stride_qh, stride_qot, stride_qoh,
                    HQ, HALF, HEAD_D, HQ_PAD, HALF_PAD, TAIL_PAD, INTERLEAVED)
        _rope_heads(k_ptr, ko_ptr, c, s, t, stride_kt, stride_kh, stride_kot, stride_koh,
                    HK, HALF, HEAD_D, HK_PAD, HALF_PAD, TAIL_PAD, INTERLEAVED)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (see module docstring).

    ``cos``/``sin``: ``[T, 1, rotary_dim]`` or ``[T, rotary_dim]``, same dtype
    as ``q`` and ``k``, contiguous along the feature axis.
    """
    return _launch(q, k, cos, sin, rotary_dim, rotary_dim, interleaved=False)


def rope_qk_pairs(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope over every feature of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` with half-width tables ``cos``/``sin``
    (``[T, 1, D / 2]`` or ``[T, D / 2]``: one angle per pair) and the pairs ``(x[2j], x[2j + 1])`` when
    ``interleaved``, else ``(x[j], x[j + D / 2])``; the rotated pair ``j`` lands at ``j`` and ``j + D / 2``
    (de-interleaved: DeepSeek's layout). Same numerics as :func:`rope_qk`."""
    d = q.shape[-1]
    return _launch(q, k, cos, sin, d, d // 2, interleaved=interleaved)


def _launch(q, k, cos, sin, rotary_dim: int, table_width: int, interleaved: bool):
    if not HAS_TRITON:
        raise RuntimeError("rope_qk needs triton")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] with equal T and D")
    t, hq, d = q.shape
    hk = k.shape[1]
    if rotary_dim % 2 or rotary_dim > d or rotary_dim <= 0:
        raise ValueError(f"rotary_dim {rotary_dim} must be even, positive and <= head_dim {d}")
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos2.shape != (t, table_width) or sin2.shape != (t, table_width):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match T={t}, {table_width} angles per token")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype} k {k.dtype} cos {cos.dtype} sin {sin.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos2.stride(1) != 1 or sin2.stride(1) != 1:
        raise ValueError("q, k, cos and sin need a contiguous last dimension")
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    half = rotary_dim // 2
    tail = d - rotary_dim
    hq_pad = triton.next_power_of_2(hq)
    _rope_qk_kernel[(t,)](
        q,
        k,
        qo,
        ko,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        qo.stride(0),
        qo.stride(1),
        ko.stride(0),
        ko.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        hq,
        hk,
        half,
        d,
        HQ_PAD=hq_pad,
        HK_PAD=triton.next_power_of_2(hk),
        HALF_PAD=triton.next_power_of_2(half),
        TAIL_PAD=triton.next_power_of_2(tail) if tail else 0,
        INTERLEAVED=interleaved,
        num_warps=4 if hq_pad * half <= 2048 else 8,
    )
    return qo, ko
