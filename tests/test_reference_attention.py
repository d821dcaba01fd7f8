"""Reference paged attention vs an independent float64 dense causal attention.

The oracle below never touches the paged cache: it keeps each sequence's K/V
un-paged, applies the storage round trip written out independently (cast for
model dtypes; float32 ``x / scale``, clamp to the format max, cast to fp8,
widen, times ``scale`` for fp8), and computes masked softmax attention per
sequence in float64. The paged path must match it to float32 accuracy
(atol 2e-5 / rtol 2e-4 for float32 queries), because both see the exact same
dequantized values; the fp8 rounding itself is bounded in tests/test_fp8.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvforge.attention import reference
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import paged_attention, write_kv_cache

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
GARBAGE_BLOCK = 1 << 30  # unused block-table entries: reading them would crash


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise, in float64, NaN never close.

    (torch.testing.assert_close costs seconds of lazy imports on first use.)
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    ok = err <= atol + rtol * e.abs()
    if not bool(ok.all()):
        bad = int((~ok).sum())
        worst = torch.nan_to_num(err, nan=float("inf")).max().item()
        raise AssertionError(f"{bad}/{ok.numel()} elements differ; max abs error {worst:.3g} "
                             f"(atol {atol}, rtol {rtol})")


def _poison(cache: torch.Tensor) -> None:
    if cache.dtype in FMAX:
        cache.view(torch.uint8).fill_(0x7F)  # NaN in both e4m3fn and e5m2
    else:
        cache.fill_(float("nan"))


def _round_trip(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Independent storage round trip of [L, Hkv, D] -> float64."""
    if dtype not in FMAX:
        return x.to(dtype).to(torch.float64)
    y = (x.to(torch.float32) / scale.view(1, -1, 1)).clamp(-FMAX[dtype], FMAX[dtype])
    return y.to(dtype).to(torch.float64) * scale.to(torch.float64).view(1, -1, 1)


