"""Tests for the Triton paged-attention and KV-cache-write kernels (the tl.dot kernel, its split-K
merge, and the Gluon fp8 decode kernels it routes to on an H200).

Where they run (tests/triton_kernel_device.py): everything compiled on a CUDA GPU; without one, the
small cases (``test_small_*`` and the cache writes) in Triton's CPU interpreter. Long contexts, many
heads and the Gluon kernels are GPU only (``gpu_only``; Gluon tests are named ``gpu_only_gluon``).

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

import dataclasses
import math

import numpy as np
import pytest
import torch
from triton_kernel_device import (
    BF16_DOT,
    DEVICE,
    FP8_ROUNDING,
    GLUON_GPU_ONLY,
    INTERPRETED,
    gluon_gpu_only,
    gpu_only,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels.gluon_support import gluon_runs_on
from kvforge.kernels.triton_cache_write import write_kv_cache
from kvforge.kernels.triton_paged_attention import _LAST_LAUNCH, paged_attention

pytestmark = requires_kernels
DEV = DEVICE

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
    per_tensor_scale=False,
):
    """A random paged cache holding each sequence's full context + metadata.

    ``per_tensor_scale``: one fp8 scale for every KV head (shape ``[1]``) instead of one per head.

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
    num_scales = 1 if per_tensor_scale else num_kv_heads
    k_scale = (torch.rand(num_scales, generator=gen) * (hi - lo) + lo).to(DEV)
    v_scale = (torch.rand(num_scales, generator=gen) * (hi - lo) + lo).to(DEV)
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


def reference(q, kv_cache, meta, k_scale, v_scale, softmax_scale, window=None, sinks=None):
    """float64 causal paged attention over the dequantized cache. ``sinks`` ([Hq]): head ``h``'s weights are
    ``exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))`` (the sink has no value row and is not scaled)."""
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
        if sinks is None:
            p = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.double().to(DEV)[:, None]  # [Hq, 1]
            top = torch.maximum(scores.amax(dim=-1), sink)  # [Hq, L]
            e = torch.exp(scores - top[..., None])
            p = e / (e.sum(dim=-1) + torch.exp(sink - top))[..., None]
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
    sinks=None,
    per_tensor_scale=False,
    decode_order=None,
):
    """One batch through ``paged_attention`` against :func:`reference`; returns the relative error.
    ``sinks``: the sink logits ([hq]), or None. ``decode_order``: a permutation of the sequences handed to
    the kernel as ``meta.decode_order`` (None: none); with ``num_splits=1`` the output must then equal,
    bit for bit, the output without it (every program computes the same values whichever order it runs
    in; with splits, the chunks follow the order's first sequence, so only the reference bound holds)."""
    skip_unless_loaded_loop_bounds_work()
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
        per_tensor_scale=per_tensor_scale,
    )
    T = sum(query_lens)
    q = torch.randn(T, hq, d, generator=gen).to(DEV, q_dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    def attend(m, o):
        return paged_attention(q, kv_cache, m, ks, vs, scale, sliding_window=window, out=o, num_splits=num_splits,
                               sinks=None if sinks is None else sinks.to(DEV), **(config or {}))

    if decode_order is not None:
        unordered = attend(meta, torch.full_like(q, float("nan")))
        meta = dataclasses.replace(meta, decode_order=torch.tensor(decode_order, dtype=torch.int32, device=DEV))
    res = attend(meta, out)
    if decode_order is not None and num_splits == 1:
        assert torch.equal(out, unordered), "the program order changed the values"
    if expect_kernel is not None:
        if expect_kernel != TL_DOT and not gluon_runs_on(q):
            pytest.skip(GLUON_GPU_ONLY)
        launched = _LAST_LAUNCH["attn"]
        if launched is not None:  # None under TRITON_INTERPRET (nothing is compiled)
            assert launched.name == expect_kernel
    assert res.data_ptr() == out.data_ptr()
    assert out.dtype == q_dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) outputs remain"
    ref = reference(q, kv_cache, meta, ks, vs, scale, window, sinks)
    if sinks is not None:  # the sinks move the output far more than the tolerance: the case can fail
        assert rel_err(reference(q, kv_cache, meta, ks, vs, scale, window), ref) > 10 * tol
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.3e} >= {tol}"
    return err


KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
KV_IDS = ["bf16", "e4m3", "e5m2"]


# ----------------------------------------------------------------- decode
@gpu_only
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
    "gpu_only_gluon-warp1": (dict(kernel="gluon_fp8_warp1"), GLUON),
    "gpu_only_gluon-warp": (dict(kernel="gluon_fp8_warp"), GLUON),
    "gpu_only_gluon-cta": (dict(kernel="gluon_fp8_cta"), GLUON_CTA),
    "tl.dot": (dict(kernel="tl_dot"), TL_DOT),
}


@gpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 4), (32, 2), (12, 4)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_decode_every_path(path, kv_dtype, hq, hkv, d):
    """fp8 decode goes to a Gluon kernel (GQA <= 16, head 64/128/256; which one by
    the routing table, kvforge/attention/routing/paged.py); the tl.dot kernel stays as the fallback. Each path against
    the float64 reference, with the path asserted."""
    seq_lens = [1, 15, 16, 17, 1000, 77, 4100]
    config, kernel = PATHS[path]
    if path == "gpu_only_gluon-warp1" and d == 256:
        pytest.skip("the one-warp row serves head sizes 64 and 128")
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


@gpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_fp8_decode_empty_query_sequences(path, splits):
    """Sequences with no new token in a decode batch (max_query_len 1), the last one included:
    nothing is written for them and nothing past the last token is touched."""
    config, kernel = PATHS[path]
    run_case([5, 300, 20, 2100, 40], [1, 0, 1, 1, 0], 16, 4, 128, torch.float8_e4m3fn, seed=4,
             num_splits=splits, config=config, expect_kernel=kernel)  # fmt: skip


@gpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("first", ["longest", "shortest"])
def test_fp8_decode_in_decode_order(path, splits, first):
    """Programs handed out through ``meta.decode_order`` (a sequence with no new token among them), longest
    context first as the runner orders them, or shortest first: the warp kernel sizes its split-K chunks by
    the order's first sequence, and a 5-token first sequence must not cut the 2100-token one short. Against
    the reference; with one split also bit for bit against the unordered launch."""
    config, kernel = PATHS[path]
    lens, qlens = [40, 2100, 5, 300, 1000, 17], [1, 1, 1, 0, 1, 1]
    order = AttentionMetadata.longest_first(np.array(lens)).tolist()
    assert order == [1, 4, 3, 0, 5, 2]
    run_case(lens, qlens, 32, 8, 128, torch.float8_e4m3fn, seed=6, num_splits=splits, config=config,
             expect_kernel=kernel, decode_order=order if first == "longest" else order[::-1])  # fmt: skip


@gpu_only
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_decode_nan_in_unwritten_slots(path, kv_dtype):
    """Page tails and spare blocks full of fp8 NaN bytes: masked-off bytes must never reach P V."""
    config, kernel = PATHS[path]
    run_case([1, 15, 17, 1000, 4100], [1] * 5, 32, 8, 128, kv_dtype, seed=8, config=config,
             expect_kernel=kernel, nan_junk=True)  # fmt: skip


@gpu_only
@pytest.mark.parametrize("path", list(PATHS))
def test_fp8_decode_calibrated_e5m2_scales(path):
    """Scales of a calibrated e5m2 cache (~amax / 57344): the scale must multiply float32 scores,
    not an fp16 query (which would fall into fp16 subnormals)."""
    config, kernel = PATHS[path]
    run_case([17, 1000, 4100], [1] * 3, 32, 8, 128, torch.float8_e5m2, seed=9, config=config,
             expect_kernel=kernel, scale_range=(1e-4, 3e-4))  # fmt: skip


@gluon_gpu_only
@pytest.mark.parametrize("row", ["gluon_fp8_warp", "gluon_fp8_warp1"])
@pytest.mark.parametrize("window", [16, 100, 4096])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_only_gluon_fp8_decode_warp_window_and_no_split(row, window, splits):
    """The warp kernel (four warps and one) with a sliding window, and without split-K (its direct-output
    epilogue)."""
    run_case([1, 17, 1000, 5000, 300], [1] * 5, 16, 4, 128, torch.float8_e4m3fn, window=window, seed=window,
             num_splits=splits, config=dict(kernel=row), expect_kernel=GLUON)  # fmt: skip


