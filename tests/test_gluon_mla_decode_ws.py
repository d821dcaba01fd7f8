"""The warp-specialized fp8 MLA decode (kvforge/kernels/gluon_mla_decode_ws.py; its routing and split rules
are tested in tests/test_routing_tables.py): on an sm_90 GPU, its output against the float32 reference over the dequantized cache
(bound 2**-6 of max|ref|, as for the wgmma kernel) for e4m3/e5m2, 1-16 heads (8- and 16-head programs), block sizes 1/16/64, forced
and default splits, peaked scores (lazy and eager rescaling), sequences with no new token, and CUDA-graph
replay through the engine's entry point with the pinned split count."""

from __future__ import annotations

import pytest
import torch
from test_triton_mla import _batch
from triton_kernel_device import GLUON_GPU_ONLY

from kvforge.attention import mla_reference as ref
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels import gluon_mla_decode_ws as ws
from kvforge.kernels.gluon_support import GLUON_ENABLED

needs_gluon = pytest.mark.skipif(
    not (GLUON_ENABLED and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason=GLUON_GPU_ONLY,
)
BOUND = 2.0 ** -6
SCALE = 192 ** -0.5


def _ws(q_latent, q_rope, cache, meta, scale, splits=None, fp8_query=False, **cfg):
    splits = splits or mla_routing.ws_splits(meta.num_seqs, q_latent.shape[1], meta.max_seq_len,
                                             torch.cuda.get_device_properties(0).multi_processor_count)  # fmt: skip
    out = torch.full_like(q_latent, float("nan"))
    got = ws.mla_decode_ws(q_latent, q_rope, cache, meta, scale, SCALE, num_splits=splits, out=out, cfg=cfg,
                           fp8_query=fp8_query)  # fmt: skip
    assert got is out and torch.isfinite(got).all()
    return got


def _err(got, q_latent, q_rope, cache, meta, scale):
    want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, SCALE)
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [1, 5, 8, 12, 16])
@pytest.mark.parametrize("batch", [8, 33])
def test_gpu_only_engine_entry_routes_here_and_matches_fp32_reference(kv, heads, batch, monkeypatch):
    from kvforge.kernels.triton_mla_decode import mla_decode

    cache, meta, q_latent, q_rope, scale = _batch(batch, kv, heads, "cuda", block_size=64, seed=heads + batch)
    monkeypatch.setattr(mla_routing, "WS_MIN_TOKENS_PER_CTA", 0)  # the test lengths are <= 3000
    calls = []
    real = ws.mla_decode_ws
    monkeypatch.setattr(ws, "mla_decode_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = mla_decode(q_latent, q_rope, cache, meta, scale, SCALE)
    assert calls == [1]
    assert _err(got, q_latent, q_rope, cache, meta, scale) <= BOUND


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 8, 12, 16])
@pytest.mark.parametrize("long_enough", [True, False], ids=["ws", "short"])
def test_gpu_only_engine_fp8_query_runs_the_fp8_score_product_only_where_ws_routes(heads, long_enough, monkeypatch):
    """``triton_mla_decode.mla_decode(query_dtype="fp8_e4m3")`` (what a plan with the declared e4m3 query
    calls): the warp-specialized kernel's fp8 score product where it routes (within 2^-4 of the exact
    reference, 2^-6 of the e4m3-query one), else the model-dtype query (within 2^-6 of the exact one)."""
    from kvforge.kernels.triton_mla_decode import mla_decode

    cache, meta, q_latent, q_rope, scale = _batch(33, "fp8_e4m3", heads, "cuda", block_size=64, seed=heads)
    if long_enough:
        monkeypatch.setattr(mla_routing, "WS_MIN_TOKENS_PER_CTA", 0)  # the test lengths are <= 3000
    calls = []
    real = ws.mla_decode_ws
    monkeypatch.setattr(ws, "mla_decode_ws", lambda *a, **k: calls.append(k["fp8_query"]) or real(*a, **k))
    got = mla_decode(q_latent, q_rope, cache, meta, scale, SCALE, query_dtype="fp8_e4m3")
    assert calls == ([True] if long_enough else [])
    err = _err(got, q_latent, q_rope, cache, meta, scale)
    assert err <= (2.0 ** -4 if long_enough else BOUND), err


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [8, 16])
def test_gpu_only_forced_splits_and_block_sizes(kv, block_size, heads):
    """Lengths 1-3000 with 1-128 splits: empty consumers (one tile, or none) and tile boundaries inside pages
    and pages inside tiles; batch 6, called directly; 8 and 16 heads per program."""
    cache, meta, q_latent, q_rope, scale = _batch(6, kv, heads, "cuda", block_size=block_size, seed=block_size)
    for splits in (1, 2, 7, 32, mla_routing.WS.splits.max_splits):
        got = _ws(q_latent, q_rope, cache, meta, scale, splits)
        assert _err(got, q_latent, q_rope, cache, meta, scale) <= BOUND, (kv, block_size, splits)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"stages": 2}, {"stages": 3}, {"nh": 8}], ids=["stages2", "stages3", "two_blocks"])
