"""Attention sinks (and windows) in the reference paged attention, and their routing in the planner.

The oracle is written out independently in float64 over un-paged K/V: for
query head ``h`` the weights are ``exp(s_j) / (sum_i exp(s_i) + exp(sink_h))``
over the visible keys ``j`` (causal, optionally the last ``window`` positions),
the sink itself has no value row. The paged reference must match it to float32
accuracy (atol 2e-5, rtol 2e-4) on a mixed batch (decode, short multi-token and
long prefill queries, so both the batched and the per-sequence paths run).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import paged_attention, write_kv_cache
from kvforge.attention.reference_backend import REFERENCE
from kvforge.attention.triton_backend import TRITON_PAGED
from kvforge.errors import PlanError
from kvforge.planner.inputs import CacheConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

# (tokens already cached, new tokens this step)
SEQS = [(0, 1), (20, 1), (47, 3), (0, 30), (33, 21), (5, 12)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _oracle(q, k, v, ctx, scale, window, sinks):
    """q [Lq, Hq, D], k/v [L, Hkv, D] float64; sinks [Hq] float64 or None."""
    lq, hq, _ = q.shape
    length, hkv, _ = k.shape
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    out = torch.zeros(lq, hq, q.shape[2], dtype=torch.float64)
    for t in range(lq):
        p = ctx + t
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(hq):
            s = (kk[lo:p + 1, h] @ q[t, h]) * scale  # [n]
            m = s.max() if sinks is None else torch.maximum(s.max(), sinks[h])
            e = torch.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else torch.exp(sinks[h] - m))
            out[t, h] = (e / den) @ vv[lo:p + 1, h]
    return out


def _case(hkv, group, block_size, cache_dtype, seed, seqs=SEQS):
    g = torch.Generator().manual_seed(seed)
    d = 16
    hq = hkv * group
    lens = [c + n for c, n in seqs]
    nblocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(nblocks) + 3, generator=g).tolist()
    tables = torch.full((len(seqs), max(nblocks) + 1), 1 << 30, dtype=torch.int32)
    cur = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = torch.tensor(perm[cur:cur + nb], dtype=torch.int32)
        cur += nb
    cache = torch.full((len(perm), 2, hkv, block_size, d), float("nan")).to(cache_dtype)
    ks = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=g) for n in lens]
    qs = [torch.randn(n, hq, d, generator=g) for _, n in seqs]
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, n in enumerate(lens) for p in range(n)], dtype=torch.int64)
    one = torch.ones(hkv)
    write_kv_cache(torch.cat(ks), torch.cat(vs), cache, slots, one, one)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens), block_size=block_size,
    )
    stored = [(k.to(cache_dtype).double(), v.to(cache_dtype).double()) for k, v in zip(ks, vs)]
    return torch.cat(qs), cache, meta, qs, stored, qsl


@pytest.mark.parametrize("window", [None, 1, 7, 16])
@pytest.mark.parametrize("hkv,group", [(2, 3), (1, 4), (3, 1)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_and_window_match_float64_formula(window, hkv, group, cache_dtype):
    q, cache, meta, qs, stored, qsl = _case(hkv, group, 8, cache_dtype, seed=hkv * 10 + group)
    scale = 1 / math.sqrt(16)
    # Sinks on both sides of the scores (some heads give most mass to the sink).
    sinks = torch.linspace(-3.0, 4.0, hkv * group)
    got = paged_attention(q, cache, meta, None, None, scale, sliding_window=window, sinks=sinks)
    for i, (c, _) in enumerate(SEQS):
        want = _oracle(qs[i].double(), *stored[i], c, scale, window, sinks.double())
        err = (got[qsl[i]:qsl[i + 1]].double() - want).abs()
        assert bool((err <= 2e-5 + 2e-4 * want.abs()).all()), f"seq {i}: max err {err.max().item():.3g}"
    # The sinks change the result (the test above would notice them missing).
    plain = paged_attention(q, cache, meta, None, None, scale, sliding_window=window)
    assert (plain - got).abs().max().item() > 1e-2


# Decode steps (one new token per sequence): one sequence, equal lengths (no mask), unequal lengths (masked).
DECODE_STEPS = [[(40, 1)], [(29, 1), (29, 1), (29, 1)], [(0, 1), (20, 1), (47, 1), (8, 1)]]


@pytest.mark.parametrize("window", [None, 1, 7, 16])
@pytest.mark.parametrize("seqs", DECODE_STEPS, ids=["one", "equal", "unequal"])
def test_sinks_and_window_in_decode_steps(window, seqs):
    q, cache, meta, qs, stored, qsl = _case(2, 3, 8, torch.float32, seed=len(seqs), seqs=seqs)
    sinks = torch.linspace(-3.0, 4.0, 6)
    got = paged_attention(q, cache, meta, None, None, 0.25, sliding_window=window, sinks=sinks)
    for i, (c, _) in enumerate(seqs):
        want = _oracle(qs[i].double(), *stored[i], c, 0.25, window, sinks.double())
        err = (got[qsl[i]:qsl[i + 1]].double() - want).abs()
        assert bool((err <= 2e-5 + 2e-4 * want.abs()).all()), f"seq {i}: max err {err.max().item():.3g}"


def test_very_negative_sinks_are_plain_softmax():
    q, cache, meta, *_ = _case(2, 2, 8, torch.float32, seed=3)
    got = paged_attention(q, cache, meta, None, None, 0.25, sinks=torch.full((4,), -1e4))
    plain = paged_attention(q, cache, meta, None, None, 0.25)
    assert (got - plain).abs().max().item() < 1e-6


def test_sinks_shape_checked():
    q, cache, meta, *_ = _case(2, 2, 8, torch.float32, seed=3)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention(q, cache, meta, None, None, 0.25, sinks=torch.zeros(3))


def test_planner_never_routes_sinks_to_a_backend_without_them():
    gpt_oss = spec_from_hf_config(PRESETS["gpt-oss-20b"], name="gpt-oss-20b", source="test")
    assert all(layer.sinks for layer in gpt_oss.layers)
    assert REFERENCE.sinks and TRITON_PAGED.sinks
    for kv in ("bfloat16", "fp8_e4m3"):
        plan = resolve(gpt_oss, CacheConfig(kv_cache_dtype=kv), platform="cuda")
        assert {layer.backend for layer in plan.layers} == {"triton_paged"}
        assert all(layer.sinks for layer in plan.layers)  # the plan tells the backend (CUDA-graph splits)
    plan = resolve(gpt_oss, CacheConfig(kv_cache_dtype="bfloat16"), platform="cpu")
    assert {layer.backend for layer in plan.layers} == {"torch_reference"}
    no_sinks = dataclasses.replace(TRITON_PAGED, sinks=False)
    plan = resolve(gpt_oss, CacheConfig(kv_cache_dtype="bfloat16"), platform="cuda", backends=(no_sinks, REFERENCE))
    assert {layer.backend for layer in plan.layers} == {"torch_reference"}
    gemma = spec_from_hf_config(PRESETS["gemma-3-1b"], name="gemma-3-1b", source="test")
    assert not any(layer.sinks for layer in gemma.layers)
    plan = resolve(gemma, CacheConfig(kv_cache_dtype="bfloat16"), platform="cuda")
    assert {layer.backend for layer in plan.layers} == {"triton_paged"}
    assert not any(layer.sinks for layer in plan.layers)
    with pytest.raises(PlanError, match="attention sinks not supported"):
        resolve(gpt_oss, CacheConfig(kv_cache_dtype="bfloat16"), platform="cuda", backends=(no_sinks,))