@gluon_gpu_only
@pytest.mark.parametrize("path", ["gpu_only_gluon-warp1", "gpu_only_gluon-warp", "gpu_only_gluon-cta"])
def test_gpu_only_gluon_fp8_decode_fp16_query(path):
    config, kernel = PATHS[path]
    run_case([1, 17, 1000, 3000], [1] * 4, 16, 4, 128, torch.float8_e5m2, q_dtype=torch.float16, seed=10,
             config=config, expect_kernel=kernel)  # fmt: skip


@gluon_gpu_only
def test_gpu_only_gluon_is_the_fp8_decode_default():
    run_case([1, 4100], [1, 1], 32, 8, 128, torch.float8_e4m3fn, seed=1, expect_kernel=GLUON_CTA)
    run_case([9000] * 8, [1] * 8, 32, 8, 128, torch.float8_e4m3fn, seed=2, expect_kernel=GLUON)
    assert _LAST_LAUNCH["attn"].metadata.num_warps == 4  # 64 programs: the four-warp row


@gluon_gpu_only
def test_gpu_only_gluon_large_grids_run_one_warp_programs():
    """From 0.75 (sequence, KV head) programs per SM on, fp8 decode runs the one-warp row, with and without
    splits, at short and long contexts."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-sms // 8)  # x 8 KV heads >= SMs
    for lens in ([3000] * batch, [1, 17, 300, 64] * 40):
        run_case(lens, [1] * len(lens), 32, 8, 128, torch.float8_e4m3fn, seed=len(lens), expect_kernel=GLUON)
        assert _LAST_LAUNCH["attn"].metadata.num_warps == 1


GLUON_CONFIGS = {
    "warp16": dict(kernel="gluon_fp8_warp", gluon_tiling=dict(wt=16)),
    "warp16-vstaged": dict(kernel="gluon_fp8_warp", gluon_tiling=dict(wt=16, v_mode=2)),
    "warp32x2": dict(kernel="gluon_fp8_warp", gluon_tiling=dict(wt=32, stages=2)),
    "warp16w8": dict(kernel="gluon_fp8_warp", gluon_tiling=dict(wt=16, warps=8, stages=4)),
    "warp1": dict(kernel="gluon_fp8_warp1"),
    "warp16w1": dict(kernel="gluon_fp8_warp1", gluon_tiling=dict(wt=16, stages=4)),
    "cta64": dict(kernel="gluon_fp8_cta", gluon_tiling=dict(tile_n=64)),
    "cta128": dict(kernel="gluon_fp8_cta", gluon_tiling=dict(tile_n=128, stages=2)),
}


@gluon_gpu_only
@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("cfg", list(GLUON_CONFIGS))
def test_gpu_only_gluon_fp8_decode_block_sizes_and_tiles(block_size, cfg):
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


@gpu_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_decode_33k(kv_dtype):
    seq_lens = [33000, 5, 16, 1000]
    run_case(seq_lens, [1] * 4, 32, 8, 128, kv_dtype, seed=7)


@gpu_only
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_decode_forced_splits(splits):
    seq_lens = [1, 17, 300, 2049]
    run_case(seq_lens, [1] * 4, 16, 2, 128, torch.float8_e4m3fn, num_splits=splits, seed=splits)


@gpu_only
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


@gpu_only
@pytest.mark.parametrize("d", [32, 80, 96, 192])
def test_other_head_sizes(d):
    run_case([1, 17, 400], [1, 1, 1], 8, 2, d, torch.bfloat16, seed=d)
    run_case([19, 17, 400], [19, 3, 128], 8, 2, d, torch.float8_e4m3fn, seed=d)


@gpu_only
def test_gqa_16():
    run_case([1, 17, 1000], [1, 1, 1], 32, 2, 128, torch.bfloat16, seed=16)
    run_case([40, 17, 1000], [40, 1, 100], 32, 2, 128, torch.bfloat16, seed=16)


# ----------------------------------------------------------------- prefill / mixed
@gpu_only
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


@gpu_only
def test_prefill_long_context():
    # chunked prefill: 512 new tokens after 32.5k tokens of cached context
    run_case([33000, 200], [512, 200], 32, 8, 128, torch.float8_e4m3fn, seed=3)


@gpu_only
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_query_dtypes(q_dtype):
    run_case([300, 17], [100, 1], 16, 4, 128, torch.float8_e5m2, q_dtype=q_dtype, seed=5)
    cache_dtype = torch.float16 if q_dtype == torch.float16 else torch.bfloat16
    run_case([300, 17], [100, 1], 16, 4, 128, cache_dtype, q_dtype=q_dtype, seed=6)


@gpu_only
def test_fp32():
    run_case([300, 17, 1], [100, 1, 1], 8, 2, 64, torch.float32, q_dtype=torch.float32, seed=9, tol=1e-4)


# ----------------------------------------------------------------- sliding window
@gpu_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
def test_sliding_window(kv_dtype, window):
    seq_lens = [1, 17, 1000, 5000, 300]
    query_lens = [1, 17, 1, 1, 200]
    run_case(seq_lens, query_lens, 16, 4, 128, kv_dtype, window=window, seed=window)
    run_case(seq_lens, [1] * 5, 16, 4, 128, kv_dtype, window=window, seed=window + 1)


# ----------------------------------------------------------------- small shapes (GPU and interpreter)
# Head sizes 32 and 48 and fp16/fp32 queries keep every case on the tl.dot kernel on a GPU too (the Gluon
# kernels take head sizes 64/128/256 only). Contexts 1-40 at block size 16 or 48 cover single-token,
# page-boundary (15/16/17) and multi-page sequences, a tile straddling pages and the masked tail.
REL_TOL_FP16 = 4e-3  # P and the output rounded to fp16 (2^-11 relative each), summed in quadrature
SMALL_KV = [
    pytest.param(torch.float16, torch.float16, REL_TOL_FP16, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, REL_TOL_BF16, id="bf16",
                 marks=pytest.mark.skipif(INTERPRETED, reason=BF16_DOT)),
    pytest.param(torch.float32, torch.float32, 1e-4, id="fp32"),
    pytest.param(torch.float8_e4m3fn, torch.bfloat16, REL_TOL_BF16, id="e4m3-bf16q"),
    pytest.param(torch.float8_e4m3fn, torch.float16, REL_TOL_FP16, id="e4m3-fp16q"),
    pytest.param(torch.float8_e5m2, torch.float16, REL_TOL_FP16, id="e5m2-fp16q"),
]
SMALL_SHAPES = [pytest.param(4, 2, 32, 16, id="gqa2-d32-block16"), pytest.param(3, 1, 48, 48, id="gqa3-d48-block48")]


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", SMALL_KV)
@pytest.mark.parametrize("hq,hkv,d,block_size", SMALL_SHAPES)
def test_small_decode(kv_dtype, q_dtype, tol, hq, hkv, d, block_size):
    run_case([1, 15, 16, 17, 40], [1] * 5, hq, hkv, d, kv_dtype, block_size=block_size, q_dtype=q_dtype,
             seed=hq + d + block_size, tol=tol)  # fmt: skip


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [SMALL_KV[0], SMALL_KV[3]])
@pytest.mark.parametrize("splits", [2, 5])
def test_small_decode_split_k_and_merge(kv_dtype, q_dtype, tol, splits):
    """Forced split-K (5 splits of a 40-token context: some splits hold no token) and the merge kernel;
    sequences with no new token in the batch are skipped."""
    run_case([40, 9, 17, 33], [1, 0, 1, 1], 4, 2, 32, kv_dtype, q_dtype=q_dtype, num_splits=splits,
             seed=splits, tol=tol)  # fmt: skip


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [SMALL_KV[0], SMALL_KV[3]])
@pytest.mark.parametrize("splits", [None, 3])
def test_small_decode_in_a_given_order(kv_dtype, q_dtype, tol, splits):
    """The decode grid walks ``meta.decode_order`` (a shuffled permutation, a sequence with no new token in
    it): each sequence still gets its own output, with and without split-K."""
    run_case([400, 9, 17, 33, 2], [1, 1, 0, 1, 1], 4, 2, 32, kv_dtype, q_dtype=q_dtype, num_splits=splits, seed=7,
             tol=tol, decode_order=[4, 0, 3, 2, 1])  # fmt: skip


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [SMALL_KV[0], SMALL_KV[3]])
def test_small_decode_order_keeps_unsplit_values(kv_dtype, q_dtype, tol):
    """Without split-K the order changes only when each program runs: bit-identical outputs."""
    run_case([40, 9, 17, 33, 2], [1, 1, 0, 1, 1], 4, 2, 32, kv_dtype, q_dtype=q_dtype, num_splits=1, seed=8,
             tol=tol, decode_order=[0, 3, 2, 1, 4])  # fmt: skip


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [SMALL_KV[0], SMALL_KV[2], SMALL_KV[5]])
def test_small_mixed_prefill_decode(kv_dtype, q_dtype, tol):
    """Six query heads on one KV head pad to 8 rows per token, so a query tile holds 16 tokens and the
    37-token prefill spans three tiles (program ids found by the binary search over query_start_loc):
    a fresh prefill, a chunked prefill after 23 cached tokens, a decode, a 3-token prefix hit and a
    sequence with no new token."""
    run_case([37, 40, 17, 30, 20], [37, 17, 1, 3, 0], 6, 1, 32, kv_dtype, q_dtype=q_dtype, seed=3, tol=tol)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # see below
@pytest.mark.parametrize("window", [1, 7])
def test_small_sliding_window(window):
    """Windows of 1 and 7 tokens over prefill, decode and split-K decode. (The interpreter warns of 0 / 0
    in padding rows of a query tile, which are never stored; the GPU computes the same.)"""
    run_case([37, 40, 17, 30], [37, 1, 1, 3], 6, 1, 32, torch.float8_e4m3fn, q_dtype=torch.float16,
             window=window, seed=window, tol=REL_TOL_FP16)  # fmt: skip
    run_case([1, 15, 40, 33], [1] * 4, 4, 2, 32, torch.float16, q_dtype=torch.float16, window=window,
             num_splits=3, seed=window + 1, tol=REL_TOL_FP16)  # fmt: skip


# ----------------------------------------------------------------- window + attention sinks
def sink_logits(hq, seed, dtype=torch.float32):
    """One sink logit per query head, spread over the range where they matter (scores here are about
    N(0, 1), so a context of n tokens has a log-sum-exp near log(n) + 0.5): -40 (no effect), a few values
    in [-1, 6], and 40 (the sink takes nearly all the mass), in a random order."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([-40.0, 40.0] + (torch.rand(hq, generator=gen) * 7 - 1).tolist())[:hq]
    return values[torch.randperm(hq, generator=gen)].to(dtype)