def test_gpu_only_ring_depths_and_head_blocks(cfg):
    """A 2- and 3-stage ring (the release-before-wait order must not deadlock at 2) and two 8-head programs
    per sequence at 16 heads (the head-block grid axis and partial index)."""
    cache, meta, q_latent, q_rope, scale = _batch(8, "fp8_e4m3", 16, "cuda", block_size=16, seed=9)
    nh = cfg.get("nh")
    splits = mla_routing.ws_splits(8, 16, meta.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count,
                                   nh)  # fmt: skip
    for forced in (splits, 1, 7):
        got = _ws(q_latent, q_rope, cache, meta, scale, forced, **cfg)
        assert _err(got, q_latent, q_rope, cache, meta, scale) <= BOUND, (cfg, forced)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("heads", [5, 8, 12, 16])
def test_gpu_only_fp8_score_product(kv, block_size, heads):
    """``fp8_score``: the query quantized to e4m3 per head in the kernel, the score product an fp8 ``wgmma``
    on the ring tile in shared memory. Forced splits 1-128, a 2-stage ring, padded head blocks, peaked scores
    (split against unsplit within 2**-7)."""
    cache, meta, q_latent, q_rope, scale = _batch(6, kv, heads, "cuda", block_size=block_size, seed=heads)

    def quantized(ql, qr):  # the kernel's query rounding, in PyTorch, in float32
        return ref.round_query_e4m3(ql.float(), qr.float())

    errs, errs_q = [], []
    for splits in (None, 1, 7, mla_routing.WS.splits.max_splits):
        got = _ws(q_latent, q_rope, cache, meta, scale, splits, fp8_query=True)
        errs.append(_err(got, q_latent, q_rope, cache, meta, scale))
        errs_q.append(_err(got, *quantized(q_latent, q_rope), cache, meta, scale))
    got = _ws(q_latent, q_rope, cache, meta, scale, 3, fp8_query=True, stages=2)
    errs.append(_err(got, q_latent, q_rope, cache, meta, scale))
    errs_q.append(_err(got, *quantized(q_latent, q_rope), cache, meta, scale))
    print("fp8_score errs", kv, block_size, heads, [f"{e:.2e}" for e in errs], [f"{e:.2e}" for e in errs_q])
    assert max(errs_q) <= BOUND, errs_q
    assert max(errs) <= 2.0 ** -4, errs
    q_latent, q_rope = q_latent * 16, q_rope * 16
    one = _ws(q_latent, q_rope, cache, meta, scale, 1, fp8_query=True).float()
    assert _err(one, *quantized(q_latent, q_rope), cache, meta, scale) <= BOUND
    for splits in (2, 7, 32):
        got = _ws(q_latent, q_rope, cache, meta, scale, splits, fp8_query=True).float()
        assert ((got - one).abs().max() / one.abs().max()).item() <= 2.0 ** -7, splits


