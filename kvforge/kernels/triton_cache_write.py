"""Triton kernel: write one step's new K/V into the paged KV cache.

Layout and conventions: :mod:`kvforge.attention.metadata` (the contract) and
:mod:`kvforge.attention.fp8` (quantization). For fp8 caches the stored value is
``saturate(x / scale)`` cast with round-to-nearest-even, where saturation maps
finite overflow and ``±inf`` to ``±fmax`` and NaN to 0 (the same rule as
``kvforge.attention.fp8.quantize``, so the cache never holds NaN or inf).
Model-dtype caches (bf16/fp16/fp32) get a plain cast and ignore the scales.

One program per new token writes all KV heads of K and V for that token
(``Hkv x D`` elements each). Slots of -1 are skipped. Every address is
computed in int64 (slot, block id and strides), so any slot that fits in the
int64 ``slot_mapping`` is addressable.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import fp8_max
from kvforge.attention.fp8 import is_fp8 as is_fp8_dtype
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _saturate(x, FMAX: tl.constexpr):
        """float32 -> NaN becomes 0, then clamp (+-inf included) to +-FMAX: the cache never holds NaN/inf."""
        x = tl.where(x != x, 0.0, x)
        return tl.minimum(tl.maximum(x, -FMAX), FMAX)

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        NUM_KV_HEADS: tl.constexpr,
        HKV_PAD: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        IS_FP8: tl.constexpr,
        FMAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HKV_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_D)
        h64 = h.to(tl.int64)
        dst = cache_ptr + blk * stride_cb + off * stride_cs + h64[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h64[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h64[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if IS_FP8:
            ks = tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
            vs = tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
            kf = _saturate(k.to(tl.float32) / ks[:, None], FMAX)
            vf = _saturate(v.to(tl.float32) / vs[:, None], FMAX)
            tl.store(dst, kf.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + stride_ckv, vf.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def head_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int, is_fp8: bool,
                placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scales as the write kernels read them: float32, one per KV head (a per-tensor scale
    repeated) for fp8 caches; for other caches ``placeholder`` twice (never read)."""
    if not is_fp8:
        return placeholder, placeholder
    if k_scale is None or v_scale is None:
        raise ValueError("fp8 kv cache needs k_scale and v_scale")
    return (k_scale.to(torch.float32).reshape(-1).expand(num_kv_heads).contiguous(),
            v_scale.to(torch.float32).reshape(-1).expand(num_kv_heads).contiguous())


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Scatter ``k``/``v`` ([T, Hkv, D]) into ``kv_cache`` ([num_blocks, 2, Hkv, B, D]).

    ``slot_mapping`` (int64 [T]) gives each token's slot ``block * B + offset``;
    -1 skips the token. fp8 caches quantize on write with the per-KV-head
    float32 scales ``k_scale``/``v_scale`` ([Hkv]); other caches ignore them.
    ``k``/``v`` may be strided views (last dim contiguous).
    """
    if not HAS_TRITON:
        raise RuntimeError("write_kv_cache needs triton")
    T, hkv, d = k.shape
    if T == 0:
        return
    nb, two, c_hkv, bs, c_d = kv_cache.shape
    if two != 2 or c_hkv != hkv or c_d != d or v.shape != k.shape:
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)} v {tuple(v.shape)} cache {tuple(kv_cache.shape)}"
        )
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last (head_dim) axis")
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    is_fp8 = is_fp8_dtype(kv_cache.dtype)
    k_scale, v_scale = head_scales(k_scale, v_scale, hkv, is_fp8, placeholder=slot_mapping)
    _write_kv_kernel[(T,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=hkv,
        HKV_PAD=triton.next_power_of_2(hkv),
        HEAD_D=d,
        D_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=bs,
        IS_FP8=is_fp8,
        FMAX=fp8_max(kv_cache.dtype) if is_fp8 else 0.0,
        num_warps=4,
    )