SINK_KV = [
    pytest.param(torch.float16, torch.float16, False, REL_TOL_FP16, id="fp16"),
    pytest.param(torch.bfloat16, torch.float16, False, REL_TOL_FP16, id="bf16-fp16q"),
    pytest.param(torch.bfloat16, torch.bfloat16, False, REL_TOL_BF16, id="bf16",
                 marks=pytest.mark.skipif(INTERPRETED, reason=BF16_DOT)),
    pytest.param(torch.float8_e4m3fn, torch.bfloat16, False, REL_TOL_BF16, id="e4m3-bf16q-per-head"),
    pytest.param(torch.float8_e4m3fn, torch.float16, True, REL_TOL_FP16, id="e4m3-fp16q-per-tensor"),
    pytest.param(torch.float8_e5m2, torch.float16, True, REL_TOL_FP16, id="e5m2-fp16q-per-tensor"),
]


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # padding rows
@pytest.mark.parametrize("kv_dtype,q_dtype,per_tensor,tol", SINK_KV)
@pytest.mark.parametrize("window", [None, 5, 20])
def test_small_sinks_and_window_prefill_mixed(kv_dtype, q_dtype, per_tensor, tol, window):
    """Sinks with no window, a 5-token window (it starts mid-block: block size 16) and a 20-token one, over
    a fresh prefill spanning three query tiles, a chunked prefill, a decode, a short prefix hit and a
    sequence with no new token (no split-K: the sink enters in the kernel's epilogue)."""
    run_case([37, 40, 17, 30, 20], [37, 17, 1, 3, 0], 6, 2, 32, kv_dtype, q_dtype=q_dtype, window=window,
             seed=7, tol=tol, sinks=sink_logits(6, 7), per_tensor_scale=per_tensor)  # fmt: skip


