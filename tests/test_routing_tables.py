"""The routing tables (kvforge/attention/routing/): the decisions themselves, on CPU, as pure functions of
integers and dtype names, and the tables walked against the backend declarations so the two cannot drift.

Expected numbers are hand-computed from the rules stated in each test (132 SMs, an H100/H200, unless
said otherwise); tests/test_routing_pinned.py holds every launch to the one before the tables existed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.attention.routing import mla, paged
from kvforge.attention.routing.platform import Device, gluon_enabled
from kvforge.attention.routing.split_k import SplitRule
from kvforge.attention.triton_backend import TRITON_PAGED
from kvforge.attention.triton_mla_backend import TRITON_MLA
from kvforge.env import read_env, switch_is_on

H200 = Device(num_sms=132, gluon=True)
NO_GLUON = Device(num_sms=132, gluon=False)
ROOT = Path(__file__).resolve().parents[1]


# ---- the tables are torch-free -------------------------------------------------------------------------


def test_tables_and_declarations_import_without_torch():
    code = ("import sys; import kvforge.attention.routing.paged, kvforge.attention.routing.mla, "
            "kvforge.attention.routing.torch_backends, kvforge.planner.registry as r; r.builtin_backends(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stderr


# ---- the tables against the declarations ---------------------------------------------------------------


def test_mla_declaration_is_the_tables_quantized_query():
    """The e4m3 query is declared exactly where the warp-specialized kernel runs its fp8 score product."""
    rule, q = mla.QUANTIZED_QUERY, TRITON_MLA.quantized_query
    assert q.kv_dtypes == rule.kv_dtypes == rule.dtypes == frozenset({"fp8_e4m3"})
    assert q.max_heads_per_rank == rule.max_heads == mla.WS.max_heads == mla.FP8_QUERY_MAX_HEADS == 16
    assert q.min_heads_per_rank == 1 and q.model_dtypes == rule.model_dtypes == mla.WS.model_dtypes
    assert q.head_sizes == frozenset({mla.WS.latent_dim + mla.WS.rope_dim}) == frozenset({576})
    assert str(mla.WS_MIN_TOKENS_PER_CTA) in q.note
    # every declared (kv dtype, heads) pair reaches the fp8 score product on a long enough batch
    for heads in range(1, 17):
        shape = mla.MLAShape(8, heads, 512, 64, 1 << 20, "bfloat16", "fp8_e4m3", "fp8_e4m3")
        first = mla.decode_candidates(shape, H200)[0]
        assert (first.kernel, first.query_dtype) == (mla.WS.name, "fp8_e4m3"), heads
    assert not q.accepts("fp8_e4m3", 17, "bfloat16", 576)


def test_mla_tables_cover_the_declaration():
    """Every KV dtype the declaration takes has a kernel (the tl.dot row takes all); the Gluon rows' dtypes
    are among the declared ones."""
    assert mla.TABLE[-1] is mla.TL_DOT and mla.TL_DOT.kv_dtypes is None and mla.TL_DOT.max_heads is None
    for k in mla.TABLE[:-1]:
        assert k.kv_dtypes <= TRITON_MLA.kv_dtypes and k.needs_gluon
    for kv in TRITON_MLA.kv_dtypes:
        for model in ("bfloat16", "float16", "float32"):
            shape = mla.MLAShape(4, 16, 512, 64, 4096, model, kv)
            assert mla.decode_candidates(shape, H200)[-1].kernel == mla.TL_DOT.name


def test_paged_table_against_declaration_and_kernel_constants():
    pytest.importorskip("torch")
    from kvforge.kernels import triton_paged_attention as tpa

    assert paged.TABLE[-1] is paged.TL_DOT
    assert set(tpa.SUPPORTED_HEAD_SIZES) == set(TRITON_PAGED.head_sizes)
    assert TRITON_PAGED.block_sizes.multiple_of == tpa.BLOCK_SIZE_MULTIPLE
    assert not tpa.ACCEPTS_QUANTIZED_QUERY and not TRITON_PAGED.quantized_query.kv_dtypes
    for k in paged.TABLE[:-1]:
        assert k.head_sizes <= TRITON_PAGED.head_sizes and k.kv_dtypes <= TRITON_PAGED.kv_dtypes
    assert set(paged.KERNEL_NAMES) == {"tl_dot", "gluon_fp8_warp1", "gluon_fp8_warp", "gluon_fp8_cta"}
    # the declaration offers sinks exactly when a row of the table serves them, and the tl.dot row (which
    # takes every shape) is one
    assert TRITON_PAGED.sinks == any(k.sinks for k in paged.TABLE) and paged.TL_DOT.sinks


# ---- the split rule ----------------------------------------------------------------------------------------


def test_split_rule():
    ceil = SplitRule(waves=4, min_tokens=256, max_splits=64, round_up=True)
    assert ceil.splits(8, 32768, 132) == 64  # ceil(528 / 8) = 66, capped at 64
    assert ceil.splits(64, 8192, 132) == 9  # ceil(528 / 64)
    assert ceil.splits(64, 1000, 132) == 3  # 1000 // 256
    assert ceil.splits(10_000, 1 << 20, 132) == 1 and ceil.splits(8, 100, 132) == 1
    floor = SplitRule(waves=1, min_tokens=512, max_splits=128, round_up=False)
    assert floor.splits(32, 65536, 132) == 4 and floor.splits(200, 65536, 132) == 1  # floor, at least 1
    assert floor.splits(1, 65536, 132, waves=2) == 128
    small = SplitRule(waves=4, min_tokens=256, max_splits=64, round_up=True, small_grid_waves=2)
    assert small.splits(64, 32768, 132) == 5  # 64 programs <= 132 // 2: ceil(2 x 132 / 64)
    assert small.splits(67, 32768, 132) == 8  # 67 programs > 66: ceil(4 x 132 / 67)
    assert small.splits(64, 32768, 132, waves=4) == 9  # a caller's waves win
    short = SplitRule(waves=4, min_tokens=256, max_splits=64, round_up=True, small_grid_waves=2,
                      small_grid_min_tokens=128)
    assert short.splits(8, 1152, 132) == 9 and small.splits(8, 1152, 132) == 4  # 1152 // 128 against // 256
    assert short.splits(8, 200, 132) == 1  # shorter than two 128-token splits
    assert short.splits(67, 1152, 132) == 4  # 67 programs > 66: 256-token splits again
    wave = SplitRule(waves=2, min_tokens=256, max_splits=256, round_up=False, one_wave_min_tokens=64)
    assert wave.splits(1, 4096, 132) == 64  # max(min(264, 16), min(132, 64))
    assert wave.splits(8, 16384, 132) == 33  # max(min(33, 64), min(16, 256)): two waves of long splits
    assert wave.splits(66, 4096, 132) == 4 and wave.splits(67, 4096, 132) == 3  # no floor past SMs // 2
    assert wave.splits(1, 100, 132) == 1  # shorter than two 64-token splits
    assert SplitRule(4, 256, 64, True, forced="exact").choose(0, 8, 32768, 132) == 1
    assert SplitRule(4, 256, 64, True, forced="exact").choose(100, 8, 32768, 132) == 100  # not capped
    assert SplitRule(4, 256, 32, True, forced="capped").choose(100, 8, 32768, 132) == 32
    assert SplitRule(1, 512, 128, False, forced="or_rule").choose(0, 8, 65536, 132) == 16  # 0: the rule
    assert SplitRule(1, 512, 128, False, forced="or_rule").choose(500, 8, 65536, 132) == 128


# ---- the Triton paged backend ---------------------------------------------------------------------------


def _paged(num_seqs, kv_heads, ctx, *, q_heads=None, head=128, q_len=1, q="bfloat16", kv="fp8_e4m3", window=0):
    return paged.PagedShape(num_seqs, q_heads or 4 * kv_heads, kv_heads, head, q_len, ctx, q, kv, window)


@pytest.mark.parametrize(
    "num_seqs,kv_heads,ctx,forced,expected",
    [
        (64, 8, 8192, None, ("gluon_fp8_warp1", 2)),  # 512 programs >= 99: one warp, floor(8 x 132 / 512) = 2
        (256, 8, 32768, None, ("gluon_fp8_warp1", 1)),  # 2048 programs fill the GPU alone
        (256, 8, 1024, None, ("gluon_fp8_warp1", 1)),  # any context: the row looks at the programs only
        (16, 8, 32768, None, ("gluon_fp8_warp1", 8)),  # 128 programs >= 99: floor(1056 / 128) = 8
        (16, 8, 1024, None, ("gluon_fp8_warp1", 4)),  # 8 > 1024 // 256 = 4 by length
        (13, 8, 1024, None, ("gluon_fp8_warp1", 4)),  # 104 programs >= 99
        (96, 8, 4096, None, ("gluon_fp8_warp1", 1)),  # floor(1056 / 768) = 1: whole programs per SM
        (12, 8, 4096, None, ("gluon_fp8_warp", 4)),  # 96 programs < 99: four warps
        (16, 8, 100, None, ("gluon_fp8_warp1", 1)),  # no split shorter than 256 tokens
        (16, 8, 32768, 3, ("gluon_fp8_warp1", 3)),  # a pinned count replaces the count, not the kernel
        (8, 8, 32768, None, ("gluon_fp8_warp", 5)),  # 64 programs <= 66: ceil(2 x 132 / 64) = 5
        (8, 8, 8192, None, ("gluon_fp8_warp", 5)),  # 5 < 8 by length; 64 x 5 = 320 >= 264: warp
        (2, 32, 8192, None, ("gluon_fp8_warp", 5)),  # 64 programs from 32 KV heads
        (8, 8, 2048, None, ("gluon_fp8_cta", 5)),  # not longer than 2048: cta, ceil(2 x 132 / 64) = 5 < 8
        (1, 8, 8192, None, ("gluon_fp8_cta", 33)),  # 8 x 8 = 64 programs < 264: cta; 8 <= 66: ceil(264 / 8)
        (8, 8, 32768, 3, ("gluon_fp8_warp", 3)),  # a pinned count replaces the count, not the kernel
        (1, 8, 32768, 64, ("gluon_fp8_cta", 64)),  # warp would get 32 splits x 8 = 256 < 264 -> cta
        (1, 8, 32768, 0, ("gluon_fp8_cta", 1)),  # 0 means 1, as on the tl.dot kernel
        (64, 2, 8192, None, ("gluon_fp8_warp1", 8)),  # 128 programs from 2 KV heads: floor(1056 / 128) = 8
    ],
)
def test_paged_gluon_variant_and_splits(num_seqs, kv_heads, ctx, forced, expected):
    r = paged.route(_paged(num_seqs, kv_heads, ctx), H200, forced)
    assert (r.kernel, r.splits) == expected


def test_paged_one_warp_row_leaves_head_256_to_the_four_warp_kernels():
    """Head size 256 is outside the one-warp row's scope (its tile would not fit the registers): a large grid
    of it runs the four-warp kernel, as before the row existed."""
    shape = paged.PagedShape(64, 8, 2, 256, 1, 8192, "bfloat16", "fp8_e4m3")
    assert not paged.applies(paged.GLUON_FP8_WARP1, shape, H200)
    assert (paged.route(shape, H200).kernel, paged.route(shape, H200).splits) == ("gluon_fp8_warp", 5)


@pytest.mark.parametrize(
    "q,kv,head,q_len,group,expected",
    [
        ("bfloat16", "fp8_e4m3", 128, 1, 4, True),
        ("float16", "fp8_e5m2", 64, 1, 16, True),
        ("bfloat16", "fp8_e4m3", 256, 1, 1, True),
        ("bfloat16", "fp8_e4m3", 128, 2, 4, False),  # not a decode batch
        ("bfloat16", "fp8_e4m3", 128, 1, 17, False),  # more than 16 query heads per KV head
        ("bfloat16", "fp8_e4m3", 96, 1, 4, False),  # head size not a Gluon tile
        ("bfloat16", "bfloat16", 128, 1, 4, False),  # not an fp8 cache
        ("float32", "fp8_e4m3", 128, 1, 4, False),  # float32 query keeps IEEE dots
    ],
)
def test_paged_gluon_scope(q, kv, head, q_len, group, expected):
    shape = paged.PagedShape(4, 2 * group, 2, head, q_len, 5000, q, kv)
    assert paged.applies(paged.GLUON_FP8_CTA, shape, H200) is expected
    assert (paged.route(shape, H200).kernel != "tl_dot") is expected
    assert paged.route(shape, NO_GLUON).kernel == "tl_dot"  # the gate closed: always the tl.dot kernel


def test_paged_sinks_go_to_the_tl_dot_kernel():
    """A layer with attention sinks never takes a Gluon row (they add no sink); with or without a window, its
    fp8 decode runs the tl.dot kernel with the tl.dot rule's splits (4 x 132 / (4 x 2) = 66 -> 64 at most,
    5000 // 256 = 19 -> 19; with a 128-token window: 128 // 256 = 0 -> 1)."""
    assert paged.TL_DOT.sinks and not paged.GLUON_FP8_WARP.sinks and not paged.GLUON_FP8_CTA.sinks
    shape = paged.PagedShape(4, 8, 2, 128, 1, 5000, "bfloat16", "fp8_e4m3")
    assert paged.route(shape, H200).kernel == "gluon_fp8_cta"
    with_sinks = paged.PagedShape(4, 8, 2, 128, 1, 5000, "bfloat16", "fp8_e4m3", sinks=True)
    assert not paged.applies(paged.GLUON_FP8_CTA, with_sinks, H200)
    assert (paged.route(with_sinks, H200).kernel, paged.route(with_sinks, H200).splits) == ("tl_dot", 33)
    windowed = paged.PagedShape(4, 8, 2, 128, 1, 5000, "bfloat16", "fp8_e4m3", window=128, sinks=True)
    assert (paged.route(windowed, H200).kernel, paged.route(windowed, H200).splits) == ("tl_dot", 1)  # 128 // 128
    assert paged.route(windowed, H200, 5).splits == 5  # a pinned count as given
    assert paged.route(paged.PagedShape(4, 8, 2, 128, 1, 5000, "bfloat16", "fp8_e4m3", window=128), H200).kernel \
        == "gluon_fp8_cta"  # a window alone stays on the Gluon rows