def _dense_reference(q, k, v, ctx, softmax_scale, window):
    """q [Lq, Hq, D], k/v [L, Hkv, D] float64 (full sequence); queries at positions ctx..L-1."""
    lq, hq, _ = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    kk = k.repeat_interleave(group, dim=1)  # head h -> kv head h // group
    vv = v.repeat_interleave(group, dim=1)
    qpos = torch.arange(ctx, ctx + lq, dtype=torch.float64)[:, None]
    kpos = torch.arange(length, dtype=torch.float64)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos >= qpos - (window - 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * softmax_scale
    s = torch.where(visible, s, torch.tensor(-math.inf, dtype=torch.float64))
    w = torch.exp(s - s.max(dim=2, keepdim=True).values)
    w = w / w.sum(dim=2, keepdim=True)
    return torch.einsum("hqk,khd->qhd", w, vv)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: thread-pool overhead dominates (badly so on a loaded CI box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Case:
    q: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    expected: torch.Tensor  # [num_tokens, Hq, D] float64, padding rows zero
    num_real: int


def _build(
    seqs,
    *,
    hkv=3,
    group=3,
    head_dim=16,
    block_size=16,
    cache_dtype=torch.float32,
    scale_scheme="per_tensor",
    window=None,
    q_dtype=torch.float32,
    pad_tokens=2,
    seed=0,
):
    """seqs: list of (context already cached, new tokens this step)."""
    g = torch.Generator().manual_seed(seed)
    hq = hkv * group
    if scale_scheme == "per_head":
        k_scale = torch.empty(hkv).uniform_(0.004, 0.03, generator=g)
        v_scale = torch.empty(hkv).uniform_(0.004, 0.03, generator=g)
    else:
        k_scale = torch.full((hkv,), 0.011)
        v_scale = torch.full((hkv,), 0.007)
    lens = [c + n for c, n in seqs]
    nblocks = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(nblocks) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(nblocks) + 2
    tables = torch.full((len(seqs), width), GARBAGE_BLOCK, dtype=torch.int32)
    cursor = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(perm[cursor:cursor + nb], dtype=torch.int32)
        cursor += nb
    cache = torch.empty(num_blocks, 2, hkv, block_size, head_dim, dtype=cache_dtype)
    _poison(cache)

    def slot(i, p):
        return int(tables[i, p // block_size]) * block_size + p % block_size

    ks = [torch.randn(n, hkv, head_dim, generator=g) * 2.5 for n in lens]
    vs = [torch.randn(n, hkv, head_dim, generator=g) * 2.5 for n in lens]
    qs = [torch.randn(n, hq, head_dim, generator=g).to(q_dtype) for _, n in seqs]

    # Step 1: the earlier context (previous steps), written in shuffled token order with -1 holes.
    rows = [(i, p) for i, (c, _) in enumerate(seqs) for p in range(c)]
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[o] for o in order]
    if rows:
        k1 = torch.stack([ks[i][p] for i, p in rows] + [torch.full((hkv, head_dim), 1e9)])
        v1 = torch.stack([vs[i][p] for i, p in rows] + [torch.full((hkv, head_dim), 1e9)])
        s1 = torch.tensor([slot(i, p) for i, p in rows] + [-1], dtype=torch.int64)
        write_kv_cache(k1, v1, cache, s1, k_scale, v_scale)

    # Step 2: this step's new tokens, flat in sequence order, then padding tokens with slot -1.
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    hd = head_dim
    k2 = torch.cat([ks[i][c:] for i, (c, _) in enumerate(seqs)] + [torch.full((pad_tokens, hkv, hd), 1e9)])
    v2 = torch.cat([vs[i][c:] for i, (c, _) in enumerate(seqs)] + [torch.full((pad_tokens, hkv, hd), 1e9)])
    q = torch.cat(qs + [torch.full((pad_tokens, hq, hd), 3.0, dtype=q_dtype)])
    s2 = [slot(i, p) for i, (c, n) in enumerate(seqs) for p in range(c, c + n)] + [-1] * pad_tokens
    slot_mapping = torch.tensor(s2, dtype=torch.int64)
    write_kv_cache(k2, v2, cache, slot_mapping, k_scale, v_scale)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slot_mapping,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens),
        block_size=block_size,
    )
    softmax_scale = 1.0 / math.sqrt(head_dim)
    expected = torch.zeros(total + pad_tokens, hq, head_dim, dtype=torch.float64)
    for i, (c, _) in enumerate(seqs):
        kd = _round_trip(ks[i], cache_dtype, k_scale)
        vd = _round_trip(vs[i], cache_dtype, v_scale)
        expected[qsl[i]:qsl[i + 1]] = _dense_reference(qs[i], kd, vd, c, softmax_scale, window)
    return Case(q, cache, meta, k_scale, v_scale, expected, total), softmax_scale


def _check(case: Case, softmax_scale, window=None, atol=2e-5, rtol=2e-4, **kw):
    out = torch.full_like(case.q, float("nan"))
    res = paged_attention(
        case.q, case.cache, case.meta, case.k_scale, case.v_scale, softmax_scale,
        sliding_window=window, out=out, **kw,
    )
    assert res is out
    assert torch.isfinite(out).all(), "output not fully written"
    assert torch.all(out[case.num_real:] == 0)
    _close(out.double(), case.expected, atol=atol, rtol=rtol)
    # without `out`: a fresh tensor of q.dtype
    res2 = paged_attention(case.q, case.cache, case.meta, case.k_scale, case.v_scale, softmax_scale,
                           sliding_window=window)
    assert res2.dtype == case.q.dtype
    assert torch.equal(res2, out)
    return out


# Lengths 1, 15, 16, 17, 100 and a longer one; decode, short multi-token (speculative-like), prefill
# from scratch and chunked prefill (context already cached).
MIXED = [(0, 1), (14, 1), (15, 1), (16, 1), (99, 1), (260, 1), (0, 17), (0, 100), (40, 60), (16, 16),
         (5, 3), (31, 2)]
DTYPES = [torch.float32, torch.bfloat16, E4M3, E5M2]


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch(cache_dtype, group, block_size):
    hkv = 3 if group != 4 else 2
    schemes = ["per_tensor", "per_head"] if cache_dtype in FMAX else ["per_tensor"]
    for scheme in schemes:
        case, sm = _build(MIXED, hkv=hkv, group=group, block_size=block_size, cache_dtype=cache_dtype,
                          scale_scheme=scheme, seed=group * 100 + block_size)
        _check(case, sm)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("cache_dtype", [torch.float32, E4M3], ids=str)
def test_sliding_window(window, cache_dtype):
    case, sm = _build(MIXED, cache_dtype=cache_dtype, window=window, scale_scheme="per_head", seed=window)
    _check(case, sm, window=window)


def test_sliding_window_decode_only_skips_blocks():
    # every query far past the window: leading blocks are skipped. The earliest visible key
    # (34 - 20 + 1 = 15) is the last slot of block 0, so an off-by-one in the skip is caught.
    seqs = [(200, 1), (34, 1), (301, 1), (60, 3), (34, 10)]  # (34, 10): the same for the prefill path
    case, sm = _build(seqs, window=20, seed=7, block_size=16)
    _check(case, sm, window=20)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3], ids=str)