@pytest.mark.parametrize("kv_dtype,q_dtype,per_tensor,tol", SINK_KV)
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_small_sinks_and_window_decode_split_k(kv_dtype, q_dtype, per_tensor, tol, window, splits):
    """Decode with sinks at forced split counts 1, 2 and 5 (5 splits of a 40-token context leave some
    splits empty): the sink enters once per row, in the merge (a sink per split would add it up to five
    times); the 5-token window starts mid-block."""
    run_case([40, 9, 17, 33, 1], [1, 0, 1, 1, 1], 4, 2, 32, kv_dtype, q_dtype=q_dtype, window=window,
             num_splits=splits, seed=splits, tol=tol, sinks=sink_logits(4, splits), per_tensor_scale=per_tensor)  # fmt: skip


def test_small_sinks_bf16_logits_and_shape_checked():
    """Sinks given in the model dtype are read as their values; a sinks tensor of the wrong shape is refused
    before any launch."""
    run_case([40, 17], [1, 1], 4, 2, 32, torch.float16, q_dtype=torch.float16, num_splits=2, seed=3,
             tol=REL_TOL_FP16, sinks=sink_logits(4, 3, torch.bfloat16))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    kv_cache, meta, ks, vs = make_batch([5], [1], 2, 32, 16, torch.float16, gen)
    q = torch.randn(1, 4, 32, generator=gen).to(DEV, torch.float16)
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads\] = \[4\]"):
        paged_attention(q, kv_cache, meta, ks, vs, 0.1, sinks=torch.zeros(2, device=DEV))