def test_paged_graph_pinning_with_sinks_is_the_tl_dot_rule():
    for kv in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        for batch in (1, 2, 8, 64, 256):
            shape = paged.PagedShape(batch, 64, 8, 64, 1, 32768, "bfloat16", kv, sinks=True)
            want = paged.route(shape, NO_GLUON).splits
            assert paged.pinned_splits(batch, 64, 8, 64, 32768, "bfloat16", kv, H200, sinks=True) == want
    # e.g. one sequence: ceil(4 x 132 / 8) = 66 -> capped at 64
    assert paged.pinned_splits(1, 64, 8, 64, 32768, "bfloat16", "fp8_e4m3", H200, sinks=True) == 33


def test_paged_tl_dot_tiles_and_splits():
    # decode, GQA 4 (G_PAD 4): 4 tokens x 4 heads = 16 rows, 128-token context tiles, split-K by the rule
    r = paged.route(_paged(2, 8, 40000, kv="bfloat16"), H200)
    assert (r.kernel, r.splits) == ("tl_dot", 17)  # 16 programs <= 66: ceil(264 / 16) = 17 < 40000 // 256
    t = r.tiles
    assert (t.decode_like, t.block_q, t.block_m, t.tile_n, t.num_warps, t.num_stages, t.one_tile) == \
        (True, 4, 16, 128, 4, 3, True)
    # a window shorter than the context bounds the splits: 300 // 128 = 2 (16 programs: a small grid's 128-token
    # splits); from 67 programs up, splits of 256 tokens: 300 // 256 = 1
    assert paged.route(_paged(2, 8, 40000, kv="bfloat16", window=300), H200).splits == 2
    assert paged.route(_paged(9, 8, 40000, kv="bfloat16", window=300), H200).splits == 1
    # prefill (37 tokens, GQA 4): 128-row tiles of 32 tokens, several tiles per sequence, no split-K
    r = paged.route(_paged(2, 8, 200, kv="bfloat16", q_len=37), H200, 7)
    assert r.splits == 1 and (r.tiles.block_q, r.tiles.block_m, r.tiles.tile_n, r.tiles.num_warps) == (32, 128, 64, 8)
    # head size 256: 64-row tiles, 32-token context tiles; GQA 32 over 1 KV head: G_PAD rows at least
    r = paged.route(_paged(2, 1, 200, q_heads=32, head=256, kv="bfloat16", q_len=9), H200)
    assert (r.tiles.block_m, r.tiles.block_q, r.tiles.tile_n) == (64, 2, 32)
    # q_len 2 x G_PAD 4 <= 16 rows: still decode-like, one tile per sequence, split-K allowed
    r = paged.route(_paged(4, 8, 900, kv="bfloat16", q_len=2), H200)
    assert r.tiles.decode_like and r.tiles.one_tile and r.splits == 7  # 32 programs: 900 // 128 < ceil(264 / 32)