def test_bf16_query(cache_dtype):
    case, sm = _build(MIXED, cache_dtype=cache_dtype, q_dtype=torch.bfloat16, seed=11)
    out = _check(case, sm, atol=1e-2, rtol=1e-2)
    assert out.dtype == torch.bfloat16


def test_decode_batch_16_matches():
    seqs = [(int(n), 1) for n in torch.randint(0, 400, (16,), generator=torch.Generator().manual_seed(5))]
    case, sm = _build(seqs, cache_dtype=E4M3, scale_scheme="per_head", seed=5, head_dim=64)
    _check(case, sm)


# Decode steps (one new token per sequence): one sequence and equal lengths take the unmasked exact key
# range, unequal lengths the masked one; lengths at and around block edges.
DECODE_STEPS = [[(40, 1)], [(15, 1)], [(31, 1), (31, 1), (31, 1)], [(0, 1), (14, 1), (15, 1), (16, 1), (99, 1)]]


@pytest.mark.parametrize("window", [None, 1, 9, 16, 40])
@pytest.mark.parametrize("seqs", DECODE_STEPS, ids=["one", "one-edge", "equal", "unequal"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, E4M3], ids=str)
def test_decode_steps(seqs, window, cache_dtype):
    case, sm = _build(seqs, cache_dtype=cache_dtype, window=window, scale_scheme="per_head", seed=len(seqs),
                      pad_tokens=0)
    _check(case, sm, window=window)
    padded, _ = _build(seqs, cache_dtype=cache_dtype, window=window, scale_scheme="per_head", seed=len(seqs))
    _check(padded, sm, window=window)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("seqs", [[(40, 1)], [(31, 1), (31, 1), (31, 1)], [(14, 1), (15, 1)]],
                         ids=["one", "equal", "unequal"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, E4M3], ids=str)