def test_small_backend_attends_with_the_layer_sinks_and_window():
    """The backend object hands the layer's window and sinks (LayerKV) to the kernels."""
    from kvforge.attention.backends.base import BackendOptions, LayerKV
    from kvforge.attention.backends.triton_paged import TritonPagedBackend
    from kvforge.attention.routing.platform import Device

    skip_unless_loaded_loop_bounds_work()
    gen = torch.Generator().manual_seed(5)
    kv_cache, meta, ks, vs = make_batch([40, 23], [1, 23], 2, 32, 16, torch.float8_e4m3fn, gen,
                                        src_dtype=torch.float16)  # fmt: skip
    q = torch.randn(24, 4, 32, generator=gen).to(DEV, torch.float16)
    sinks = sink_logits(4, 5)
    backend = TritonPagedBackend(BackendOptions(softmax_scale=0.2, model_dtype="float16", device=Device()))
    out = backend.attend(LayerKV(kv_cache, ks, vs, window=6, sinks=sinks.to(DEV)), meta, q)
    ref = reference(q, kv_cache, meta, ks, vs, 0.2, 6, sinks)
    assert rel_err(reference(q, kv_cache, meta, ks, vs, 0.2, 6), ref) > 10 * REL_TOL_FP16
    assert rel_err(out, ref) < REL_TOL_FP16


#: fp8 scales of the gpt-oss-shape cases: fp8 keys are drawn as N(0, (2 x scale)^2), so these keep the scores
#: near N(0, 1), where sinks of -1..6 move the output well past the tolerance over 1-5000-token contexts.
SINK_SCALES = (0.25, 0.5)


@gpu_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("window", [None, 128, 1000])
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
def test_sinks_and_window_decode_gpt_oss_shape(kv_dtype, window, splits):
    """gpt-oss-20b's attention on one rank (64 query heads over 8 KV heads, head size 64, window 128) over
    long contexts, every cache dtype, the routing table's split count and forced ones; fp8 decode with
    sinks runs the tl.dot kernel (the Gluon rows do not serve sinks)."""
    seq_lens = [1, 127, 128, 129, 1000, 5000, 300]
    run_case(seq_lens, [1] * len(seq_lens), 64, 8, 64, kv_dtype, window=window, num_splits=splits,
             seed=17, sinks=sink_logits(64, 17), expect_kernel=TL_DOT, scale_range=SINK_SCALES)  # fmt: skip


@gpu_only
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_and_window_prefill_gpt_oss_shape(kv_dtype, window):
    """gpt-oss shapes over prefill chunks across the window edge, decodes and a prefix hit, with a
    per-tensor fp8 scale (per-head scales: the decode test)."""
    seq_lens = [700, 300, 129, 2000, 50]
    query_lens = [700, 172, 1, 64, 0]
    run_case(seq_lens, query_lens, 64, 8, 64, kv_dtype, window=window, seed=23, sinks=sink_logits(64, 23),
             per_tensor_scale=True, expect_kernel=TL_DOT, scale_range=SINK_SCALES)  # fmt: skip


