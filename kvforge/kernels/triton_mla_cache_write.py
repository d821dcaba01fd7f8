"""Triton kernel: write one step's MLA rows ``[latent | k_rope]`` into the paged latent cache.

Layout: :mod:`kvforge.attention.mla_reference` (``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]``, one row per token, no head axis). fp8
caches store ``saturate(x / scale)`` with one float32 per-tensor scale (NaN ->
0, +-inf and finite overflow -> +-fmax, round to nearest even), the same rule
as the PyTorch reference ``write_mla_cache``; model-dtype caches get a plain
cast. One program per token; ``slot_mapping`` entries of -1 are skipped;
addresses are int64. Unlike the reference, no host synchronization happens,
so the write can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import fp8_max
from kvforge.attention.fp8 import is_fp8 as is_fp8_dtype
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from kvforge.kernels.triton_cache_write import _saturate

    @triton.jit
    def _write_mla_kernel(
        latent_ptr,
        rope_ptr,
        cache_ptr,
        slot_ptr,
        scale_ptr,
        stride_lt,
        stride_rt,
        stride_cb,
        stride_cs,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        P: tl.constexpr,
        P_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        IS_FP8: tl.constexpr,
        FMAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        r = tl.arange(0, R_PAD)
        p = tl.arange(0, P_PAD)
        c = tl.load(latent_ptr + t * stride_lt + r, mask=r < R, other=0.0).to(tl.float32)
        kr = tl.load(rope_ptr + t * stride_rt + p, mask=p < P, other=0.0).to(tl.float32)
        if IS_FP8:
            inv = 1.0 / tl.load(scale_ptr)
            c = _saturate(c * inv, FMAX)
            kr = _saturate(kr * inv, FMAX)
        tl.store(dst + r, c.to(cache_ptr.dtype.element_ty), mask=r < R)
        tl.store(dst + R + p, kr.to(cache_ptr.dtype.element_ty), mask=p < P)


def write_mla_cache(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    scale: torch.Tensor | None = None) -> None:
    """Store rows ``[latent [T, R] | k_rope [T, P]]`` at ``slot_mapping`` (int64, -1 = skip).

    Tokens past ``slot_mapping``'s length are ignored. ``scale``: float32
    tensor of one element (fp8 caches only). Last axes must be contiguous.
    """
    if not HAS_TRITON:
        raise RuntimeError("write_mla_cache (triton) needs triton")
    if cache.dim() != 3:
        raise ValueError(f"MLA cache must be [num_blocks, block_size, R + P], got {tuple(cache.shape)}")
    n = int(slot_mapping.shape[0])
    _, bs, width = cache.shape
    r, p = latent.shape[-1], k_rope.shape[-1]
    if r + p != width:
        raise ValueError(f"latent {tuple(latent.shape)} + k_rope {tuple(k_rope.shape)} do not fill rows of {width}")
    if latent.shape[0] < n or k_rope.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but latent/k_rope have {latent.shape[0]}/{k_rope.shape[0]}")
    if latent.stride(-1) != 1 or k_rope.stride(-1) != 1 or cache.stride(2) != 1:
        raise ValueError("latent, k_rope and the cache need a contiguous last axis")
    if n == 0:
        return
    is_fp8 = is_fp8_dtype(cache.dtype)
    if is_fp8:
        if scale is None:
            raise ValueError("an fp8 MLA cache needs its per-tensor scale")
        if scale.numel() != 1:
            raise ValueError(f"MLA caches use one per-tensor scale, got shape {tuple(scale.shape)}")
        scale = scale.to(torch.float32).reshape(1)
    else:
        scale = slot_mapping  # unused placeholder
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    _write_mla_kernel[(n,)](
        latent, k_rope, cache, slot_mapping, scale,
        latent.stride(0), k_rope.stride(0), cache.stride(0), cache.stride(1),
        R=r, R_PAD=triton.next_power_of_2(r), P=p, P_PAD=triton.next_power_of_2(p), BLOCK_SIZE=bs,
        IS_FP8=is_fp8, FMAX=fp8_max(cache.dtype) if is_fp8 else 0.0, num_warps=4,
    )
