"""Triton kernel: rope on q and k, and k and v written into the paged KV cache, in one launch.

It does what :func:`kvforge.kernels.triton_rope.rope_qk` followed by
:func:`kvforge.kernels.triton_cache_write.write_kv_cache` do, with the same values: q comes back rotated (a
new contiguous ``[T, Hq, D]`` tensor), and each token's rotated k, rounded to the activation dtype as
``rope_qk`` returns it, and its v are stored at the token's slot, quantized on the way for fp8 caches
(``saturate(x / scale)``, round to nearest even; NaN stored as 0, overflow and inf as +-fmax). The rotated
k is not returned: attention reads it from the cache. A slot of -1 skips the token's cache write, not its
q.

One program per token: the token's cos/sin row is read once for its q and k heads, and the rotated k
goes from registers to the cache without a round trip through memory. The rotation formula and its
rounding are :func:`kvforge.kernels.triton_rope.rotated_heads` (the module docstring there states them);
the quantization is :mod:`kvforge.kernels.triton_cache_write`'s. Addresses are int64; no host sync and
only ``torch.empty``: safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import fp8_max
from kvforge.attention.fp8 import is_fp8 as is_fp8_dtype
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton
from kvforge.kernels.triton_cache_write import head_scales

if HAS_TRITON:
    from kvforge.kernels.triton_cache_write import _saturate
    from kvforge.kernels.triton_rope import _rope_heads, angle_tables, rotated_heads

    @triton.jit
    def _cache_values(x, scale, out_ty: tl.constexpr, IS_FP8: tl.constexpr, FMAX: tl.constexpr):
        """``x`` ([heads, features]) as the cache stores it: over the per-head ``scale`` and saturated for
        fp8, a plain cast otherwise."""
        if IS_FP8:
            return _saturate(x.to(tl.float32) / scale[:, None], FMAX).to(out_ty)
        return x.to(out_ty)

    @triton.jit
    def _rope_write_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        qo_ptr,
        cache_ptr,
        slot_ptr,
        cos_ptr,
        sin_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_qot,
        stride_qoh,
        stride_ct,
        stride_st,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        HQ,
        HALF,
        HEAD_D: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HQ_PAD: tl.constexpr,
        HKV_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        TAIL_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        IS_FP8: tl.constexpr,
        FMAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        c, s = angle_tables(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD)
        _rope_heads(q_ptr, qo_ptr, c, s, t, stride_qt, stride_qh, stride_qot, stride_qoh,
                    HQ, HALF, HEAD_D, HQ_PAD, HALF_PAD, TAIL_PAD, False)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            out_ty = cache_ptr.dtype.element_ty
            lo, hi, h, j, m = rotated_heads(k_ptr, c, s, t, stride_kt, stride_kh, NUM_KV_HEADS, HALF,
                                            qo_ptr.dtype.element_ty, HKV_PAD, HALF_PAD, False)
            heads = h < NUM_KV_HEADS
            ks = tl.load(k_scale_ptr + h, mask=heads, other=1.0) if IS_FP8 else h
            vs = tl.load(v_scale_ptr + h, mask=heads, other=1.0) if IS_FP8 else h
            row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch
            tl.store(row + j[None, :], _cache_values(lo, ks, out_ty, IS_FP8, FMAX), mask=m)
            tl.store(row + HALF + j[None, :], _cache_values(hi, ks, out_ty, IS_FP8, FMAX), mask=m)
            if TAIL_PAD > 0:
                e = 2 * HALF + tl.arange(0, TAIL_PAD)
                mt = heads[:, None] & (e[None, :] < HEAD_D)
                tail = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + e[None, :], mask=mt, other=0.0)
                tl.store(row + e[None, :], _cache_values(tail, ks, out_ty, IS_FP8, FMAX), mask=mt)
            d = tl.arange(0, D_PAD)
            mv = heads[:, None] & (d[None, :] < HEAD_D)
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mv, other=0.0)
            tl.store(row + stride_ckv + d[None, :], _cache_values(v, vs, out_ty, IS_FP8, FMAX), mask=mv)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The rotated ``q`` ([T, Hq, D]); rotated ``k`` and ``v`` ([T, Hkv, D]) stored in ``kv_cache``
    ([num_blocks, 2, Hkv, B, D]) at ``slot_mapping`` (int64 [T], -1 skips). ``cos``/``sin``: ``[T, 1,
    rotary_dim]`` or ``[T, rotary_dim]`` in q's dtype (:meth:`kvforge.models.layers.RotaryEmbedding.cos_sin`);
    fp8 caches take the per-KV-head float32 scales. q, k and v may be strided views with a contiguous last
    dimension (e.g. of a fused q/k/v product's output)."""
    if not HAS_TRITON:
        raise RuntimeError("rope_and_write_kv needs triton")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, H, D] "
                         "with equal T and D, k and v of one shape")
    t, hq, d = q.shape
    hkv = k.shape[1]
    nb, two, c_hkv, bs, c_d = kv_cache.shape
    if two != 2 or c_hkv != hkv or c_d != d:
        raise ValueError(f"cache {tuple(kv_cache.shape)} does not hold k {tuple(k.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_dim {rotary_dim} must be even, positive and <= head_dim {d}")
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos2.shape != (t, rotary_dim) or sin2.shape != (t, rotary_dim):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match T={t}, rotary_dim={rotary_dim}")
    if not (q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype} k {k.dtype} v {v.dtype} cos {cos.dtype} sin {sin.dtype}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos2, sin2, kv_cache)):
        raise ValueError("q, k, v, cos, sin and the cache need a contiguous last dimension")
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    is_fp8 = is_fp8_dtype(kv_cache.dtype)
    k_scale, v_scale = head_scales(k_scale, v_scale, hkv, is_fp8, placeholder=slot_mapping)
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return qo
    half = rotary_dim // 2
    tail = d - rotary_dim
    hq_pad = triton.next_power_of_2(hq)
    _rope_write_kv_kernel[(t,)](
        q, k, v, qo, kv_cache, slot_mapping, cos2, sin2, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        qo.stride(0), qo.stride(1), cos2.stride(0), sin2.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        hq, half,
        HEAD_D=d,
        NUM_KV_HEADS=hkv,
        HQ_PAD=hq_pad,
        HKV_PAD=triton.next_power_of_2(hkv),
        HALF_PAD=triton.next_power_of_2(half),
        D_PAD=triton.next_power_of_2(d),
        TAIL_PAD=triton.next_power_of_2(tail) if tail else 0,
        BLOCK_SIZE=bs,
        IS_FP8=is_fp8,
        FMAX=fp8_max(kv_cache.dtype) if is_fp8 else 0.0,
        num_warps=4 if hq_pad * half <= 2048 else 8,
    )  # fmt: skip
    return qo