def test_paged_graph_pinning_is_the_eager_rule_at_max_model_len():
    for kv in ("bfloat16", "fp8_e4m3"):
        for batch in (1, 2, 8, 64, 256):
            want = paged.route(_paged(batch, 8, 32768, kv=kv), H200).splits
            assert paged.pinned_splits(batch, 32, 8, 128, 32768, "bfloat16", kv, H200) == want


# ---- the Gluon gate ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version,env,expected",
    [
        ("3.6.0", None, True),
        ("3.6.1", "0", True),
        ("3.6.0", "1", False),  # KVFORGE_DISABLE_GLUON=1
        ("3.6.0", "yes", False),
        ("3.6.0", " False ", True),
        ("3.9.0", None, False),  # Gluon's async copy API changed after 3.6
        ("3.5.1", None, False),
        (None, None, False),  # no Triton
    ],
)
def test_gluon_gate(version, env, expected):
    environ = {} if env is None else {"KVFORGE_DISABLE_GLUON": env}
    assert gluon_enabled(version, read_env(environ).disable_gluon) is expected
    assert gluon_enabled(version, switch_is_on(env)) is expected


# ---- the Triton MLA backend ----------------------------------------------------------------------------------


BF16, FP16, F32, E4M3, E5M2 = "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"


@pytest.mark.parametrize(
    "heads,q,cache,query_dtype,r,p,want",
    [
        (16, BF16, BF16, None, 512, 64, True),
        (16, BF16, E4M3, None, 512, 64, True),
        (8, FP16, E5M2, None, 512, 64, True),
        (128, BF16, E4M3, None, 512, 64, True),
        (1, FP16, FP16, None, 512, 64, True),
        (129, BF16, BF16, None, 512, 64, False),  # above the wgmma kernel's 128 heads
        (128, BF16, E4M3, E4M3, 512, 64, False),  # an fp8 query above 16 heads: the tl.dot kernel's fp8 dot
        (17, BF16, E4M3, E4M3, 512, 64, False),
        (16, BF16, E4M3, E4M3, 512, 64, True),
        (1, FP16, E4M3, E4M3, 512, 64, True),
        (16, BF16, E5M2, E4M3, 512, 64, False),  # only over an e4m3 cache
        (16, F32, E4M3, E4M3, 512, 64, False),
        (16, BF16, E4M3, E4M3, 32, 16, False),  # other latent sizes
        (16, F32, F32, None, 512, 64, False),  # float32 models: IEEE dots in the tl.dot kernel
        (16, BF16, F32, None, 512, 64, False),  # a wider cache is never rounded to the query's precision
        (16, BF16, FP16, None, 512, 64, False),  # mixed 16-bit dtypes
        (16, BF16, BF16, None, 32, 8, False),
        (16, BF16, BF16, None, 512, 32, False),
    ],
)
def test_mla_wgmma_scope(heads, q, cache, query_dtype, r, p, want):
    shape = mla.MLAShape(2, heads, r, p, 1000, q, cache, query_dtype)
    assert mla.wgmma_accepts(shape, query_dtype) is want
    kernels = [c.kernel for c in mla.decode_candidates(shape, H200)]
    exact_fallback = query_dtype is not None and heads <= mla.FP8_QUERY_MAX_HEADS and mla.wgmma_accepts(shape, None)
    assert (kernels[0] != mla.TL_DOT.name) is (want or exact_fallback)
    assert [c.kernel for c in mla.decode_candidates(shape, NO_GLUON)] == [mla.TL_DOT.name]
    assert [c.kernel for c in mla.decode_candidates(shape, H200, tl_dot_only=True)] == [mla.TL_DOT.name]


