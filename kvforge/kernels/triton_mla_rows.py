"""Triton kernel: a step's MLA rows made and stored in one launch: the latent's RMSNorm, rope on the
query's and the key's rope features, and the ``[latent | k_rope]`` row written into the latent cache.

It does what :func:`kvforge.kernels.triton_rms_norm.rms_norm` (the latent's ``kv_a_layernorm``),
:func:`kvforge.kernels.triton_rope.rope_qk_pairs` and
:func:`kvforge.kernels.triton_mla_cache_write.write_mla_cache` do one after the other, with the same
roundings: the normalized latent is rounded to the model dtype before the weight multiply and after it
(:mod:`kvforge.kernels.triton_rms_norm`'s rule), the rotated rope features to the model dtype
(:func:`kvforge.kernels.triton_rope.rotated_heads`), and fp8 caches store ``saturate(x / scale)``
(:mod:`kvforge.kernels.triton_mla_cache_write`'s rule). Only the sum of squares may differ from the
separate norm kernel (another reduction order), by an ulp of the rounded latent at most. The rotated
query's rope features come back (a new contiguous ``[T, H, P]`` tensor); the latent and the rotated key go
from registers to the cache. A slot of -1 skips the token's cache write, not its query (as do tokens past the
slot mapping's length).

Input: ``kv [T, R + P]``, the row ``kv_a_proj_with_mqa`` produced (the latent before its norm, then the key's
rope features), and ``q_rope [T, H, P]``; either may be a strided view of a fused product's output with a
contiguous last dimension. One program per token; int64 addresses; no host sync and only ``torch.empty``:
safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import fp8_max
from kvforge.attention.fp8 import is_fp8 as is_fp8_dtype
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kvforge.kernels.triton_cache_write import _saturate
    from kvforge.kernels.triton_rope import _rope_heads, angle_tables, rotated_heads

    @triton.jit
    def _mla_rows_kernel(
        q_ptr,
        kv_ptr,
        qo_ptr,
        norm_w_ptr,
        cache_ptr,
        slot_ptr,
        cos_ptr,
        sin_ptr,
        scale_ptr,
        stride_qt,
        stride_qh,
        stride_kvt,
        stride_qot,
        stride_qoh,
        stride_ct,
        stride_st,
        stride_cb,
        stride_cs,
        eps,
        N_SLOTS,
        HQ,
        HALF,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        HQ_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        IS_FP8: tl.constexpr,
        FMAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        c, s = angle_tables(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD)
        _rope_heads(q_ptr, qo_ptr, c, s, t, stride_qt, stride_qh, stride_qot, stride_qoh,
                    HQ, HALF, 2 * HALF, HQ_PAD, HALF_PAD, 0, INTERLEAVED)
        slot = tl.load(slot_ptr + t, mask=t < N_SLOTS, other=-1).to(tl.int64)
        if slot >= 0:
            ty = qo_ptr.dtype.element_ty
            r = tl.arange(0, R_PAD)
            mr = r < R
            x = tl.load(kv_ptr + t * stride_kvt + r, mask=mr, other=0.0).to(tl.float32)
            inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / R + eps)
            y = (x * inv_rms).to(ty).to(tl.float32)  # rounded before the weight, as the norm kernel does
            w = tl.load(norm_w_ptr + r, mask=mr, other=0.0).to(tl.float32)
            latent = (w * y).to(ty).to(tl.float32)
            lo, hi, _, j, m = rotated_heads(kv_ptr + R, c, s, t, stride_kvt, 0, 1, HALF, ty, 1, HALF_PAD,
                                            INTERLEAVED)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
            if IS_FP8:
                inv = 1.0 / tl.load(scale_ptr)
                latent = _saturate(latent * inv, FMAX)
                lo = _saturate(lo * inv, FMAX)
                hi = _saturate(hi * inv, FMAX)
            out_ty = cache_ptr.dtype.element_ty
            dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            tl.store(dst + r, latent.to(out_ty), mask=mr)
            tl.store(dst + R + j[None, :], lo.to(out_ty), mask=m)
            tl.store(dst + R + HALF + j[None, :], hi.to(out_ty), mask=m)


def norm_rope_write_mla(
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rotated ``q_rope`` ([T, H, P]); ``[RMSNorm(kv[:, :R]) | rope(kv[:, R:])]`` stored in ``cache``
    ([num_blocks, block_size, R + P]) at ``slot_mapping`` (int64; -1 skips a token, tokens past its length are
    not stored). ``cos``/``sin``: ``[T, 1,
    P / 2]`` or ``[T, P / 2]`` in q's dtype (:meth:`kvforge.models.deepseek.DeepseekRotary.cos_sin`);
    ``interleaved``: the pairs are ``(x[2j], x[2j + 1])`` (else ``(x[j], x[j + P / 2])``); ``scale``: the fp8
    cache's float32 per-tensor scale (one element)."""
    if not HAS_TRITON:
        raise RuntimeError("norm_rope_write_mla needs triton")
    if q_rope.dim() != 3 or kv.dim() != 2 or cache.dim() != 3:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} must be [T, H, P], kv {tuple(kv.shape)} [T, R + P] and "
                         f"the cache {tuple(cache.shape)} [num_blocks, block_size, R + P]")
    t, hq, p = q_rope.shape
    _, bs, width = cache.shape
    r = width - p
    if p % 2 or kv.shape != (t, width) or norm_weight.shape != (r,):
        raise ValueError(f"q_rope {tuple(q_rope.shape)}, kv {tuple(kv.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)} and cache rows of {width} do not fit one another "
                         "(an even rope width P, kv rows of R + P, a weight of R)")
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos2.shape != (t, p // 2) or sin2.shape != (t, p // 2):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match T={t}, P/2={p // 2}")
    if not (q_rope.dtype == kv.dtype == norm_weight.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"dtype mismatch: q_rope {q_rope.dtype} kv {kv.dtype} norm weight {norm_weight.dtype} "
                         f"cos {cos.dtype} sin {sin.dtype}")
    if any(x.stride(-1) != 1 for x in (q_rope, kv, norm_weight, cos2, sin2, cache)):
        raise ValueError("q_rope, kv, the norm weight, cos, sin and the cache need a contiguous last dimension")
    is_fp8 = is_fp8_dtype(cache.dtype)
    if is_fp8:
        if scale is None or scale.numel() != 1:
            raise ValueError("an fp8 MLA cache needs its one per-tensor scale")
        scale = scale.to(torch.float32).reshape(1)
    else:
        scale = slot_mapping  # unused placeholder
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    qo = torch.empty((t, hq, p), dtype=q_rope.dtype, device=q_rope.device)
    if t == 0:
        return qo
    _mla_rows_kernel[(t,)](
        q_rope, kv, qo, norm_weight, cache, slot_mapping, cos2, sin2, scale,
        q_rope.stride(0), q_rope.stride(1), kv.stride(0), qo.stride(0), qo.stride(1), cos2.stride(0),
        sin2.stride(0), cache.stride(0), cache.stride(1), float(eps), slot_mapping.shape[0], hq, p // 2,
        R=r, R_PAD=triton.next_power_of_2(r), HQ_PAD=triton.next_power_of_2(hq),
        HALF_PAD=triton.next_power_of_2(p // 2), BLOCK_SIZE=bs, INTERLEAVED=interleaved, IS_FP8=is_fp8,
        FMAX=fp8_max(cache.dtype) if is_fp8 else 0.0, num_warps=4,
    )  # fmt: skip
    return qo
