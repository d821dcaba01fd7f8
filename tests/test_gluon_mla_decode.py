"""The wgmma MLA decode kernel (kvforge/kernels/gluon_mla_decode.py) against the float32 reference.

Reference: ``mla_reference.mla_decode`` in float32 over the dequantized latent cache with a float32
copy of the query. Bound 2**-6 of max|ref|, as for the tl.dot kernel (tests/test_triton_mla.py): the
kernel's roundings are the query to the dot dtype (bf16 2**-9; fp16 2**-11 for an fp8 cache, whose
values fp16 holds exactly), P to 16 bits for ``P C``, and the bf16/fp16 output. Lengths 1, 15-17,
1000, 3000 and random, NaN in every unused cache row, poisoned (NaN) outputs; split-K is also held to
the kernel's own unsplit result at 2**-7, with flat and peaked attention. GPU tests skip unless the
Gluon gate opens (sm_90, Triton 3.6); the routing rule, the split rule and the fragment permutation
run on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_triton_mla import _batch
from triton_kernel_device import GLUON_GPU_ONLY

from kvforge.attention import mla_reference as ref
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels import gluon_mla_decode as gm
from kvforge.kernels import gluon_mla_decode_ws as gm_ws
from kvforge.kernels import triton_mla_decode as tmd
from kvforge.kernels.gluon_support import GLUON_ENABLED

needs_gluon = pytest.mark.skipif(
    not (GLUON_ENABLED and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason=GLUON_GPU_ONLY,
)
BOUND = 2.0 ** -6


def _check(q_latent, q_rope, cache, meta, scale, **kw):
    """Relative error vs the float32 reference; the output starts poisoned (NaN) and must be written."""
    want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, 192 ** -0.5)
    out = torch.full_like(q_latent, float("nan"))
    got = gm.mla_decode_wgmma(q_latent, q_rope, cache, meta, scale, 192 ** -0.5, out=out, **kw)
    assert got is out and torch.isfinite(got).all()
    return ((got.float() - want).abs().max() / want.abs().max()).item()


BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_unknown_config_keys_are_refused(monkeypatch):
    monkeypatch.setattr(gm, "gluon_runs_on", lambda t: True)
    q = torch.zeros(1, 16, 512, dtype=BF16)
    with pytest.raises(ValueError, match="fp8_regs"):
        gm.mla_decode_wgmma(q, q[..., :64], torch.zeros(1, 16, 576, dtype=BF16), None, None, 0.1,
                            cfg={"fp8_regs": True})


def test_unknown_fp8_path_is_refused(monkeypatch):
    monkeypatch.setattr(gm, "gluon_runs_on", lambda t: True)
    q = torch.zeros(1, 16, 512, dtype=BF16)
    cache = torch.zeros(1, 16, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8_path 2: choose 0 \(ring\) or 1 \(registers\)"):
        gm.mla_decode_wgmma(q, q[..., :64], cache, None, torch.ones(1), 0.1, cfg={"fp8_path": 2})


def test_eight_warps_only_on_the_fp8_register_path_at_32_heads(monkeypatch):
    monkeypatch.setattr(gm, "gluon_runs_on", lambda t: True)
    q16 = torch.zeros(1, 16, 512, dtype=BF16)
    q32 = torch.zeros(1, 32, 512, dtype=BF16)
    fp8 = torch.zeros(1, 16, 576, dtype=E4M3)
    with pytest.raises(ValueError, match="num_warps 6: choose 4"):
        gm.mla_decode_wgmma(q32, q32[..., :64], fp8, None, torch.ones(1), 0.1, cfg={"num_warps": 6})
    with pytest.raises(ValueError, match="runs only the fp8 register path at 32 heads"):
        gm.mla_decode_wgmma(q32, q32[..., :64], torch.zeros(1, 16, 576, dtype=BF16), None, None, 0.1,
                            cfg={"num_warps": 8})
    with pytest.raises(ValueError, match="runs only the fp8 register path at 32 heads"):
        gm.mla_decode_wgmma(q32, q32[..., :64], fp8, None, torch.ones(1), 0.1,
                            cfg={"num_warps": 8, "fp8_path": gm.FP8_PATH_RING})
    with pytest.raises(ValueError, match="runs only the fp8 register path at 32 heads"):
        gm.mla_decode_wgmma(q16, q16[..., :64], fp8, None, torch.ones(1), 0.1, cfg={"num_warps": 8})
    with pytest.raises(ValueError, match="at 32 heads per program needs num_warps 8"):
        gm.mla_decode_wgmma(q32, q32[..., :64], fp8, None, torch.ones(1), 0.1, cfg={"num_warps": 4})
    assert [gm.default_num_warps(True, nh) for nh in (8, 16, 32)] == [4, 4, 8]
    assert gm.default_num_warps(False, 32) == 4
    assert [mla_routing.wgmma_programs_per_sm(True, nh) for nh in (8, 16, 32)] == [2, 2, 1]


def test_launches_equal_the_cuda_graph_pinning(monkeypatch):
    """CUDA graphs pin the routing table's first candidate's split count; the engine entry must launch that
    count by default for every cache kind, head count and batch, on the kernel the table named (the
    warp-specialized one for fp8 at up to 16 heads with >= ``WS_MIN_TOKENS_PER_CTA`` tokens a CTA). Kernel launches are replaced
    by recorders, so this runs on CPU."""
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.attention.routing.platform import Device

    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.update(kernel=self.name, grid=grid, **kw)

    monkeypatch.setattr(gm, "_wgmma_mla_decode_kernel", Recorder("wgmma"), raising=False)  # absent without Gluon
    monkeypatch.setattr(gm_ws, "_ws_mla_decode_kernel", Recorder("ws"), raising=False)
    monkeypatch.setattr(gm, "gluon_runs_on", lambda t: True)
    monkeypatch.setattr(gm, "merge_split_partials", lambda *a, **k: None)
    monkeypatch.setattr(gm_ws, "merge_split_partials", lambda *a, **k: None)
    for sms in (132, 78):  # H200/H100 SXM, and a smaller part
        device = Device(num_sms=sms, gluon=True)
        monkeypatch.setattr(tmd, "routing_device", lambda t, d=device: d)
        monkeypatch.setattr(gm, "num_sms", lambda d, n=sms: n)
        ws_seen = 0
        for cache_dtype in (BF16, E4M3, E5M2):
            kv = {BF16: "bfloat16", E4M3: "fp8_e4m3", E5M2: "fp8_e5m2"}[cache_dtype]
            for heads in (1, 8, 16, 17, 32, 64, 128):
                for batch in (1, 3, 8, 32, 128):
                    for max_len in (300, 4096, 65536):
                        q = torch.zeros(batch, heads, 512, dtype=BF16)
                        meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32),
                                                 torch.ones(batch, dtype=torch.int32),
                                                 torch.zeros(batch, 1, dtype=torch.int32),
                                                 torch.zeros(batch, dtype=torch.int64), 1, max_len, 16)  # fmt: skip
                        queries = [None] + (["fp8_e4m3"] if cache_dtype == E4M3 and heads <= 16 else [])
                        for query_dtype in queries:  # the plan's e4m3 query pins the same split count
                            tmd.mla_decode(q, q[..., :64], torch.zeros(1, 16, 576, dtype=cache_dtype), meta,
                                           torch.ones(1), 0.1, query_dtype=query_dtype)  # fmt: skip
                            pinned = mla_routing.pinned_splits(batch, heads, 512, 64, max_len, "bfloat16", kv,
                                                               query_dtype, device)  # fmt: skip
                            assert seen["grid"][2] == pinned, (sms, cache_dtype, heads, batch, max_len, seen["grid"])
                            if mla_routing.ws_takes(cache_dtype != BF16, heads, batch, max_len, sms):
                                assert seen["kernel"] == "ws"
                                assert seen["NH"] == (8 if heads <= 8 else 16) and seen["grid"][:2] == (1, batch)
                                # the bf16 query over an e4m3 cache runs as two e4m3 terms at 16 heads a program
                                two_terms = query_dtype is None and cache_dtype == E4M3 and seen["NH"] == 16
                                assert seen["TWO_TERMS"] == two_terms
                                assert seen["FP8_SCORE"] == (query_dtype is not None or two_terms)
                                ws_seen += 1
                            else:
                                assert seen["kernel"] == "wgmma" and seen["TILE"] == 16 * seen["num_warps"]
                            seen.clear()
        # >= 1024 tokens a CTA, fp8 kinds x heads 1, 8, 16 x 6 shapes: at 65536 tokens every batch but 1 (128
        # splits of 512), at 4096 batches 32 (4 splits) and 128 (1); the same e4m3 cases again with the e4m3 query
        assert ws_seen == 6 * (2 * 3 + 3), sms


def test_lazy_rescale_only_where_measured_faster():
    """The fp8 register path at 16 and 32 heads per program only (the A/B in lazy_rescale's docstring)."""
    assert gm.lazy_rescale(True, 16, gm.FP8_PATH_REGS)
    assert gm.lazy_rescale(True, 32, gm.FP8_PATH_REGS)
    assert not gm.lazy_rescale(True, 8, gm.FP8_PATH_REGS)
    assert not gm.lazy_rescale(True, 16, gm.FP8_PATH_RING)
    assert not gm.lazy_rescale(True, 32, gm.FP8_PATH_RING)
    assert not gm.lazy_rescale(False, 16, gm.FP8_PATH_REGS)
    assert "lazy_rescale" in gm.CFG_KEYS


def _lazy_split(s, v, lo, hi, tile, threshold):
    """The kernel's loop over one split, in PyTorch: scores ``s [n, H]`` in log2 units, values ``v [n, D]``;
    P rounded to fp16 as the kernel stores it; float32 sums. Returns (acc [H, D], l [H], m [H], rescales after
    the first tile, largest P)."""
    h = s.shape[1]
    m = torch.full((h,), float("-inf"))
    acc, l_sum = torch.zeros(h, v.shape[1]), torch.zeros(h)
    moves, largest = 0, 0.0
    for t, a in enumerate(range(lo, hi, tile)):
        st, vt = s[a:min(a + tile, hi)], v[a:min(a + tile, hi)]
        cand = torch.maximum(m, st.max(0).values)
        if bool(((cand - m) > threshold).any()):
            alpha = torch.exp2(m - cand)
            acc, l_sum, m = acc * alpha[:, None], l_sum * alpha, cand
            moves += t > 0
        p = torch.exp2(st - m).to(torch.float16).float()
        largest = max(largest, p.max().item())
        acc, l_sum = acc + p.T @ vt, l_sum + p.sum(0)
    return acc, l_sum, m, moves, largest


@pytest.mark.parametrize("tile", [64, 128])
def test_lazy_rescale_model_equals_softmax(tile):
    """The algorithm the kernel runs with ``LAZY_RESCALE`` (the GPU tests check the kernel itself): per split,
    the running max moves only past ``RESCALE_LOG2``; the splits' stale maxima merge exactly as the merge
    kernel does. Scores drift by 6 per tile and jump by 10-30 mid-split, so the max moves mid-split and stale
    P reaches above 1; P stays <= 2^RESCALE_LOG2 (fp16 holds it) and the result equals the exact softmax
    within fp16 rounding of P."""
    g = torch.Generator().manual_seed(0)
    n, h, d = 3000, 16, 32
    s = torch.randn(n, h, generator=g) + torch.arange(n)[:, None] * (6.0 / tile)
    for at, jump in ((900, 10.0), (1500, 30.0), (2200, 20.0)):
        s[at] += jump * torch.rand(h, generator=g)
    v = torch.randn(n, d, generator=g)
    w = torch.softmax(s.double() * math.log(2), 0)  # exp2 softmax over the tokens
    want = (w.T @ v.double()).float()  # [H, D]
    for splits in (1, 7, 32):
        per_split = -(-n // splits)
        chunk = -(-per_split // tile) * tile  # the kernel's split length: a whole number of tiles
        parts = [_lazy_split(s, v, lo, min(lo + chunk, n), tile, gm.RESCALE_LOG2) for lo in range(0, n, chunk)]
        big_m = torch.stack([m for _, _, m, _, _ in parts]).max(0).values
        scale = [torch.exp2(m - big_m) for _, _, m, _, _ in parts]
        acc = sum(a * c[:, None] for (a, _, _, _, _), c in zip(parts, scale))
        l_sum = sum(lo_sum * c for (_, lo_sum, _, _, _), c in zip(parts, scale))
        got = acc / l_sum[:, None]
        largest = max(lg for *_, lg in parts)
        assert largest <= 2.0 ** gm.RESCALE_LOG2, splits
        if chunk > tile:  # splits of several tiles: the lazy branch ran mid-split, under a stale max too
            assert sum(mv for *_, mv, _ in parts) > 0 and largest > 1.0, splits
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 2.0 ** -9, (splits, err)


def test_heads_per_program_is_a_valid_wgmma_n():
    for h in range(1, 129):
        nh = mla_routing.wgmma_heads_per_program(h)
        assert nh % 8 == 0 and 8 <= nh <= 32
        assert nh >= min(h, 32)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [1, 8, 16, 32, 128])
@pytest.mark.parametrize("batch", [1, 33])
def test_gpu_only_matches_fp32_reference(kv, heads, batch):
    cache, meta, q_latent, q_rope, scale = _batch(batch, kv, heads, "cuda", block_size=64, seed=heads + batch)
    shape = mla_routing.MLAShape(batch, heads, 512, 64, meta.max_seq_len, "bfloat16", kv)
    assert mla_routing.wgmma_accepts(shape, None)
    err = _check(q_latent, q_rope, cache, meta, scale)
    assert err <= BOUND, (kv, heads, batch, err)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("peaked", [False, True], ids=["flat", "peaked"])
def test_gpu_only_splits_agree_with_one_split_tightly(kv, peaked):
    """Split-K against the kernel's own unsplit result at 2**-7 of max|out| (one bf16 ulp of output rounding
    is 2**-8): a token dropped or counted twice at a split boundary moves a 1000-token output by ~1%, which
    the 2**-6 reference bound could miss. ``peaked``: the query x 16, so the running max changes across
    tiles and a few tokens dominate."""
    cache, meta, q_latent, q_rope, scale = _batch(6, kv, 16, "cuda", block_size=16, seed=21)
    if peaked:
        q_latent, q_rope = q_latent * 16, q_rope * 16
    one = gm.mla_decode_wgmma(q_latent, q_rope, cache, meta, scale, 192 ** -0.5, num_splits=1).float()
    for splits in (2, 7, 32):
        got = gm.mla_decode_wgmma(q_latent, q_rope, cache, meta, scale, 192 ** -0.5, num_splits=splits).float()
        assert ((got - one).abs().max() / one.abs().max()).item() <= 2.0 ** -7, (kv, peaked, splits)
    assert _check(q_latent, q_rope, cache, meta, scale) <= BOUND


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [8, 16, 32])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_gpu_only_running_max_jumps_mid_sequence(kv, heads, lazy):
    """Lazy rescaling (``RESCALE_LOG2`` = 8). Scores in log2 units, per head (checked on CPU for the
    1000- and 3000-token sequences): at most ~2.5 over the first third; one token at a third of the sequence
    scores 6.5-18 (some head grew by more than 8: the running max moves and acc is rescaled), one at half
    scores 9-26 (growth of 2.5-8, near the threshold) and one at two thirds 12-37 (moves again). A missed
    rescale or two maxima mixed would weight tokens wrongly by up to 2^15; held to the float32 reference,
    unsplit and split; lazily and eagerly (``cfg["lazy_rescale"]``) at 8 and 16 heads (4 warps) and 32 (8
    warps, 128-token tiles; rescales mid-split there too, checked in a CPU model), both cache kinds."""
    cache, meta, q_latent, q_rope, _ = _batch(6, kv, heads, "cuda", block_size=16, seed=5)
    scale = torch.tensor([0.05 if kv.startswith("fp8") else 1.0], device="cuda")  # fp8: 240 v fits e4m3
    g = torch.Generator().manual_seed(5)
    r, p = mla_routing.LATENT_DIM, mla_routing.ROPE_DIM
    v = torch.ones(r) / r ** 0.5  # every head's query gets v: q.c grows with c's v component
    q_latent = (q_latent.float().cpu() + v).to(q_latent.dtype).cuda()
    tables, bs = meta.block_tables.cpu().long(), cache.shape[1]
    for i, n in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(n)
        beta = 40.0 * pos / n  # x (softmax scale x log2 e = 0.104): +4 log2 over the sequence
        for at, jump in ((n // 3, 120.0), (n // 2, 170.0), (2 * n // 3, 240.0)):
            beta[at] = jump
        latent = torch.randn(n, r, generator=g) * 0.5 + beta[:, None] * v
        slots = tables[i, pos // bs] * bs + pos % bs
        ref.write_mla_cache(latent.cuda(), torch.randn(n, p, generator=g).cuda(), cache, slots.cuda(), scale)
    for splits in (1, 7, None):
        err = _check(q_latent, q_rope, cache, meta, scale, num_splits=splits, cfg={"lazy_rescale": lazy})
        assert err <= BOUND, (kv, heads, lazy, splits, err)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [17, 32, 128])
@pytest.mark.parametrize("batch", [1, 33])
def test_gpu_only_eight_warps_128_token_tiles(kv, heads, batch):
    """The fp8 register path at 32 heads per program: 8 warps, 128-token tiles (two warpgroups split the
    tile's tokens in the score product and the latent rows in ``P x V``), the default there. Against the
    float32 reference; 17 heads pads a 32-head program; forced splits and block sizes 1 and 64 on the long
    sequences."""
    cache, meta, q_latent, q_rope, scale = _batch(batch, kv, heads, "cuda", block_size=16, seed=heads + batch + 7)
    assert gm.default_num_warps(True, mla_routing.wgmma_heads_per_program(heads)) == 8
    err = _check(q_latent, q_rope, cache, meta, scale)
    assert err <= BOUND, (kv, heads, batch, err)
    if batch > 1 and heads == 32:
        for bs in (1, 64):
            cache, meta, q_latent, q_rope, scale = _batch(6, kv, heads, "cuda", block_size=bs, seed=bs)
            for splits in (1, 7, mla_routing.WGMMA.splits.max_splits):
                err = _check(q_latent, q_rope, cache, meta, scale, num_splits=splits)
                assert err <= BOUND, (kv, bs, splits, err)
                err = _check(q_latent, q_rope, cache, meta, scale, num_splits=splits, cfg={"lazy_rescale": False})
                assert err <= BOUND, (kv, bs, splits, "eager", err)


@needs_gluon
@pytest.mark.gpu
def test_gpu_only_tokens_past_the_last_sequence_are_untouched():
    cache, meta, q_latent, q_rope, scale = _batch(4, "bfloat16", 16, "cuda", block_size=16, seed=4)
    ql = torch.cat([q_latent, q_latent[:2]])  # two padding tokens past query_start_loc[num_seqs]
    qr = torch.cat([q_rope, q_rope[:2]])
    out = torch.full_like(ql, float("nan"))
    gm.mla_decode_wgmma(ql, qr, cache, meta, scale, 192 ** -0.5, out=out)
    assert torch.isfinite(out[:4]).all() and torch.isnan(out[4:]).all()


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_gpu_only_forced_splits_and_block_sizes(kv):
    for bs in (1, 16, 64):
        cache, meta, q_latent, q_rope, scale = _batch(6, kv, 16, "cuda", block_size=bs, seed=bs)
        for splits in (1, 2, 7, 32, mla_routing.WGMMA.splits.max_splits):  # the most: most empty (lengths <= 3000)
            err = _check(q_latent, q_rope, cache, meta, scale, num_splits=splits)
            assert err <= BOUND, (kv, bs, splits, err)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [8, 16, 32])
@pytest.mark.parametrize("path", [gm.FP8_PATH_RING, gm.FP8_PATH_REGS])
def test_gpu_only_every_fp8_staging_path(kv, heads, path):
    """fp8 rows through an fp8 shared-memory ring or through registers: same answer, with forced splits
    too. Block size 16 and lengths 1-3000 put tile boundaries inside pages and pages inside tiles."""
    cache, meta, q_latent, q_rope, scale = _batch(33, kv, heads, "cuda", block_size=16, seed=7)
    for splits in (None, 3):
        err = _check(q_latent, q_rope, cache, meta, scale, num_splits=splits, cfg={"fp8_path": path})
        assert err <= BOUND, (kv, heads, path, splits, err)


@needs_gluon
@pytest.mark.gpu
def test_gpu_only_fp16_query_over_fp16_cache_and_empty_query_sequences():
    cache, meta, q_latent, q_rope, scale = _batch(5, "float16", 16, "cuda", block_size=64, model="float16")
    assert _check(q_latent, q_rope, cache, meta, scale) <= BOUND
    # a sequence with no new token this step: its program returns, the others are unchanged
    qsl = torch.tensor([0, 1, 1, 2, 3, 4], dtype=torch.int32, device="cuda")
    meta2 = type(meta)(qsl, meta.seq_lens, meta.block_tables, meta.slot_mapping[:4], 1, meta.max_seq_len,
                       meta.block_size)
    want = ref.mla_decode(q_latent[:4].float(), q_rope[:4].float(), cache, meta2, scale, 192 ** -0.5)
    got = gm.mla_decode_wgmma(q_latent[:4], q_rope[:4], cache, meta2, scale, 192 ** -0.5)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= BOUND


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_gpu_only_cuda_graph_replay_with_new_lengths_and_tables(kv):
    """What the engine's decode graphs do: capture once with the pinned split count, then change the
    sequence lengths and block tables in place and replay; every replay matches the reference."""
    from kvforge.attention.routing.platform import Device
    from kvforge.kernels.triton_mla_decode import mla_decode

    heads, batch = 16, 8
    cache, meta, q_latent, q_rope, scale = _batch(batch, kv, heads, "cuda", block_size=16, seed=3)
    max_len = int(meta.block_tables.shape[1]) * 16
    device = Device(torch.cuda.get_device_properties(0).multi_processor_count, gluon=True)
    splits = mla_routing.pinned_splits(batch, heads, 512, 64, max_len, "bfloat16", kv, None, device)
    out = torch.full_like(q_latent, float("nan"))
    seq_lens = meta.seq_lens.clone()
    tables = meta.block_tables.clone()
    graph_meta = type(meta)(meta.query_start_loc, seq_lens, tables, meta.slot_mapping, 1, max_len, 16)
    mla_decode(q_latent, q_rope, cache, graph_meta, scale, 192 ** -0.5, num_splits=splits, out=out)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_decode(q_latent, q_rope, cache, graph_meta, scale, 192 ** -0.5, num_splits=splits, out=out)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        perm = torch.randperm(batch, generator=gen)
        donor_lens = meta.seq_lens.cpu()[perm]  # rows past a donor's length hold NaN: stay within them
        new_lens = (torch.rand(batch, generator=gen) * donor_lens).ceil().clamp(min=1).to(torch.int32)
        seq_lens.copy_(new_lens)
        tables.copy_(meta.block_tables[perm.to(tables.device)])
        out.fill_(float("nan"))
        g.replay()
        want_meta = type(meta)(meta.query_start_loc, new_lens.cuda(), tables.clone(), meta.slot_mapping, 1,
                               max_len, 16)
        want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, want_meta, scale, 192 ** -0.5)
        assert torch.isfinite(out).all()
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err <= BOUND, (kv, err)


@pytest.mark.skipif(not tmd.HAS_TRITON, reason="needs triton (OutOfResources)")
@pytest.mark.parametrize("heads,want", [(16, ["fp8_e4m3", None]), (8, ["fp8_e4m3", None]), (17, [])])
def test_e4m3_query_out_of_resources_retries_the_exact_query_on_the_wgmma_kernel(monkeypatch, heads, want):
    """Where the fp8 score product cannot run (here: it runs out of resources), the declared e4m3 query at up
    to 16 heads falls back to the model-dtype query on the wgmma kernel, not to the tl.dot kernel's slower fp8
    regime. Kernels replaced by recorders (CPU)."""
    from triton.runtime.errors import OutOfResources

    from kvforge.attention.metadata import AttentionMetadata

    calls = []

    def wgmma(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits, out, query_dtype):
        calls.append(query_dtype)
        if query_dtype is not None:
            raise OutOfResources(1, 0, "shared memory")
        return out

    from kvforge.attention.routing.platform import Device

    monkeypatch.setattr(tmd, "_WGMMA_OUT_OF_RESOURCES", set())
    monkeypatch.setattr(tmd, "routing_device", lambda t: Device(132, gluon=True))
    monkeypatch.setattr(tmd.gluon_mla_decode, "mla_decode_wgmma", wgmma)
    q = torch.zeros(2, heads, 512, dtype=BF16)
    meta = AttentionMetadata(torch.arange(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                             torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 1, 1, 16)
    cache = torch.zeros(1, 16, 576, dtype=E4M3)
    if not want:  # above 16 heads the e4m3 query is the tl.dot kernel's (not run here)
        shape = mla_routing.MLAShape(2, heads, 512, 64, 1, "bfloat16", "fp8_e4m3", "fp8_e4m3")
        assert [c.kernel for c in mla_routing.decode_candidates(shape, Device(132, gluon=True))] == ["tl_dot_mla"]
        return
    out = tmd.mla_decode(q, q[..., :64], cache, meta, torch.ones(1), 0.1, query_dtype="fp8_e4m3")
    assert calls == want and out.shape == q.shape
