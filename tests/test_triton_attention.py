"""GPU tests for the Triton paged-attention and KV-cache-write kernels.

Oracle: a float64 torch computation over the *dequantized* cache (the stored
fp8/bf16 values read back and multiplied by their scales), so the test checks
the kernel's arithmetic, not the fp8 rounding of K/V (that is tested by
tests/test_fp8.py for the quantizer).

Error bound: ``||out - ref||_F / ||ref||_F <= 2e-2``. Why: the kernel feeds
the tensor cores bf16 (or fp16) operands: the query (already bf16), the K/V
values upcast from the cache (exact for bf16, e4m3 and e5m2: their values are
all representable in bf16), and the softmax probabilities P, which are rounded
to bf16 before the P.V product (relative error 2^-9 per element). The output
itself is rounded to bf16 (another 2^-9 relative). Accumulation is fp32.
Rounding errors of random sign add in quadrature, so the Frobenius relative
error lands around 2^-9 * small constant ~ 3e-3..6e-3 in practice; 2e-2
leaves margin for long contexts (33k keys) without hiding real bugs (a wrong
block, a missed key, a wrong scale or an unwritten row gives errors of order
1e-1..1). fp16 queries: the same bound (fp16 has more mantissa). fp32 caches
with fp32 queries use IEEE fp32 dots: bound 1e-4.

Every output is pre-filled with NaN and checked to be fully written (no NaN
survives), inputs are fresh random normals (never zeros), block tables are
random permutations (non-contiguous, shuffled), and batches hold several
sequences.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

# KVFORGE_TRITON_TEST_DEVICE=cpu together with TRITON_INTERPRET=1 runs the
# kernels in Triton's CPU interpreter (slow; for logic checks of small cases).
DEV = os.environ.get("KVFORGE_TRITON_TEST_DEVICE", "cuda")
if DEV == "cuda" and not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.kernels.gluon_support import gluon_runs_on  # noqa: E402
from kvforge.kernels.triton_cache_write import write_kv_cache  # noqa: E402
from kvforge.kernels.triton_paged_attention import _LAST_LAUNCH, paged_attention  # noqa: E402

pytestmark = pytest.mark.gpu

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
REL_TOL_BF16 = 2e-2


# ----------------------------------------------------------------- helpers
def make_batch(
    seq_lens,
    query_lens,
    num_kv_heads,
    head_dim,
    block_size,
    kv_dtype,
    gen,
    spare_blocks=7,
    scale_range=(0.5, 2.0),
    src_dtype=torch.bfloat16,
    nan_junk=False,
):
    """A random paged cache holding each sequence's full context + metadata.

    ``nan_junk``: unwritten fp8 slots (page tails past a context end, spare blocks) hold NaN bytes
    instead of finite junk, so a kernel that lets one masked-off byte reach ``P V`` fails.

    The whole context (including the new tokens) is written through
    write_kv_cache, as the engine does before calling attention. Block ids are
    a random permutation, so tables are non-contiguous and shuffled.
    """
    n = len(seq_lens)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 3
    # unused table entries are arbitrary: fill with garbage (large ids)
    block_tables = torch.full((n, max_blocks), 2**30, dtype=torch.int32)
    slots = []
    used = 0
    for i, s in enumerate(seq_lens):
        ids = perm[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, : len(ids)] = ids.to(torch.int32)
        pos = torch.arange(s)
        slots.append(ids[pos // block_size].to(torch.int64) * block_size + pos % block_size)
    kv_cache = torch.empty((num_blocks, 2, num_kv_heads, block_size, head_dim), dtype=kv_dtype, device=DEV)
    # poison the cache with random junk of the storage dtype (not NaN: unused
    # slots must not be read, a NaN would show it, but junk is fine to have)
    kv_cache.view(torch.uint8).random_(0, 256, generator=None)
    if kv_dtype in FP8_MAX and nan_junk:
        kv_cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and in e5m2
    elif kv_dtype in FP8_MAX:
        # random bytes can be NaN in fp8; replace by a finite junk value
        junk = torch.full_like(kv_cache, 3.0)
        kv_cache.copy_(
            torch.where(torch.isnan(kv_cache.float()), junk.float(), kv_cache.float()).to(kv_dtype)
        )
    else:
        kv_cache.copy_(
            torch.nan_to_num(kv_cache.float(), nan=3.0, posinf=3.0, neginf=-3.0).clamp(-8, 8).to(kv_dtype)
        )
    lo, hi = scale_range
    k_scale = (torch.rand(num_kv_heads, generator=gen) * (hi - lo) + lo).to(DEV)
    v_scale = (torch.rand(num_kv_heads, generator=gen) * (hi - lo) + lo).to(DEV)
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEV)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(DEV)
    slot_all = torch.cat(slots).to(DEV)
    if kv_dtype in FP8_MAX:
        k = k * k_scale[None, :, None] * 2
        v = v * v_scale[None, :, None] * 2
    write_kv_cache(k.to(src_dtype), v.to(src_dtype), kv_cache, slot_all, k_scale, v_scale)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    new_slots = torch.cat([sl[s - ql :] for sl, s, ql in zip(slots, seq_lens, query_lens)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=block_tables.to(DEV),
        slot_mapping=new_slots.to(DEV),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return kv_cache, meta, k_scale, v_scale


def dequant_context(kv_cache, meta, seq, k_scale, v_scale):
    """[S, Hkv, D] float64 K and V of one sequence, read back from the cache."""
    s = int(meta.seq_lens[seq])
    bs = meta.block_size
    pos = torch.arange(s, device=DEV)
    blk = meta.block_tables[seq, pos // bs].long()
    off = pos % bs
    k = kv_cache[blk, 0, :, off, :].double()  # [S, Hkv, D]
    v = kv_cache[blk, 1, :, off, :].double()
    if kv_cache.dtype in FP8_MAX:
        k = k * k_scale.double()[None, :, None]
        v = v * v_scale.double()[None, :, None]
    return k, v


def reference(q, kv_cache, meta, k_scale, v_scale, softmax_scale, window=None):
    """float64 causal paged attention over the dequantized cache."""
    T, hq, d = q.shape
    out = torch.full((T, hq, d), float("nan"), dtype=torch.float64, device=DEV)
    qsl = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        k, v = dequant_context(kv_cache, meta, i, k_scale, v_scale)
        hkv = k.shape[1]
        g = hq // hkv
        k = k.repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(g, dim=1)
        S = k.shape[0]
        qi = q[a:b].double()  # [L, Hq, D]
        L = b - a
        scores = torch.einsum("lhd,shd->hls", qi, k) * softmax_scale
        qpos = torch.arange(S - L, S, device=DEV)[:, None]
        kpos = torch.arange(S, device=DEV)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hls,shd->lhd", p, v)
    return out


def rel_err(out, ref):
    return (torch.linalg.norm((out.double() - ref).flatten()) / torch.linalg.norm(ref.flatten())).item()


def run_case(
    seq_lens,
    query_lens,
    hq,
    hkv,
    d,
    kv_dtype,
    block_size=16,
    window=None,
    q_dtype=torch.bfloat16,
    seed=0,
    num_splits=None,
    tol=REL_TOL_BF16,
    config=None,
    expect_kernel=None,
    scale_range=(0.5, 2.0),
    nan_junk=False,
):
    gen = torch.Generator().manual_seed(seed)
    kv_cache, meta, ks, vs = make_batch(
        seq_lens,
        query_lens,
        hkv,
        d,
        block_size,
        kv_dtype,
        gen,
        src_dtype=q_dtype,
        scale_range=scale_range,
        nan_junk=nan_junk,
    )
    T = sum(query_lens)
    q = torch.randn(T, hq, d, generator=gen).to(DEV, q_dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    res = paged_attention(
        q,
        kv_cache,
        meta,
        ks,
        vs,
        scale,
        sliding_window=window,
        out=out,
        num_splits=num_splits,
        _config=config,
    )
    if expect_kernel is not None:
        if expect_kernel != TL_DOT and not gluon_runs_on(q):
            pytest.skip("Gluon kernels are gated off here (kvforge/kernels/gluon_support.py)")
        launched = _LAST_LAUNCH["attn"]
        if launched is not None:  # None under TRITON_INTERPRET (nothing is compiled)
            assert launched.name == expect_kernel
    assert res.data_ptr() == out.data_ptr()
    assert out.dtype == q_dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) outputs remain"
    ref = reference(q, kv_cache, meta, ks, vs, scale, window)
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.3e} >= {tol}"
    return err


KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
KV_IDS = ["bf16", "e4m3", "e5m2"]


# ----------------------------------------------------------------- decode
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (16, 4), (32, 4), (9, 3)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_lengths(kv_dtype, hq, hkv, d):
    seq_lens = [1, 15, 16, 17, 1000, 77]
    run_case(seq_lens, [1] * len(seq_lens), hq, hkv, d, kv_dtype, seed=hq * 1000 + d)


GLUON = "_gluon_fp8_decode_warp_kernel"
GLUON_CTA = "_gluon_fp8_decode_kernel"
TL_DOT = "_paged_attn_kernel"


PATHS = {
    "gluon-warp": (dict(gluon_variant="warp"), GLUON),
    "gluon-cta": (dict(gluon_variant="cta"), GLUON_CTA),
    "tl.dot": (dict(gluon=False), TL_DOT),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 4), (32, 2), (12, 4)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_decode_every_path(path, kv_dtype, hq, hkv, d):
    """fp8 decode goes to a Gluon kernel (GQA <= 16, head 64/128/256; which one by
    ``choose_variant_and_splits``); the tl.dot kernel stays as the fallback. Each path against
    the float64 reference, with the path asserted."""
    seq_lens = [1, 15, 16, 17, 1000, 77, 4100]
    config, kernel = PATHS[path]
    run_case(
        seq_lens,
        [1] * len(seq_lens),
        hq,
        hkv,
        d,
        kv_dtype,
        seed=hq * 100 + d,
        config=config,
        expect_kernel=kernel,
    )


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_fp8_decode_empty_query_sequences(path, splits):
    """Sequences with no new token in a decode batch (max_query_len 1), the last one included:
    nothing is written for them and nothing past the last token is touched."""
    config, kernel = PATHS[path]
    run_case([5, 300, 20, 2100, 40], [1, 0, 1, 1, 0], 16, 4, 128, torch.float8_e4m3fn, seed=4,
             num_splits=splits, config=config, expect_kernel=kernel)  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_decode_nan_in_unwritten_slots(path, kv_dtype):
    """Page tails and spare blocks full of fp8 NaN bytes: masked-off bytes must never reach P V."""
    config, kernel = PATHS[path]
    run_case([1, 15, 17, 1000, 4100], [1] * 5, 32, 8, 128, kv_dtype, seed=8, config=config,
             expect_kernel=kernel, nan_junk=True)  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
def test_fp8_decode_calibrated_e5m2_scales(path):
    """Scales of a calibrated e5m2 cache (~amax / 57344): the scale must multiply float32 scores,
    not an fp16 query (which would fall into fp16 subnormals)."""
    config, kernel = PATHS[path]
    run_case([17, 1000, 4100], [1] * 3, 32, 8, 128, torch.float8_e5m2, seed=9, config=config,
             expect_kernel=kernel, scale_range=(1e-4, 3e-4))  # fmt: skip


@pytest.mark.parametrize("window", [16, 100, 4096])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_warp_window_and_no_split(window, splits):
    """The warp kernel with a sliding window, and without split-K (its direct-output epilogue)."""
    run_case([1, 17, 1000, 5000, 300], [1] * 5, 16, 4, 128, torch.float8_e4m3fn, window=window, seed=window,
             num_splits=splits, config=dict(gluon_variant="warp"), expect_kernel=GLUON)  # fmt: skip


@pytest.mark.parametrize("path", ["gluon-warp", "gluon-cta"])
def test_fp8_decode_fp16_query(path):
    config, kernel = PATHS[path]
    run_case([1, 17, 1000, 3000], [1] * 4, 16, 4, 128, torch.float8_e5m2, q_dtype=torch.float16, seed=10,
             config=config, expect_kernel=kernel)  # fmt: skip


def test_fp8_decode_default_is_gluon():
    run_case([1, 4100], [1, 1], 32, 8, 128, torch.float8_e4m3fn, seed=1, expect_kernel=GLUON_CTA)
    run_case([9000] * 40, [1] * 40, 32, 8, 128, torch.float8_e4m3fn, seed=2, expect_kernel=GLUON)


GLUON_CONFIGS = {
    "warp16": dict(gluon_variant="warp", gluon_wt=16),
    "warp16-vstaged": dict(gluon_variant="warp", gluon_wt=16, gluon_v_mode=2),
    "warp32x2": dict(gluon_variant="warp", gluon_wt=32, gluon_stages=2),
    "warp16w8": dict(gluon_variant="warp", gluon_wt=16, gluon_warps=8, gluon_stages=4),
    "cta64": dict(gluon_variant="cta", gluon_tile_n=64),
    "cta128": dict(gluon_variant="cta", gluon_tile_n=128, gluon_stages=2),
}


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("cfg", list(GLUON_CONFIGS))
def test_fp8_decode_gluon_block_sizes_and_tiles(block_size, cfg):
    """Pages that straddle tiles (48 vs 64), pages larger than a tile, every tiling."""
    seq_lens = [1, 15, 16, 17, 1000, 130, 2049]
    run_case(
        seq_lens,
        [1] * len(seq_lens),
        16,
        2,
        128,
        torch.float8_e4m3fn,
        block_size=block_size,
        seed=block_size,
        config=GLUON_CONFIGS[cfg],
        expect_kernel=GLUON_CTA if cfg.startswith("cta") else GLUON,
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_decode_33k(kv_dtype):
    seq_lens = [33000, 5, 16, 1000]
    run_case(seq_lens, [1] * 4, 32, 8, 128, kv_dtype, seed=7)


@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_decode_forced_splits(splits):
    seq_lens = [1, 17, 300, 2049]
    run_case(seq_lens, [1] * 4, 16, 2, 128, torch.float8_e4m3fn, num_splits=splits, seed=splits)


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
def test_block_sizes(block_size):
    seq_lens = [1, 15, 16, 17, 1000, 130]
    run_case(seq_lens, [1] * 6, 8, 2, 128, torch.bfloat16, block_size=block_size, seed=block_size)
    run_case(
        seq_lens,
        [1, 15, 5, 17, 200, 1],
        8,
        2,
        128,
        torch.float8_e4m3fn,
        block_size=block_size,
        seed=block_size,
    )


@pytest.mark.parametrize("d", [32, 80, 96, 192])
def test_other_head_sizes(d):
    run_case([1, 17, 400], [1, 1, 1], 8, 2, d, torch.bfloat16, seed=d)
    run_case([19, 17, 400], [19, 3, 128], 8, 2, d, torch.float8_e4m3fn, seed=d)


def test_gqa_16():
    run_case([1, 17, 1000], [1, 1, 1], 32, 2, 128, torch.bfloat16, seed=16)
    run_case([40, 17, 1000], [40, 1, 100], 32, 2, 128, torch.bfloat16, seed=16)


# ----------------------------------------------------------------- prefill / mixed
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (16, 4), (32, 4), (9, 3)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_mixed_prefill_decode(kv_dtype, hq, hkv, d):
    # seq 0: fresh prefill; seq 1: chunked prefill with prior context;
    # seq 2/3: decode; seq 4: prefix-cache hit (long context, short query);
    # seq 5: empty query (no tokens this step)
    seq_lens = [37, 300, 1, 1000, 515, 20]
    query_lens = [37, 128, 1, 1, 3, 0]
    run_case(seq_lens, query_lens, hq, hkv, d, kv_dtype, seed=hq + d)


def test_prefill_long_context():
    # chunked prefill: 512 new tokens after 32.5k tokens of cached context
    run_case([33000, 200], [512, 200], 32, 8, 128, torch.float8_e4m3fn, seed=3)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_query_dtypes(q_dtype):
    run_case([300, 17], [100, 1], 16, 4, 128, torch.float8_e5m2, q_dtype=q_dtype, seed=5)
    cache_dtype = torch.float16 if q_dtype == torch.float16 else torch.bfloat16
    run_case([300, 17], [100, 1], 16, 4, 128, cache_dtype, q_dtype=q_dtype, seed=6)


def test_fp32():
    run_case([300, 17, 1], [100, 1, 1], 8, 2, 64, torch.float32, q_dtype=torch.float32, seed=9, tol=1e-4)


# ----------------------------------------------------------------- sliding window
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
def test_sliding_window(kv_dtype, window):
    seq_lens = [1, 17, 1000, 5000, 300]
    query_lens = [1, 17, 1, 1, 200]
    run_case(seq_lens, query_lens, 16, 4, 128, kv_dtype, window=window, seed=window)
    run_case(seq_lens, [1] * 5, 16, 4, 128, kv_dtype, window=window, seed=window + 1)


# ----------------------------------------------------------------- padding tokens
def test_padding_tokens_not_touched():
    """Tokens after query_start_loc[-1] (CUDA-graph padding) are left alone."""
    gen = torch.Generator().manual_seed(11)
    kv_cache, meta, ks, vs = make_batch([50, 9], [1, 1], 2, 64, 16, torch.float8_e4m3fn, gen)
    q = torch.randn(5, 8, 64, generator=gen).to(DEV, torch.bfloat16)
    out = torch.full_like(q, 123.0)
    paged_attention(q, kv_cache, meta, ks, vs, 0.125, out=out, num_splits=4)
    assert (out[2:] == 123.0).all()
    ref = reference(q[:2], kv_cache, meta, ks, vs, 0.125)
    assert rel_err(out[:2], ref) < REL_TOL_BF16


# ----------------------------------------------------------------- cache write
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_matches_torch_quantize(kv_dtype):
    gen = torch.Generator().manual_seed(1)
    T, hkv, d, bs, nb = 300, 4, 128, 16, 40
    k = (torch.randn(T, hkv, d, generator=gen) * 3).to(DEV, torch.bfloat16)
    v = (torch.randn(T, hkv, d, generator=gen) * 3).to(DEV, torch.bfloat16)
    ks = (torch.rand(hkv, generator=gen) + 0.1).to(DEV)
    vs = (torch.rand(hkv, generator=gen) + 0.1).to(DEV)
    slots = torch.randperm(nb * bs, generator=gen)[:T].to(DEV)
    cache = torch.zeros(nb, 2, hkv, bs, d, dtype=kv_dtype, device=DEV)
    write_kv_cache(k, v, cache, slots, ks, vs)
    fmax = FP8_MAX[kv_dtype]
    exp_k = (k.float() / ks[None, :, None]).clamp(-fmax, fmax).to(kv_dtype)
    exp_v = (v.float() / vs[None, :, None]).clamp(-fmax, fmax).to(kv_dtype)
    blk, off = slots // bs, slots % bs
    got_k = cache[blk, 0].permute(0, 2, 1, 3)[torch.arange(T, device=DEV), off]  # [T, Hkv, D]
    got_v = cache[blk, 1].permute(0, 2, 1, 3)[torch.arange(T, device=DEV), off]
    assert torch.equal(got_k.view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), exp_v.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_write_saturation_and_skip(kv_dtype):
    T, hkv, d, bs, nb = 6, 2, 64, 16, 4
    k = torch.randn(T, hkv, d, device=DEV)
    v = torch.randn(T, hkv, d, device=DEV)
    k[0] = 1e6
    k[1] = -1e6
    v[0] = float("inf")
    v[1] = float("-inf")
    k[2, 0, :5] = float("nan")
    ks = torch.full((hkv,), 0.5, device=DEV)
    vs = torch.full((hkv,), 2.0, device=DEV)
    slots = torch.tensor([3, 17, 40, -1, 63, -1], device=DEV)
    cache = torch.randn(nb, 2, hkv, bs, d, device=DEV).to(kv_dtype)
    before = cache.clone()
    write_kv_cache(k.to(torch.bfloat16) if kv_dtype != torch.bfloat16 else k, v, cache, slots, ks, vs)
    written = torch.zeros(nb * bs, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    flat = cache.permute(0, 3, 1, 2, 4).reshape(nb * bs, 2, hkv, d)
    flat_before = before.permute(0, 3, 1, 2, 4).reshape(nb * bs, 2, hkv, d)
    # untouched slots (including the -1 tokens' would-be neighbours) keep their bytes
    assert torch.equal(flat[~written].view(torch.uint8), flat_before[~written].view(torch.uint8))
    if kv_dtype in FP8_MAX:
        fmax = FP8_MAX[kv_dtype]
        f = flat.float()
        assert torch.isfinite(f).all()
        assert (f[3, 0] == fmax).all() and (f[17, 0] == -fmax).all()
        assert (f[3, 1] == fmax).all() and (f[17, 1] == -fmax).all()
        assert (f[40, 0, 0, :5] == 0).all()  # NaN stored as 0
        ref_k = (k[4].to(torch.bfloat16).float() / 0.5).clamp(-fmax, fmax).to(kv_dtype).float()
        assert torch.equal(f[63, 0], ref_k)
    else:
        assert torch.equal(flat[3, 0], k[0].to(kv_dtype))
        assert torch.equal(flat[63, 1], v[4].to(kv_dtype))


def test_write_strided_inputs():
    """k/v as views into a fused qkv buffer (non-contiguous token stride)."""
    T, hq, hkv, d, bs = 33, 8, 2, 128, 16
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    cache = torch.zeros(4, 2, hkv, bs, d, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(T, device=DEV) + 7
    write_kv_cache(k, v, cache, slots, None, None)
    blk, off = slots // bs, slots % bs
    got_k = cache[blk, 0].permute(0, 2, 1, 3)[torch.arange(T, device=DEV), off]
    assert torch.equal(got_k, k)
