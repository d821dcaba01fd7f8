"""The tl.dot MLA decode kernel and the MLA cache write at small shapes: compiled on a GPU, in Triton's CPU
interpreter elsewhere (tests/triton_kernel_device.py). Latent widths 64 and 48 (padded to 64) with rope
widths 16 and 8 (padded to 16) keep every call on the tl.dot kernel on a GPU too (the wgmma kernels take
only R 512 / P 64); the DeepSeek widths and many heads are covered on the GPU by tests/test_triton_mla.py.

Oracle: the float64 formula over the cache rows read back and dequantized, written out here:
``s = softmax_scale * (q_latent . c + q_rope . k_rope)``, ``o = softmax(s) @ c``. Bounds, relative to
max|ref| (as in tests/test_triton_mla.py): 2**-6 for the model-dtype query (P rounded to 16 bits for the
P.C dot, the 16-bit output), 1e-5 for float32 (IEEE dots), 2**-4 for the e4m3 query (each query element
rounded to 3 mantissa bits). Outputs start as NaN and must be fully written; unused cache rows hold NaN
(fp8: the NaN byte) and must never be read.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import (
    BF16_DOT,
    DEVICE,
    FP8_ROUNDING,
    INTERPRETED,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels.triton_mla_cache_write import write_mla_cache
from kvforge.kernels.triton_mla_decode import mla_decode

pytestmark = requires_kernels

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SOFTMAX_SCALE = 0.3


def _paged_rows(lens, block_size, width, dtype, scale, gen):
    """A paged cache ``[num_blocks, block_size, width]`` whose token rows hold ``rows / scale`` in ``dtype``
    (torch's cast); every other row is NaN. Returns (cache, block tables, rows as stored, in float64)."""
    per = [-(-n // block_size) for n in lens]
    nblocks = sum(per) + 3
    perm = torch.randperm(nblocks, generator=gen)
    tables = torch.full((len(lens), max(per) + 1), 2**30, dtype=torch.int32)  # unused entries: junk ids
    cache = torch.full((nblocks, block_size, width), float("nan")).to(dtype)
    if dtype in FP8:
        cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and e5m2
    stored, at = [], 0
    for i, n in enumerate(lens):
        ids = perm[at : at + per[i]]
        at += per[i]
        tables[i, : per[i]] = ids.to(torch.int32)
        rows = torch.randn(n, width, generator=gen)
        rows[:, : width // 2] *= 0.5
        q = (rows / scale).to(dtype)
        pos = torch.arange(n)
        cache[ids[pos // block_size], pos % block_size] = q
        stored.append(q.double() * scale)
    return cache, tables, stored


def _reference(q_latent, q_rope, stored, r):
    """float64 absorbed MLA decode over the stored (dequantized) rows: ``[T, H, R]``."""
    out = []
    for t, rows in enumerate(stored):
        c, kr = rows[:, :r], rows[:, r:]
        s = SOFTMAX_SCALE * (q_latent[t].double() @ c.T + q_rope[t].double() @ kr.T)  # [H, n]
        out.append(torch.softmax(s, dim=-1) @ c)
    return torch.stack(out)


def _run(kv_dtype, q_dtype, heads, r, p, block_size, lens, splits, query_dtype=None, seed=0):
    skip_unless_loaded_loop_bounds_work()
    gen = torch.Generator().manual_seed(seed)
    scale = 0.0625 if kv_dtype in FP8 else 1.0
    cache, tables, stored = _paged_rows(lens, block_size, r + p, kv_dtype, scale, gen)
    b = len(lens)
    q_latent = (torch.randn(b, heads, r, generator=gen) * 0.5).to(q_dtype)
    q_rope = (torch.randn(b, heads, p, generator=gen) * 0.5).to(q_dtype)
    meta = AttentionMetadata(
        torch.arange(b + 1, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        tables.to(DEVICE),
        torch.full((b,), -1, dtype=torch.int64, device=DEVICE),
        1,
        max(lens),
        block_size,
    )
    out = torch.full((b + 1, heads, r), float("nan"), dtype=q_dtype, device=DEVICE)  # + 1 padding token
    scale_t = torch.tensor([scale], device=DEVICE) if kv_dtype in FP8 else None
    q_latent_pad = torch.cat([q_latent, q_latent[:1]]).to(DEVICE)
    q_rope_pad = torch.cat([q_rope, q_rope[:1]]).to(DEVICE)
    got = mla_decode(q_latent_pad, q_rope_pad, cache.to(DEVICE), meta, scale_t, SOFTMAX_SCALE,
                     query_dtype=query_dtype, num_splits=splits, out=out)  # fmt: skip
    assert got is out
    got = got.cpu()
    assert torch.isnan(got[b]).all(), "the padding token past the last sequence was written"
    got = got[:b]
    assert torch.isfinite(got).all(), "unwritten (NaN) or NaN-polluted outputs"
    want = _reference(q_latent, q_rope, stored, r)
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# (cache dtype, query dtype, bound)
DECODE_CASES = [
    pytest.param(torch.float16, torch.float16, 2.0**-6, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2.0**-6, id="bf16", marks=pytest.mark.skipif(INTERPRETED, reason=BF16_DOT)),
    pytest.param(torch.float32, torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.float16, torch.bfloat16, 2.0**-6, id="fp16-cache-bf16q"),  # float32 IEEE dots
    pytest.param(torch.float8_e4m3fn, torch.bfloat16, 2.0**-6, id="e4m3-bf16q"),
    pytest.param(torch.float8_e5m2, torch.float16, 2.0**-6, id="e5m2-fp16q"),
]
SHAPES = [pytest.param(3, 64, 16, 16, id="h3-r64-p16-block16"), pytest.param(5, 48, 8, 1, id="h5-r48-p8-block1")]


@pytest.mark.parametrize("kv_dtype,q_dtype,bound", DECODE_CASES)
@pytest.mark.parametrize("heads,r,p,block_size", SHAPES)
def test_small_mla_decode(kv_dtype, q_dtype, bound, heads, r, p, block_size):
    """Lengths 1, 15-17 and 70 (two 64-token tiles), one program per sequence (no split)."""
    err = _run(kv_dtype, q_dtype, heads, r, p, block_size, [1, 15, 16, 17, 70], 1, seed=heads + r)
    assert err <= bound, err


@pytest.mark.parametrize("kv_dtype,q_dtype,bound", [DECODE_CASES[0], DECODE_CASES[4]])
@pytest.mark.parametrize("splits", [2, 3])
def test_small_mla_decode_split_k_and_merge(kv_dtype, q_dtype, bound, splits):
    """Split-K over 64-token chunks (a 200-token context in up to 3 splits, shorter ones in fewer: the
    rest hold no token) merged by the paged-attention merge kernel."""
    err = _run(kv_dtype, q_dtype, 3, 64, 16, 16, [200, 9, 130, 1], splits, seed=splits)
    assert err <= bound, err


@pytest.mark.skipif(INTERPRETED, reason=FP8_ROUNDING)  # the query is quantized to e4m3 in the kernel
def test_small_mla_decode_e4m3_query():
    """The fp8 query regime on the tl.dot kernel (17 heads: above the 16 where the exact query serves; rope
    width 32, the fp8 dot's smallest reduction)."""
    err = _run(torch.float8_e4m3fn, torch.bfloat16, 17, 64, 32, 16, [1, 17, 70, 200], 2, query_dtype="fp8_e4m3")
    assert err <= 2.0**-4, err


def _on_grid(shape, dtype, gen, scale):
    """``scale`` (a power of two) times values of ``dtype``: the stored bytes do not depend on rounding."""
    return torch.randn(shape, generator=gen).to(dtype).float() * scale


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32],
    ids=["e4m3", "e5m2", "bf16", "fp16", "fp32"],
)
def test_small_mla_cache_write(kv_dtype):
    """Rows ``[latent | k_rope]`` land at their slots bitwise (values on the cache grid, R 48 / P 8 padded
    in registers); -1 slots and every other row keep their bytes; fp8 saturates 1e6 and +-inf to +-fmax
    and stores NaN as 0."""
    gen = torch.Generator().manual_seed(5)
    n, r, p, bs, nb = 13, 48, 8, 16, 3
    fp8 = kv_dtype in FP8
    scale = 0.25 if fp8 else 1.0
    latent, k_rope = _on_grid((n, r), kv_dtype, gen, scale), _on_grid((n, p), kv_dtype, gen, scale)
    if fp8:
        latent[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6])
    src = torch.bfloat16 if fp8 else torch.float32  # grid values x 0.25 are exact in bf16
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::4] = -1
    slots[0] = 5  # the row with the special values is written
    cache = torch.randn(nb, bs, r + p, generator=gen).to(kv_dtype)
    before = cache.clone()
    scale_t = torch.tensor([scale], device=DEVICE) if fp8 else None
    dev_cache = cache.to(DEVICE)
    write_mla_cache(latent.to(DEVICE, src), k_rope.to(DEVICE, src), dev_cache, slots.to(DEVICE), scale_t)
    expected = before.view(nb * bs, r + p).clone()
    keep = slots >= 0
    rows = torch.cat([latent, k_rope], dim=1)[keep].to(src).float() / scale
    if fp8:
        fmax = torch.finfo(kv_dtype).max
        rows = torch.nan_to_num(rows, nan=0.0).clamp(-fmax, fmax)
    expected[slots[keep]] = rows.to(kv_dtype)
    assert torch.equal(dev_cache.cpu().view(torch.uint8), expected.view(nb, bs, r + p).view(torch.uint8))
    if fp8:
        assert dev_cache.cpu().view(nb * bs, r + p)[5, :4].float().tolist() == [0.0, fmax, -fmax, fmax]


def test_absorbed_layer_entry_is_token_major_and_matches_the_formula():
    """The backend's decode entry (kvforge/attention/triton_mla.py, ``mla_attention`` of a decode step): the
    per-head products absorb ``w_uk`` into the query and ``w_uv`` into the output around the kernel. Its
    output must be the token-major ``[T, H, V]`` layout, contiguous (the output projection reshapes it
    without a copy), and equal the float64 formula ``o = w_uv softmax(s) c`` within the fp16 bound."""
    from kvforge.attention.triton_mla import mla_attention

    skip_unless_loaded_loop_bounds_work()
    gen = torch.Generator().manual_seed(11)
    heads, dn, r, p, v, block_size, lens = 3, 8, 64, 16, 12, 16, [1, 17, 70]
    cache, tables, stored = _paged_rows(lens, block_size, r + p, torch.float16, 1.0, gen)
    b = len(lens)
    q_nope = (torch.randn(b, heads, dn, generator=gen) * 0.5).to(torch.float16)
    q_rope = (torch.randn(b, heads, p, generator=gen) * 0.5).to(torch.float16)
    w_uk = (torch.randn(heads, dn, r, generator=gen) * 0.2).to(torch.float16)
    w_uv = (torch.randn(heads, v, r, generator=gen) * 0.2).to(torch.float16)
    meta = AttentionMetadata(torch.arange(b + 1, dtype=torch.int32, device=DEVICE),
                             torch.tensor(lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE),
                             torch.full((b,), -1, dtype=torch.int64, device=DEVICE), 1, max(lens), block_size)
    got = mla_attention(q_nope.to(DEVICE), q_rope.to(DEVICE), cache.to(DEVICE), meta, None, SOFTMAX_SCALE,
                        w_uk.to(DEVICE), w_uv.to(DEVICE), num_splits=1)
    assert got.shape == (b, heads, v) and got.is_contiguous()
    q_latent = torch.einsum("thd,hdr->thr", q_nope.double(), w_uk.double())
    want = torch.einsum("thr,hvr->thv", _reference(q_latent, q_rope, stored, r), w_uv.double())
    err = ((got.cpu().double() - want).abs().max() / want.abs().max()).item()
    assert err <= 2.0**-6, err