def test_decode_fused_attention_path(monkeypatch, seqs, window, cache_dtype):
    """A decode step whose sequences all see the same keys, over a model-dtype cache without sinks, runs as
    torch's fused attention over the gathered keys (once per call) and matches the float64 dense oracle;
    unequal lengths (a mask) and fp8 caches (per-head scales) keep the batched products."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    case, sm = _build(seqs, cache_dtype=cache_dtype, window=window, scale_scheme="per_head", seed=3,
                      head_dim=64, pad_tokens=0)
    _check(case, sm, window=window)
    fused = cache_dtype not in FMAX and len({c for c, _ in seqs}) == 1
    assert len(calls) == (2 if fused else 0)  # _check attends twice (with and without ``out``)
    if fused:
        length = seqs[0][0] + 1
        assert calls[0] == (len(seqs), 3, min(length, window or length), 64)  # [B, Hkv, visible keys, D]


def test_decode_keys_are_shared_by_calls():
    """``decode_keys`` computed once gives every call the output of computing them in the call."""
    case, sm = _build([(14, 1), (15, 1), (40, 1)], window=9, seed=4, pad_tokens=0)
    keys = reference.decode_keys(case.meta, 9, case.cache.device)
    assert keys is not None and keys.visible is not None
    want = paged_attention(case.q, case.cache, case.meta, None, None, sm, sliding_window=9)
    got = paged_attention(case.q, case.cache, case.meta, None, None, sm, sliding_window=9, decode=keys)
    assert torch.equal(got, want)
    prefill, _ = _build([(0, 3)], seed=4, pad_tokens=0)
    assert reference.decode_keys(prefill.meta, None, prefill.cache.device) is None


def test_paths_agree(monkeypatch):
    """Force every sequence through the batched path, then through the per-sequence chunked path."""
    case, sm = _build(MIXED, cache_dtype=E5M2, scale_scheme="per_head", seed=21)
    windowed, _ = _build(MIXED, cache_dtype=E5M2, scale_scheme="per_head", seed=21, window=9)
    monkeypatch.setattr(reference, "BATCHED_QUERY_LEN", 10**6)
    _check(case, sm)
    _check(windowed, sm, window=9)
    monkeypatch.setattr(reference, "BATCHED_QUERY_LEN", 0)
    monkeypatch.setattr(reference, "SCORE_BUDGET_ELEMS", 9 * 300)  # a few query rows per chunk
    _check(case, sm)
    _check(windowed, sm, window=9)


def test_empty_batch_zeroes_padding():
    cache = torch.zeros(4, 2, 2, 16, 8)
    meta = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        slot_mapping=torch.full((3,), -1, dtype=torch.int64),
        max_query_len=0,
        max_seq_len=0,
        block_size=16,
    )
    q = torch.randn(3, 4, 8)
    out = paged_attention(q, cache, meta, 1.0, 1.0, 0.3, out=torch.full_like(q, float("nan")))
    assert torch.all(out == 0)


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=str)
def test_skipped_slots_leave_cache_untouched(cache_dtype):
    hkv, bs, d = 2, 16, 8
    cache = torch.empty(6, 2, hkv, bs, d, dtype=cache_dtype)
    _poison(cache)
    cache.view(torch.uint8)[2:4] = 0x11 if cache_dtype in FMAX else 0
    before = cache.view(torch.uint8).clone()
    k = torch.randn(5, hkv, d)
    v = torch.randn(5, hkv, d)
    slots = torch.tensor([-1, 33, -1, 40, -1], dtype=torch.int64)  # block 2 offset 1, block 2 offset 8
    write_kv_cache(k, v, cache, slots, 0.01, 0.02)
    after = cache.view(torch.uint8)
    changed = (after != before).reshape(6, 2, hkv, bs, -1).any(dim=-1).nonzero().tolist()
    expect = sorted([b, kv, h, o] for b, o in ((2, 1), (2, 8)) for kv in (0, 1) for h in range(hkv))
    assert sorted(changed) == expect
    fp8 = cache_dtype in FMAX
    for t, (b, o) in ((1, (2, 1)), (3, (2, 8))):
        for kv, x, sc in ((0, k, 0.01), (1, v, 0.02)):
            s32 = torch.full((hkv,), sc if fp8 else 1.0, dtype=torch.float32)
            stored = cache[b, kv, :, o].double() * s32.double()[:, None]
            _close(stored, _round_trip(x[t:t + 1], cache_dtype, s32)[0], atol=0, rtol=0)
    # all -1: nothing at all changes
    write_kv_cache(k, v, cache, torch.full((5,), -1, dtype=torch.int64), 0.01, 0.02)
    assert torch.equal(cache.view(torch.uint8), after)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=str)
def test_write_saturates(cache_dtype):
    hkv, bs, d = 3, 16, 4
    cache = torch.zeros(2, 2, hkv, bs, d, dtype=cache_dtype)
    k = torch.full((2, hkv, d), 1e6)
    k[1] = -1e6
    k[0, 0, 0] = float("inf")
    k[0, 0, 1] = float("nan")
    v = torch.full((2, hkv, d), -1e6)
    write_kv_cache(k, v, cache, torch.tensor([0, 17]), torch.tensor([1.0, 0.5, 2.0]), 1.0)
    c = cache.to(torch.float64)
    assert torch.isfinite(c).all()
    fmax = FMAX[cache_dtype]
    assert c[0, 0, 0, 0].tolist() == [fmax, 0.0, fmax, fmax]
    assert torch.all(c[0, 0, 1:, 0] == fmax)
    assert torch.all(c[1, 0, :, 1] == -fmax)
    assert torch.all(c[0, 1, :, 0] == -fmax) and torch.all(c[1, 1, :, 1] == -fmax)


def test_model_dtype_cache_ignores_scales():
    case, sm = _build([(10, 1), (0, 20)], cache_dtype=torch.bfloat16, seed=3)
    out = paged_attention(case.q, case.cache, case.meta, 123.0, 0.5, sm)
    _close(out.double(), case.expected, atol=2e-5, rtol=2e-4)


def test_argument_errors():
    case, sm = _build([(3, 2)], seed=1)
    with pytest.raises(ValueError):
        paged_attention(case.q, case.cache, case.meta, 1.0, 1.0, sm, sliding_window=0)
    with pytest.raises(ValueError):
        paged_attention(case.q[:, :4], case.cache, case.meta, 1.0, 1.0, sm)
    bad = AttentionMetadata(case.meta.query_start_loc, case.meta.seq_lens, case.meta.block_tables,
                            case.meta.slot_mapping, 2, 5, 32)
    with pytest.raises(ValueError):
        paged_attention(case.q, case.cache, bad, 1.0, 1.0, sm)
    with pytest.raises(IndexError):
        write_kv_cache(torch.zeros(1, 3, 16), torch.zeros(1, 3, 16), case.cache,
                       torch.tensor([case.cache.shape[0] * 16]))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_widening_is_exact(dtype):
    """The fast fp8 -> float32 path agrees with torch's cast on all 256 bit patterns (NaN included)."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(4, 64)
    want = raw.to(torch.float64)
    fin = ~torch.isnan(want)
    # the bit path (CPU default) and the native path (CUDA default; no host sync), from the uint8 storage
    for native in (False, True):
        bits, factor = reference._widen_bits(raw.view(torch.uint8), dtype, native=native)
        got = bits.to(torch.float64) * factor
        assert torch.equal(torch.isnan(got), torch.isnan(want)), native
        assert torch.equal(got[fin], want[fin]), native


