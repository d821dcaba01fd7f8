"""The paged K/V gather kernel (kvforge/kernels/triton_gather_kv.py) against a per-position torch reference.

The reference walks the positions one by one (block id = the sequence's ``pos // block_size``-th block,
row ``pos % block_size``), widens the stored value to float32, multiplies fp8 rows by their head's float32
scale and casts once to the output dtype: the exact arithmetic the kernel promises, so outputs are
compared bit for bit (float32 product, one correctly rounded cast). Under Triton's interpreter a
float32 -> bfloat16 cast truncates (``BF16_ROUNDING``), so bfloat16 outputs there may differ by one unit
in the last place and are compared within it.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import BF16_ROUNDING, DEVICE, INTERPRETED, requires_kernels

from kvforge.kernels.triton_gather_kv import gather_paged_kv

pytestmark = requires_kernels


def reference(cache, blocks, seq_len, heads, dtype, scales):
    bs = cache.shape[3]
    rows = []
    for pos in range(seq_len):
        blk = int(blocks[pos // bs])
        row = cache[blk, :, heads, pos % bs].to(torch.float32)  # [2, hc, D]
        if scales is not None:
            row = row * scales[:, :, None]
        rows.append(row.to(dtype))
    return torch.stack(rows)


def make_cache(num_blocks, hkv, bs, d, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((num_blocks, 2, hkv, bs, d), generator=g) * 3).to(cache_dtype).to(DEVICE)


@pytest.mark.parametrize(
    "cache_dtype,out_dtype,bs,d,seq_len,heads",
    [
        (torch.float8_e4m3fn, torch.float16, 16, 32, 37, slice(0, 3)),  # last block partly filled
        (torch.float8_e4m3fn, torch.bfloat16, 16, 32, 48, slice(1, 3)),  # a head subset starting past 0
        (torch.float8_e5m2, torch.float16, 32, 64, 50, slice(0, 2)),
        (torch.bfloat16, torch.bfloat16, 16, 32, 21, slice(2, 3)),  # same dtype: a copy
        (torch.float16, torch.bfloat16, 16, 16, 16, slice(0, 3)),
        (torch.float8_e4m3fn, torch.float16, 48, 80, 100, slice(0, 3)),  # block size and head size not powers of two
    ],
)
def test_gather_equals_the_per_position_reference(cache_dtype, out_dtype, bs, d, seq_len, heads):
    hkv = 3
    nblk = -(-seq_len // bs)
    cache = make_cache(nblk + 5, hkv, bs, d, cache_dtype, seed=seq_len)
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(nblk + 5, generator=g)[: nblk + 1].to(torch.int32).to(DEVICE)  # one spare id
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    hc = heads.stop - heads.start
    scales = (torch.rand((2, hc), generator=g) * 0.1 + 0.01).to(DEVICE) if fp8 else None
    got = gather_paged_kv(cache, blocks, seq_len, heads, out_dtype, scales)
    want = reference(cache, blocks, seq_len, heads, out_dtype, scales)
    assert got.shape == (seq_len, 2, hc, d) and got.dtype == out_dtype
    if INTERPRETED and out_dtype == torch.bfloat16 and (fp8 or cache_dtype != out_dtype):
        # BF16_ROUNDING: one unit in the last place (2^-7 relative) at most
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0), BF16_ROUNDING
    else:
        assert torch.equal(got, want)


def test_an_fp8_cache_needs_the_scales_of_the_gathered_heads():
    cache = make_cache(2, 2, 16, 16, torch.float8_e4m3fn, seed=0)
    blocks = torch.arange(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"scales of shape \(2, 1\)"):
        gather_paged_kv(cache, blocks, 20, slice(0, 1), torch.float16, torch.ones(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="fewer than the 40 positions"):
        gather_paged_kv(cache, blocks, 40, slice(0, 2), torch.float16, torch.ones(2, 2, device=DEVICE))