def test_mla_e4m3_query_candidates():
    """Up to 16 heads: the e4m3 query first, then the model-dtype query, on the Gluon kernels, and the
    model-dtype query on the tl.dot kernel; above 16 heads the e4m3 query goes to the tl.dot kernel as such."""
    long = mla.MLAShape(32, 16, 512, 64, 65536, BF16, E4M3, E4M3)
    got = [(c.kernel, c.query_dtype) for c in mla.decode_candidates(long, H200)]
    assert got == [("gluon_mla_ws", E4M3), ("gluon_mla_ws", None), ("tl_dot_mla", None)]
    short = mla.MLAShape(32, 16, 512, 64, 2048, BF16, E4M3, E4M3)  # 4 splits of 512 tokens: not the ws kernel
    got = [(c.kernel, c.query_dtype) for c in mla.decode_candidates(short, H200)]
    assert got == [("gluon_mla_wgmma", E4M3), ("gluon_mla_wgmma", None), ("tl_dot_mla", None)]
    assert [(c.kernel, c.query_dtype) for c in mla.decode_candidates(short, NO_GLUON)] == [("tl_dot_mla", None)]
    wide = mla.MLAShape(32, 32, 512, 64, 65536, BF16, E4M3, E4M3)
    assert [(c.kernel, c.query_dtype) for c in mla.decode_candidates(wide, H200)] == [("tl_dot_mla", E4M3)]
    assert [(c.kernel, c.query_dtype) for c in mla.decode_candidates(short, H200, tl_dot_only=True)] == \
        [("tl_dot_mla", E4M3)]


