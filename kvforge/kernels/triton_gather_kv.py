"""Triton kernel: gather one sequence's K and V rows out of the paged cache into a contiguous tensor.

``gather_paged_kv`` reads positions ``0 .. seq_len - 1`` of a sequence (its block ids in order) for KV heads
``head_start .. head_start + num_heads - 1`` and writes ``[seq_len, 2, num_heads, D]`` in the output dtype:
the layout :mod:`kvforge.attention.paged_prefill_sdpa` hands to torch's fused attention. fp8 rows are
dequantized on the way: the stored byte widened to float32 (exact), times its KV head's float32 scale
(one rounding), then cast once to the output dtype with round-to-nearest-even, the same value as
``rows.to(float32) * scale`` followed by ``.to(dtype)`` in torch. Rows of another dtype are cast once.

One program copies one cache block of one (K or V, head) pair: ``BLOCK_SIZE x D`` elements read
contiguously, written as ``BLOCK_SIZE`` rows of ``D``; positions at or past ``seq_len`` (the last block's
tail) are not written. Block ids and row offsets are computed in int64.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import FP8_DTYPES
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

__all__ = ["gather_paged_kv"]

if HAS_TRITON:

    @triton.jit(do_not_specialize=["seq_len", "head_start"])
    def _gather_kv_kernel(
        cache_ptr,
        blocks_ptr,
        scale_ptr,
        out_ptr,
        seq_len,
        head_start,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        stride_ot,
        stride_okv,
        stride_oh,
        NUM_HEADS: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BS_PAD: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        b = tl.program_id(0)
        pair = tl.program_id(1)  # kv * NUM_HEADS + h
        kv = pair // NUM_HEADS
        h = pair % NUM_HEADS
        blk = tl.load(blocks_ptr + b).to(tl.int64)
        t = tl.arange(0, BS_PAD)
        d = tl.arange(0, D_PAD)
        pos = b.to(tl.int64) * BLOCK_SIZE + t
        mask = ((t < BLOCK_SIZE) & (pos < seq_len))[:, None] & (d < HEAD_D)[None, :]
        src = (cache_ptr + blk * stride_cb + kv.to(tl.int64) * stride_ckv + (head_start + h).to(tl.int64) * stride_ch
               + t.to(tl.int64)[:, None] * stride_cs + d[None, :])  # fmt: skip
        x = tl.load(src, mask=mask, other=0.0)
        if SCALED:
            x = x.to(tl.float32) * tl.load(scale_ptr + kv * NUM_HEADS + h)
        dst = out_ptr + pos[:, None] * stride_ot + kv.to(tl.int64) * stride_okv + h.to(tl.int64) * stride_oh + d[None, :]
        tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=mask)


def gather_paged_kv(kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, heads: slice, dtype: torch.dtype,
                    scales: torch.Tensor | None) -> torch.Tensor:
    """K and V of positions ``0 .. seq_len - 1`` and KV heads ``heads`` of a sequence whose cache blocks are
    ``blocks`` (int ``[>= ceil(seq_len / block_size)]``, in position order), as ``[seq_len, 2, heads, D]``
    in ``dtype``. ``kv_cache`` is ``[num_blocks, 2, Hkv, block_size, D]`` with a contiguous last axis;
    ``scales`` (float32 ``[2, heads]``: K and V scale of each gathered head) is required for fp8 caches and
    ignored otherwise."""
    if not HAS_TRITON:
        raise RuntimeError("gather_paged_kv needs triton")
    _, two, _, bs, d = kv_cache.shape
    if two != 2 or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache must be [num_blocks, 2, Hkv, block_size, D] with a contiguous D axis, got "
                         f"shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    hc = heads.stop - heads.start
    nblk = -(-seq_len // bs)
    if blocks.shape[0] < nblk:
        raise ValueError(f"{blocks.shape[0]} block ids cover fewer than the {seq_len} positions asked for")
    scaled = kv_cache.dtype in FP8_DTYPES
    if scaled:
        if scales is None or tuple(scales.shape) != (2, hc):
            raise ValueError(f"an fp8 cache needs float32 scales of shape (2, {hc}) for the gathered heads")
        scale_arg = scales.to(device=kv_cache.device, dtype=torch.float32).contiguous()
    else:
        scale_arg = blocks  # unused placeholder
    out = torch.empty((seq_len, 2, hc, d), dtype=dtype, device=kv_cache.device)
    if seq_len == 0 or hc == 0:
        return out
    _gather_kv_kernel[(nblk, 2 * hc)](
        kv_cache, blocks, scale_arg, out, seq_len, heads.start,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_HEADS=hc, HEAD_D=d, D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=bs,
        BS_PAD=triton.next_power_of_2(bs), SCALED=scaled,
    )  # fmt: skip
    return out