# ----------------------------------------------------------------- padding tokens
def test_padding_tokens_not_touched():
    """Tokens after query_start_loc[-1] (CUDA-graph padding) are left alone."""
    skip_unless_loaded_loop_bounds_work()
    gen = torch.Generator().manual_seed(11)
    kv_cache, meta, ks, vs = make_batch([50, 9], [1, 1], 2, 64, 16, torch.float8_e4m3fn, gen)
    q = torch.randn(5, 8, 64, generator=gen).to(DEV, torch.bfloat16)
    out = torch.full_like(q, 123.0)
    paged_attention(q, kv_cache, meta, ks, vs, 0.125, out=out, num_splits=4)
    assert (out[2:] == 123.0).all()
    ref = reference(q[:2], kv_cache, meta, ks, vs, 0.125)
    assert rel_err(out[:2], ref) < REL_TOL_BF16


# ----------------------------------------------------------------- cache write
def _on_grid(shape, dtype, gen, scale):
    """Random values that are ``scale`` (per KV head, powers of two) times a value of ``dtype``: dividing by
    the scale is exact and lands on the cache dtype's grid, so the stored bytes do not depend on how the
    cast rounds (the interpreter's fp8 and bf16 casts do not round as the GPU does)."""
    return torch.randn(shape, generator=gen).to(dtype).float() * scale[None, :, None].cpu()


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32],
    ids=["e4m3", "e5m2", "bf16", "fp16", "fp32"],
)
def test_write_values_on_the_cache_grid(kv_dtype):
    """Every written slot holds exactly its token's values over the scale (bitwise); every other slot,
    including those of -1 tokens, keeps its bytes. 3 KV heads (padded to 4) and head size 48 (padded to
    64) exercise the masks; the input is bf16 for fp8 caches (the model dtype), float32 otherwise."""
    gen = torch.Generator().manual_seed(2)
    T, hkv, d, bs, nb = 21, 3, 48, 16, 4
    ks = torch.tensor([0.25, 1.0, 4.0]) if kv_dtype in FP8_MAX else torch.ones(hkv)
    vs = torch.tensor([2.0, 0.5, 8.0]) if kv_dtype in FP8_MAX else torch.ones(hkv)
    k, v = _on_grid((T, hkv, d), kv_dtype, gen, ks), _on_grid((T, hkv, d), kv_dtype, gen, vs)
    src = torch.bfloat16 if kv_dtype in FP8_MAX else torch.float32
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[::5] = -1
    cache = torch.randn(nb, 2, hkv, bs, d, generator=gen).to(kv_dtype)  # junk in every slot
    before = cache.clone()
    cache = cache.to(DEV)
    write_kv_cache(k.to(DEV, src), v.to(DEV, src), cache, slots.to(DEV), ks.to(DEV), vs.to(DEV))
    cache = cache.cpu()
    expected = before.clone()
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    expected[blk, 0, :, off] = (k[keep] / ks[None, :, None]).to(kv_dtype)
    expected[blk, 1, :, off] = (v[keep] / vs[None, :, None]).to(kv_dtype)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(INTERPRETED, reason=FP8_ROUNDING)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_matches_torch_quantize(kv_dtype):
    """Random (off-grid) values round to the same fp8 bytes as torch's cast (round to nearest even)."""
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
    """Finite overflow and +-inf saturate to +-fmax and NaN is stored as 0 in fp8 caches; -1 slots are
    skipped. Finite inputs are on the cache grid (``_on_grid``)."""
    T, hkv, d, bs, nb = 6, 2, 64, 16, 4
    gen = torch.Generator().manual_seed(3)
    ks = torch.full((hkv,), 0.5, device=DEV)
    vs = torch.full((hkv,), 2.0, device=DEV)
    k = _on_grid((T, hkv, d), kv_dtype, gen, ks).to(DEV)
    v = _on_grid((T, hkv, d), kv_dtype, gen, vs).to(DEV)
    k[0] = 1e6
    k[1] = -1e6
    v[0] = float("inf")
    v[1] = float("-inf")
    k[2, 0, :5] = float("nan")
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