def _rel_l2(got, q_latent, q_rope, cache, meta, scale):
    want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, SCALE)
    return ((got.float() - want).norm() / want.norm()).item()


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3"])
@pytest.mark.parametrize("heads", [5, 8, 16])
def test_gpu_only_two_term_query_is_as_exact_as_the_fp16_product(kv, heads):
    """The bf16 query as two e4m3 terms (the default for bf16 models) against the fp16 product from
    registers and the one-term e4m3 query, each against the float32 reference with the exact query (relative
    L2). Heads of magnitudes 2^-12 .. 2^6, elements spanning 2^-16 .. 1 of their head's largest: two terms
    hold a bf16 query exactly, so their error stays within 2^-7 of the fp16 product's (what is left is the
    fp8 product's coarser accumulation) where one e4m3 term is several times off; forced splits 1, 3 and 7 and a 2-stage ring agree."""
    cache, meta, q_latent, q_rope, scale = _batch(6, kv, heads, "cuda", block_size=16, seed=40 + heads)
    g = torch.Generator(device="cuda").manual_seed(heads)
    head_mag = 2.0 ** torch.randint(-12, 7, (1, heads, 1), device="cuda", generator=g).float()
    spread = 2.0 ** -torch.randint(0, 17, q_latent.shape, device="cuda", generator=g).float()
    q_latent = (q_latent.float() * 5 * head_mag * spread).to(torch.bfloat16)
    q_rope = (q_rope.float() * 5 * head_mag).to(torch.bfloat16)
    assert ws.two_term_capable(q_latent.dtype, cache.dtype) and not ws.two_term_capable(torch.float16, cache.dtype)
    variants = {"registers": dict(two_terms=False), "two_terms": dict(two_terms=True), "e4m3": dict(fp8_query=True)}
    errs = {name: _rel_l2(_ws(q_latent, q_rope, cache, meta, scale, 3, **kw), q_latent, q_rope, cache, meta, scale)
            for name, kw in variants.items()}  # fmt: skip
    print("rel L2", kv, heads, {k: f"{v:.2e}" for k, v in errs.items()})
    # the query is exact, but the fp8 product accumulates with fewer bits than float32: with these peaked
    # scores 3.5e-3 against 1.6e-3 at 16 heads; the bound is an eighth of one e4m3 rounding (2^-4)
    assert errs["two_terms"] <= errs["registers"] + 2.0 ** -7, errs
    assert errs["e4m3"] >= 4 * errs["two_terms"], errs  # the test tells one term from two
    one = _ws(q_latent, q_rope, cache, meta, scale, 1, two_terms=True).float()
    for splits, cfg in ((7, {}), (3, {"stages": 2})):
        got = _ws(q_latent, q_rope, cache, meta, scale, splits, two_terms=True, **cfg).float()
        assert ((got - one).norm() / one.norm()).item() <= 2.0 ** -10, (splits, cfg)


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("heads", [8, 16])
def test_gpu_only_peaked_scores_split_agreement(lazy, heads):
    """The query x 16: the running max moves across tiles and a few tokens dominate. Against the reference
    and, tightly (2**-7), split against unsplit: a token dropped or counted twice at a split or consumer
    boundary moves a 1000-token output by ~1%."""
    cache, meta, q_latent, q_rope, scale = _batch(8, "fp8_e4m3", heads, "cuda", block_size=16, seed=21)
    q_latent, q_rope = q_latent * 16, q_rope * 16
    one = _ws(q_latent, q_rope, cache, meta, scale, 1, lazy=lazy).float()
    assert _err(one, q_latent, q_rope, cache, meta, scale) <= BOUND
    for splits in (2, 7, 32):
        got = _ws(q_latent, q_rope, cache, meta, scale, splits, lazy=lazy).float()
        assert ((got - one).abs().max() / one.abs().max()).item() <= 2.0 ** -7, (lazy, splits)