def test_host_lists_spare_the_device_read(monkeypatch):
    """With the runner's host copies in the metadata, the reference path never reads
    ``query_start_loc`` / ``seq_lens`` back from the device (a sync per layer on GPU) and gives the
    same output; without them it reads the tensors."""
    import dataclasses

    case, sm = _build(MIXED, cache_dtype=E4M3)
    want = paged_attention(case.q, case.cache, case.meta, case.k_scale, case.v_scale, sm)
    meta = dataclasses.replace(case.meta, host_query_start_loc=tuple(case.meta.query_start_loc.tolist()),
                               host_seq_lens=tuple(case.meta.seq_lens.tolist()))
    reads = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(t):
        reads.append(tuple(t.shape))
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    got = paged_attention(case.q, case.cache, meta, case.k_scale, case.v_scale, sm)
    assert torch.equal(got, want)
    _close(got.double(), case.expected, atol=2e-5, rtol=2e-4)
    assert (case.meta.query_start_loc.shape[0],) not in reads and (case.meta.seq_lens.shape[0],) not in reads
    paged_attention(case.q, case.cache, case.meta, case.k_scale, case.v_scale, sm)
    assert (case.meta.seq_lens.shape[0],) in reads


def test_model_runner_fills_the_host_lists(tmp_path):
    """The runner's metadata carries host copies equal to its device tensors (tiny random Llama, CPU)."""
    pytest.importorskip("transformers")
    from test_engine_vs_hf import _save_hf

    from kvforge import LLM

    _save_hf(tmp_path, "llama3")
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22,
              progress=False, device="cpu")
    _ids, _pos, meta = llm.engine.runner.prepare([([1, 2, 3], 0, [0]), ([4], 5, [1, 2])])
    assert meta.host_query_start_loc == tuple(meta.query_start_loc.tolist()) == (0, 3, 4)
    assert meta.host_seq_lens == tuple(meta.seq_lens.tolist()) == (3, 6)
    assert meta.decode_order is None  # a step with prompt tokens has no decode order
    # A decode step: one token each; the order lists the longest context first, ties in batch order.
    _ids, _pos, meta = llm.engine.runner.prepare(
        [([1], 2, [0]), ([4], 8, [1, 2, 3]), ([5], 3, [4]), ([6], 8, [5, 6, 7])])
    assert meta.seq_lens.tolist() == [3, 9, 4, 9]
    assert meta.decode_order.dtype == torch.int32
    assert meta.decode_order.tolist() == [1, 3, 2, 0]


def test_longest_first_pads_in_order():
    """Padding rows (a CUDA graph's batch beyond the step's sequences) follow the sorted rows in order, so
    every prefix at least the real rows long is a permutation of its indices."""
    lens = np.array([5, 70, 5, 900, 1], dtype=np.int32)
    order = AttentionMetadata.longest_first(lens, 8)
    assert order.dtype == np.int32 and order.tolist() == [3, 1, 0, 2, 4, 5, 6, 7]
    for b in range(5, 9):
        assert sorted(order[:b].tolist()) == list(range(b))
    assert AttentionMetadata.longest_first(np.zeros(0, dtype=np.int32)).tolist() == []