def test_mla_ws_routing_rule():
    """At least 1024 tokens a CTA (132 SMs): batch 8 needs 16 splits, so 16k; batch 32 (4 splits) 4k;
    batch 128 (1 split) 1k; batch 1 (at most 128 splits) 128k."""
    takes = mla.ws_takes
    assert mla.WS_MIN_TOKENS_PER_CTA == 1024
    assert takes(True, 8, 8, 16384, 132) and not takes(True, 8, 8, 8192, 132)
    assert takes(True, 16, 32, 4096, 132) and not takes(True, 16, 16, 4096, 132)
    assert takes(True, 1, 128, 1024, 132) and not takes(True, 8, 32, 1024, 132)
    assert not takes(True, 8, 1, 65536, 132) and takes(True, 8, 1, 1 << 17, 132)
    assert takes(True, 16, 32, 65536, 132) and not takes(True, 17, 32, 65536, 132)
    assert not takes(False, 8, 32, 65536, 132)  # 16-bit caches stay on the wgmma kernel
    assert [mla.ws_heads_per_program(h) for h in (1, 8, 9, 16)] == [8, 8, 16, 16]


def test_mla_split_rules_hand_counts():
    # warp-specialized: one CTA per SM, whole waves, >= 512 tokens a split, at most 128
    assert mla.ws_splits(8, 8, 65536, 132) == 16 and mla.ws_splits(128, 8, 65536, 132) == 1
    assert mla.ws_splits(32, 5, 4096, 132) == 4 and mla.ws_splits(8, 8, 300, 132) == 1
    assert mla.ws_splits(1, 8, 1 << 20, 132) == 128 and mla.ws_splits(8, 16, 65536, 132, heads_per_program=8) == 8
    # wgmma: 8 sequences x 1 head block -> floor(132 / 8) = 16; 2 programs per SM for fp8 up to 16 heads
    assert mla.wgmma_splits(8, 16, 65536, 132, is_fp8=False) == 16
    assert mla.wgmma_splits(8, 16, 8192, 132, is_fp8=True) == min(33, 8192 // 256)
    assert mla.wgmma_splits(1, 16, 65536, 132, is_fp8=True) == 256  # 264 programs, capped at 256
    assert mla.wgmma_splits(1, 16, 65536, 132, is_fp8=False) == 132
    assert mla.wgmma_splits(8, 128, 65536, 132, is_fp8=True) == 132 // 32  # 4 blocks of 32, one per SM
    # small grids keep one wave of splits down to 64 tokens: 1000 // 64 = 15 where 1000 // 256 = 3
    assert mla.wgmma_splits(1, 16, 1000, 132, is_fp8=False) == 15
    assert mla.wgmma_splits(1, 16, 4096, 132, is_fp8=True) == 64  # max(min(264, 16), min(132, 64))
    assert mla.wgmma_splits(4, 16, 8192, 132, is_fp8=True) == 33  # max(min(66, 32), min(33, 128))
    assert mla.wgmma_splits(8, 16, 16384, 132, is_fp8=True) == 33  # the second wave wins: min(33, 64)
    assert mla.wgmma_splits(67, 16, 65536, 132, is_fp8=False) == 1  # 67 programs > 66: no floor
    assert mla.wgmma_splits(1, 16, 65536, 132, is_fp8=True, fp8_in_registers=False) == 132
    assert [mla.wgmma_heads_per_program(h) for h in (1, 8, 9, 16, 17, 32, 128)] == [8, 8, 16, 16, 32, 32, 32]
    # tl.dot: 16 heads per program / 4 per SM up to 16 heads, then 32 / 2, 64 / 2; ceil, at most 32
    assert mla.tl_dot_splits(8, 16, 65536, 132) == 32  # ceil(528 / 8) = 66 -> 32
    assert mla.tl_dot_splits(64, 16, 65536, 132) == 9  # ceil(528 / 64)
    assert mla.tl_dot_splits(8, 128, 65536, 132) == 17  # 2 blocks of 64 heads, 2 per SM: ceil(264 / 16)
    assert mla.tl_dot_splits(3, 16, 300, 132) == 1
    assert mla.tl_dot_splits(3, 16, 300, 132, forced=0) == 1 and mla.tl_dot_splits(3, 16, 300, 132, forced=99) == 32


def test_mla_graph_pinning_is_the_first_candidate():
    for kv in (BF16, E4M3, E5M2):
        for heads in (1, 8, 16, 17, 128):
            for batch in (1, 8, 128):
                for device in (H200, NO_GLUON, Device(78, True)):
                    shape = mla.MLAShape(batch, heads, 512, 64, 65536, BF16, kv)
                    want = mla.decode_candidates(shape, device)[0].splits
                    assert mla.pinned_splits(batch, heads, 512, 64, 65536, BF16, kv, None, device) == want


def test_mla_prefill_path():
    """Per sequence of a step with a prefill chunk: "auto" absorbs a prefilling sequence of at most
    ABSORBED_PREFILL_MAX_SEQ_LEN tokens (prefix included) and sends a longer one through SDPA; "sdpa" sends
    every prefilling sequence there; under both a decoding sequence (one query token) is absorbed, however
    long; "absorbed" and "expanded" take every sequence; a bad mode is refused."""
    bound = mla.ABSORBED_PREFILL_MAX_SEQ_LEN
    assert mla.sequence_paths("auto", [8], [bound]) == ["absorbed"]
    assert mla.sequence_paths("auto", [8], [bound + 1]) == ["sdpa"]
    assert mla.sequence_paths("auto", [8, 1], [100, 5 * bound]) == ["absorbed", "absorbed"]
    assert mla.sequence_paths("auto", [1, 2, 9], [10, bound + 1, 50]) == ["absorbed", "sdpa", "absorbed"]
    assert mla.sequence_paths("sdpa", [1, 2, 9], [5 * bound, 16, 50]) == ["absorbed", "sdpa", "sdpa"]
    for forced in ("absorbed", "expanded"):
        assert mla.sequence_paths(forced, [8, 1], [bound + 1, 16]) == [forced, forced]
    assert mla.check_prefill_mode(" Absorbed ") == "absorbed" and mla.check_prefill_mode("SDPA") == "sdpa"
    with pytest.raises(ValueError, match="choose one of auto, expanded, absorbed, sdpa"):
        mla.check_prefill_mode("sometimes")


# ---- the tables name real code, and the doc is the tables ---------------------------------------------------


def test_every_launcher_and_path_exists():
    import importlib

    from kvforge.attention.routing import torch_backends

    names = [k.launcher for k in paged.TABLE + mla.TABLE]
    names += [r.runs for r in torch_backends.TORCH_REFERENCE + torch_backends.MLA_REFERENCE + torch_backends.RING]
    for name in names:
        module, attr = name.split(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert callable(obj), name


def test_routing_doc_is_rendered_from_the_tables():
    from kvforge.attention.routing.render import render_markdown

    doc = (ROOT / "docs" / "ROUTING.md").read_text()
    assert doc == render_markdown(), "regenerate: python -m kvforge.attention.routing.render > docs/ROUTING.md"


# ---- the backend objects ---------------------------------------------------------------------------------------


def test_every_declared_backend_has_one_registered_object():
    """Each built-in declaration names a module that registers exactly its object; the CUDA-graph hook and
    capture flag belong to the Triton backends, and a name registered twice is refused."""
    pytest.importorskip("torch")
    from kvforge.attention.backends.base import (
        SUPPORTED_ATTENTION_BACKENDS,
        AttentionBackend,
        BackendOptions,
        backend_class,
        register_backend,
    )
    from kvforge.planner.registry import builtin_backends

    options = BackendOptions(softmax_scale=0.1, model_dtype="bfloat16", device=H200, latent_dim=512)
    for decl in builtin_backends():
        cls = backend_class(decl)
        assert issubclass(cls, AttentionBackend) and cls.declaration is decl
        assert SUPPORTED_ATTENTION_BACKENDS[decl.name] is cls
        assert cls.captures_cuda_graphs == (decl.name in ("triton_paged", "triton_mla")), decl.name
        obj = cls(options)
        assert obj.name == decl.name
    with pytest.raises(ValueError, match="registered twice"):
        register_backend(type("Again", (AttentionBackend,), {"declaration": builtin_backends()[0]}))


def test_paged_row_tilings_name_launcher_keys():
    """A row's ``tiling`` reaches the Gluon launcher, which rejects unknown keys: every key must be one."""
    from kvforge.kernels.gluon_fp8_decode import TILING_KEYS

    for row in paged.TABLE:
        assert {key for key, _ in row.tiling} <= TILING_KEYS, row.name
    assert dict(paged.GLUON_FP8_WARP1.tiling)["warps"] == 1
    shape = paged.PagedShape(256, 32, 8, 128, 1, 1024, "bfloat16", "fp8_e4m3")
    assert paged.route(shape, H200).tiling == paged.GLUON_FP8_WARP1.tiling  # the route carries its row's tiles