@needs_gluon
@pytest.mark.gpu
def test_gpu_only_empty_query_sequences_and_tokens_past_the_last_sequence():
    cache, meta, q_latent, q_rope, scale = _batch(9, "fp8_e4m3", 8, "cuda", block_size=16, seed=4)
    # sequence 1 has no new token this step; two padding tokens sit past query_start_loc[num_seqs]
    qsl = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int32, device="cuda")
    meta2 = type(meta)(qsl, meta.seq_lens, meta.block_tables, meta.slot_mapping[:8], 1, meta.max_seq_len,
                       meta.block_size)  # fmt: skip
    ql = torch.cat([q_latent[:8], q_latent[:2]])
    qr = torch.cat([q_rope[:8], q_rope[:2]])
    out = torch.full_like(ql, float("nan"))
    splits = mla_routing.ws_splits(9, 8, meta.max_seq_len, torch.cuda.get_device_properties(0).multi_processor_count)
    ws.mla_decode_ws(ql, qr, cache, meta2, scale, SCALE, num_splits=splits, out=out)
    assert torch.isfinite(out[:8]).all() and torch.isnan(out[8:]).all()
    want = ref.mla_decode(ql[:8].float(), qr[:8].float(), cache, meta2, scale, SCALE)
    assert ((out[:8].float() - want).abs().max() / want.abs().max()).item() <= BOUND


@needs_gluon
@pytest.mark.gpu
@pytest.mark.parametrize("query_dtype", [None, "fp8_e4m3"], ids=["bf16_query", "e4m3_query"])
def test_gpu_only_cuda_graph_replay_with_new_lengths_and_tables(monkeypatch, query_dtype):
    """The engine's decode graphs: capture ``triton_mla_decode.mla_decode`` once with the pinned split count
    (this kernel's rule: fp8, 8 heads, 8 sequences), change lengths and block tables in place, replay; with
    the plan's bf16 and e4m3 query."""
    from kvforge.attention.routing.platform import Device
    from kvforge.kernels.triton_mla_decode import mla_decode

    monkeypatch.setattr(mla_routing, "WS_MIN_TOKENS_PER_CTA", 0)  # the test lengths are <= 3000
    calls = []
    real = ws.mla_decode_ws
    monkeypatch.setattr(ws, "mla_decode_ws", lambda *a, **k: calls.append(k["fp8_query"]) or real(*a, **k))

    heads, batch = 8, 8
    cache, meta, q_latent, q_rope, scale = _batch(batch, "fp8_e4m3", heads, "cuda", block_size=16, seed=3)
    max_len = int(meta.block_tables.shape[1]) * 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = mla_routing.pinned_splits(batch, heads, 512, 64, max_len, "bfloat16", "fp8_e4m3", query_dtype,
                                       Device(sms, gluon=True))  # fmt: skip
    assert splits == mla_routing.ws_splits(batch, heads, max_len, sms)
    out = torch.full_like(q_latent, float("nan"))
    seq_lens, tables = meta.seq_lens.clone(), meta.block_tables.clone()
    graph_meta = type(meta)(meta.query_start_loc, seq_lens, tables, meta.slot_mapping, 1, max_len, 16)
    mla_decode(q_latent, q_rope, cache, graph_meta, scale, SCALE, num_splits=splits, out=out,
               query_dtype=query_dtype)  # compile  # fmt: skip
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_decode(q_latent, q_rope, cache, graph_meta, scale, SCALE, num_splits=splits, out=out,
                   query_dtype=query_dtype)  # fmt: skip
    assert calls == [query_dtype is not None] * 2
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
                               max_len, 16)  # fmt: skip
        assert torch.isfinite(out).all()
        if query_dtype is None:
            assert _err(out, q_latent, q_rope, cache, want_meta, scale) <= BOUND
        else:  # within 2^-6 of the reference fed the query rounded the kernel's way
            rounded = ref.round_query_e4m3(q_latent.float(), q_rope.float())
            assert _err(out, *rounded, cache, want_meta, scale) <= BOUND
