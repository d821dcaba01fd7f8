"""``mla_prefill_sdpa`` (kvforge/attention/mla_prefill_sdpa.py) against the float32 reference prefill.

A mixed step on CPU: a prefill chunk after a cached prefix, a fresh prompt, a decode row, a sequence with no
query token, and padding tokens. The cache is unused-row NaN everywhere but the written rows, so a read
outside a sequence's blocks would show. float32 inputs must match to 1e-5 of max|ref|. bf16 inputs must
match within 2^-6: bf16 rounds the query, K, V, P and the output at 2^-9 each. fp8 caches are
dequantized like the reference, so both see the same values.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla_prefill_sdpa import mla_prefill_sdpa
from kvforge.attention.mla_reference import mla_prefill, write_mla_cache


def _step(kv_dtype: torch.dtype, scale: float, bs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rank, rope, heads, dn, dv = 64, 16, 4, 24, 20
    seq_lens = [100, 37, 21, 9]  # 30 cached + 70 new; fresh 37; one decode token; none this step
    qlens = [70, 37, 1, 0]
    per = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(per) + 3
    cache = torch.full((num_blocks, bs, rank + rope), float("nan")).to(kv_dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 never used
    tables = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        tables[i, :per[i]] = perm[used:used + per[i]].to(torch.int32)
        used += per[i]
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
        write_mla_cache(torch.randn(n, rank, generator=g), torch.randn(n, rope, generator=g) * 0.5, cache, slots,
                        torch.tensor([scale]))
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    t = qsl[-1] + 2  # two padding tokens
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.full((t,), -1, dtype=torch.int64), max(qlens), max(seq_lens), bs,
                             host_query_start_loc=tuple(qsl), host_seq_lens=tuple(seq_lens))
    q_nope = torch.randn(t, heads, dn, generator=g)
    q_rope = torch.randn(t, heads, rope, generator=g)
    w_uk = torch.randn(heads, dn, rank, generator=g) * 0.15
    w_uv = torch.randn(heads, dv, rank, generator=g) * 0.15
    return cache, meta, q_nope, q_rope, w_uk, w_uv, qsl[-1]


@pytest.mark.parametrize("kv_dtype,scale", [(torch.float32, 1.0), (torch.bfloat16, 1.0),
                                            (torch.float8_e4m3fn, 0.05), (torch.float8_e5m2, 0.05)])
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_sdpa_prefill_equals_the_reference_in_float32(kv_dtype, scale, bs):
    cache, meta, q_nope, q_rope, w_uk, w_uv, real = _step(kv_dtype, scale, bs)
    sc = torch.tensor([scale])
    want = mla_prefill(q_nope, q_rope, cache, meta, sc, 0.11, w_uk, w_uv)
    got = mla_prefill_sdpa(q_nope, q_rope, cache, meta, sc, 0.11, w_uk, w_uv)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all() and torch.all(got[real:] == 0)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert want[:real].abs().sum(-1).gt(0).all()  # every real token attended to something


def test_sdpa_prefill_in_bf16_within_rounding():
    cache, meta, q_nope, q_rope, w_uk, w_uv, real = _step(torch.float8_e4m3fn, 0.05, 16, seed=1)
    sc = torch.tensor([0.05])
    want = mla_prefill(q_nope, q_rope, cache, meta, sc, 0.11, w_uk, w_uv)  # float32 throughout
    got = mla_prefill_sdpa(q_nope.bfloat16(), q_rope.bfloat16(), cache, meta, sc, 0.11, w_uk.bfloat16(),
                           w_uv.bfloat16())  # fmt: skip
    assert got.dtype == torch.bfloat16 and torch.all(got[real:] == 0)
    err = (got.float() - want).abs().max().item()
    assert err <= 2.0 ** -6 * want.abs().max().item(), (err, want.abs().max().item())


def test_sdpa_prefill_query_row_chunks_equal_one_call(monkeypatch):
    """Bounding the scores per call (for torch's math fallback) splits the query rows; each chunk attends to
    the keys up to its last position. 2-row chunks at 100 keys give the same rows as one call."""
    import kvforge.attention.mla_prefill_sdpa as mod

    cache, meta, q_nope, q_rope, w_uk, w_uv, _ = _step(torch.float32, 1.0, 16, seed=3)
    whole = mla_prefill_sdpa(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    monkeypatch.setattr(mod, "SDPA_SCORE_ELEMENTS", 4 * 100 * 2 + 5)  # 4 heads: 2 rows at L = 100
    split = mla_prefill_sdpa(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    assert (split - whole).abs().max().item() <= 1e-6 * whole.abs().max().item()


@pytest.mark.parametrize("heads_per_call", [1, 3])
def test_sdpa_prefill_head_groups_equal_one_call(monkeypatch, heads_per_call):
    """Bounding the expanded K/V bytes per call splits the heads into groups (3: an uneven last group of
    1); each head attends on its own, so the result equals one call, and every row of every head is
    written."""
    import kvforge.attention.mla_prefill_sdpa as mod

    cache, meta, q_nope, q_rope, w_uk, w_uv, _ = _step(torch.float32, 1.0, 16, seed=4)
    whole = mla_prefill_sdpa(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    longest = max(meta.host_lists()[1])
    qk_dim = q_nope.shape[-1] + q_rope.shape[-1]
    budget = heads_per_call * 2 * longest * qk_dim * 4  # float32 rows: heads_per_call heads of the longest
    monkeypatch.setattr(mod, "SDPA_KV_BYTES", budget)
    calls = []  # (heads, keys) per call
    sdpa = mod.end_aligned_sdpa
    monkeypatch.setattr(mod, "end_aligned_sdpa", lambda q, k, *a: calls.append((q.shape[1], k.shape[2])) or sdpa(q, k, *a))
    grouped = mla_prefill_sdpa(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    assert q_nope.shape[1] == 4 and min(hc for hc, _ in calls) <= heads_per_call
    assert all(hc * 2 * keys * qk_dim * 4 <= budget for hc, keys in calls)  # shorter sequences take more heads
    assert (grouped - whole).abs().max().item() <= 1e-6 * whole.abs().max().item()


def test_sdpa_prefill_checks_its_inputs():
    cache, meta, q_nope, q_rope, w_uk, w_uv, _ = _step(torch.float32, 1.0, 16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_prefill_sdpa(q_nope, q_rope[..., :8], cache, meta, None, 0.1, w_uk, w_uv)
    wrong = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                              meta.max_query_len, meta.max_seq_len, 8)
    with pytest.raises(ValueError, match="block size"):
        mla_prefill_sdpa(q_nope, q_rope, cache, wrong, None, 0.1, w_uk, w_uv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("prefix", [0, 1000])
@pytest.mark.parametrize("grouped", [False, True], ids=["all_heads", "head_groups"])
def test_gpu_sdpa_prefill_long_chunk(monkeypatch, dtype, prefix, grouped):
    """On CUDA torch picks a fused kernel (flash for a fresh prompt with V padded to 192, memory-efficient
    for the lower-right mask after a prefix): a 2048-token chunk, fresh or after 1000 cached tokens
    (DeepSeek's 128 + 64 / 128 head dims, fp8 cache), against the float32 reference on the same GPU;
    ``grouped``: SDPA_KV_BYTES lowered so that the 16 heads go 5 at a time (5, 5, 5, 1)."""
    import kvforge.attention.mla_prefill_sdpa as mod

    if grouped:
        monkeypatch.setattr(mod, "SDPA_KV_BYTES", 5 * 2 * (2048 + prefix) * 192 * (2 if dtype == torch.bfloat16 else 4))
    g = torch.Generator().manual_seed(7)
    bs, rank, rope, heads, dn, dv = 64, 512, 64, 16, 128, 128
    ql = 2048
    n = ql + prefix
    nb = -(-n // bs)
    cache = torch.zeros(nb + 1, bs, rank + rope, dtype=torch.float8_e4m3fn)
    tables = torch.arange(1, nb + 1, dtype=torch.int32)[None]
    write_mla_cache(torch.randn(n, rank, generator=g), torch.randn(n, rope, generator=g), cache,
                    torch.arange(bs, bs + n), torch.tensor([0.02]))
    meta = AttentionMetadata(torch.tensor([0, ql], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), tables,
                             torch.full((ql,), -1, dtype=torch.int64), ql, n, bs, host_query_start_loc=(0, ql),
                             host_seq_lens=(n,))
    q_nope, q_rope = torch.randn(ql, heads, dn, generator=g), torch.randn(ql, heads, rope, generator=g)
    w_uk = torch.randn(heads, dn, rank, generator=g) * 0.05
    w_uv = torch.randn(heads, dv, rank, generator=g) * 0.05
    cuda = {k: v.cuda() for k, v in dict(cache=cache, q_nope=q_nope, q_rope=q_rope, w_uk=w_uk, w_uv=w_uv).items()}
    meta_cuda = AttentionMetadata(*(x.cuda() for x in (meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                                       meta.slot_mapping)), ql, n, bs,
                                  host_query_start_loc=(0, ql), host_seq_lens=(n,))  # fmt: skip
    sc = torch.tensor([0.02], device="cuda")
    want = mla_prefill(cuda["q_nope"], cuda["q_rope"], cuda["cache"], meta_cuda, sc, 192 ** -0.5, cuda["w_uk"],
                       cuda["w_uv"])  # fmt: skip
    got = mla_prefill_sdpa(cuda["q_nope"].to(dtype), cuda["q_rope"].to(dtype), cuda["cache"], meta_cuda, sc,
                           192 ** -0.5, cuda["w_uk"].to(dtype), cuda["w_uv"].to(dtype))  # fmt: skip
    err = (got.float() - want).abs().max().item()
    bound = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-4  # float32: fused kernels may use 3xTF32
    assert torch.isfinite(got).all() and err <= bound * want.abs().max().item(), err


def test_triton_mla_sends_prefill_steps_here_in_sdpa_mode(monkeypatch):
    """``mla_prefill_mode="sdpa"``, and "auto" over its bound: the Triton MLA backend's prefilling sequences
    go through mla_prefill_sdpa, and the step's decoding sequence through the decode kernel ("expanded" keeps
    the reference for the whole step). The tensors are on the CPU: where the decode kernel cannot take them
    (compiled for a GPU, or Triton's interpreter without loaded loop bounds) the float32 reference decode
    stands in for it: the routing is what is checked."""
    from triton_kernel_device import INTERPRETED, loaded_loop_bounds_work

    import kvforge.attention.triton_mla as triton_mla
    from kvforge.attention import mla_reference
    from kvforge.attention.routing import mla as mla_routing

    cache, meta, q_nope, q_rope, w_uk, w_uv, _ = _step(torch.float32, 1.0, 16)
    calls = []
    real_decode = triton_mla.mla_decode
    if not (INTERPRETED and loaded_loop_bounds_work()):
        def real_decode(*a, num_splits=None, **k):
            return mla_reference.mla_decode(*a, **k)
    monkeypatch.setattr(triton_mla, "mla_prefill_sdpa",
                        lambda *a, **k: calls.append(("sdpa", k["sequences"])) or mla_prefill_sdpa(*a, **k))
    monkeypatch.setattr(triton_mla, "mla_prefill", lambda *a: calls.append("reference") or mla_prefill(*a))
    monkeypatch.setattr(triton_mla, "mla_decode",
                        lambda q, *a, **k: calls.append(("decode", q.shape[0])) or real_decode(q, *a, **k))
    got = triton_mla.mla_attention(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv, prefill_mode="sdpa")
    want = triton_mla.mla_attention(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv, prefill_mode="expanded")
    monkeypatch.setattr(mla_routing, "ABSORBED_PREFILL_MAX_SEQ_LEN", 0)  # every prefilling sequence is over it
    auto = triton_mla.mla_attention(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv, prefill_mode="auto")
    # sequences 0 and 1 prefill (70 and 37 tokens), 2 decodes (1 token), 3 has no token this step
    assert calls == [("sdpa", (0, 1)), ("decode", 1), "reference", ("sdpa", (0, 1)), ("decode", 1)]
    assert torch.equal(auto, got)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # without the decoding sequence's token, nothing is absorbed (the sequence without tokens costs nothing)
    calls.clear()
    qsl = list(meta.host_query_start_loc)
    lens = list(meta.host_seq_lens)
    qsl2, lens2 = qsl[:3] + [qsl[2]] * 2, lens[:2] + [lens[2] - 1, lens[3]]  # sequence 2: no token this step
    meta2 = AttentionMetadata(torch.tensor(qsl2, dtype=torch.int32), torch.tensor(lens2, dtype=torch.int32),
                              meta.block_tables, meta.slot_mapping, meta.max_query_len, meta.max_seq_len,
                              meta.block_size, host_query_start_loc=tuple(qsl2), host_seq_lens=tuple(lens2))
    only = triton_mla.mla_attention(q_nope, q_rope, cache, meta2, None, 0.1, w_uk, w_uv, prefill_mode="sdpa")
    assert calls == [("sdpa", (0, 1))]
    assert torch.equal(only[:qsl[2]], got[:qsl[2]]) and torch.all(only[qsl[2]:] == 0)
