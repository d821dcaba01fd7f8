"""DeepSeek-V2/V3 (MLA + MoE) through the engine, the MLA reference backend's numerics, MLA block-size
negotiation, and fp8 vs bf16 latent caches. CPU only, tiny random configs.

(a) Engine vs transformers, float32: prefill logits (expanded-latent path) and decode-step logits
    (absorbed latent-space path, two sequences batched, scattered block tables) within
    1e-4 * max(1, max |hf|) (max |hf| ~3.6; measured max diff 1.3e-6 .. 2.3e-6), and greedy tokens identical.
(b) ``mla_decode`` vs a float64 reference over the dequantized cache, batch 1 and 32, fp8 e4m3 and bf16
    caches, bf16 query: max |ours - ref| <= 2^-7 * max |ref| (measured 2.8e-3 .. 3.2e-3: the output is
    rounded to bf16, unit roundoff 2^-8; with a float32 query/output the error is 1.6e-7 .. 5.4e-7).
(c) A user block size an MLA backend cannot take fails in the planner, before weights load.
(d) Greedy output of a tiny bf16 DeepSeek-V3 with an fp8 latent cache vs a bf16 latent cache.
"""

from __future__ import annotations

import json

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.attention.fp8 import dequantize  # noqa: E402
from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.attention.mla_reference import mla_decode, mla_prefill, write_mla_cache  # noqa: E402
from kvforge.errors import PlanError  # noqa: E402

torch.set_num_threads(1)

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_scaling=dict(type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                              original_max_position_embeddings=64, beta_fast=32, beta_slow=1))
CASES = {
    # V2: no q_lora, softmax + group-limited greedy routing, routed_scaling_factor
    "v2_group_limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
    # V2 with q_lora (q_a_proj / q_a_layernorm / q_b_proj), plain greedy routing, two shared experts
    "v2_q_lora": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                  dict(q_lora_rank=24, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=2.0)),
    # V3: sigmoid + e_score_correction_bias, group-limited (n_group/topk_group), norm_topk_prob, q_lora
    "v3_sigmoid_bias": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5)),
    # V3 with rotate-half rope (rope_interleave false), no q_lora, no YaRN
    "v3_no_interleave": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                         dict(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False, rope_scaling=None,
                              norm_topk_prob=False)),
}


def _save_hf(tmp_path, case, dtype=torch.float32, **overrides):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra, **overrides})
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    model.to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    return model


def _hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_engine_matches_hf(tmp_path, case):
    hf = _save_hf(tmp_path, case)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 20,
              progress=False, device="cpu")
    assert {layer.backend for layer in llm.plan.layers} == {"torch_mla_reference"}
    assert tuple(llm.engine.pool.kv_caches[0].shape[1:]) == (4, 32 + 8)
    g = torch.Generator().manual_seed(1)
    p1 = torch.randint(0, 256, (13,), generator=g).tolist()
    p2 = torch.randint(0, 256, (6,), generator=g).tolist()
    cont = torch.randint(0, 256, (2, 5), generator=g).tolist()
    max_diff, scale = 0.0, 1.0

    # Prefill of both sequences in one step (expansion path), scattered non-contiguous blocks.
    runner = llm.engine.runner
    t1, t2 = [40, 7, 33, 12, 25, 3], [9, 30, 18, 21]
    logits = runner.run([(p1, 0, t1), (p2, 0, t2)], [len(p1) - 1, len(p1) + len(p2) - 1])
    for row, ids in zip(logits, (p1, p2)):
        ref = _hf_last_logits(hf, ids)
        max_diff, scale = max(max_diff, (row - ref).abs().max().item()), max(scale, ref.abs().max().item())
    # Decode steps (absorbed latent-space path), both sequences batched, teacher-forced tokens.
    s1, s2 = list(p1), list(p2)
    for k in range(5):
        step = [([cont[0][k]], len(s1), t1), ([cont[1][k]], len(s2), t2)]
        s1.append(cont[0][k])
        s2.append(cont[1][k])
        logits = runner.run(step, [0, 1])
        for row, ids in zip(logits, (s1, s2)):
            ref = _hf_last_logits(hf, ids)
            max_diff, scale = max(max_diff, (row - ref).abs().max().item()), max(scale, ref.abs().max().item())
    assert max_diff <= 1e-4 * scale, (max_diff, scale)

    # Whole engine path: teacher-forced prompt logits and greedy generation, two prompts batched.
    with torch.no_grad():
        ref = hf(torch.tensor([p1])).logits[0]
    ours = llm.engine.compute_prompt_logits(p1)
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    outs = llm.generate([{"prompt_token_ids": p} for p in (p1, p2)],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, out in zip((p1, p2), outs):  # near-tie rule at the logit tolerance above
        with torch.no_grad():
            run = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert_greedy_agrees(out.outputs[0].token_ids, run.sequences[0, len(p):].tolist(),
                             top2_margins(torch.cat(run.logits)), 1e-4 * max(1.0, ref.abs().max().item()))


def test_deepseek_dummy_weights_and_moe_layer_freq(tmp_path):
    cfg = dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=None,
               n_group=2, topk_group=1, num_hidden_layers=4, moe_layer_freq=2, first_k_dense_replace=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", load_format="dummy", block_size=8, skip_tokenizer_init=True,
              kv_cache_memory=1 << 20, progress=False, device="cpu")
    moe = [type(layer.mlp).__name__ for layer in llm.engine.model.model.layers]
    assert moe == ["GatedMLP", "GatedMLP", "MoE", "GatedMLP"]  # layer 1: 1 % 2 != 0; layer 3: 3 % 2 != 0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# ---- (b) MLA decode numerics ------------------------------------------------------------------------------

def _random_mla_batch(batch, dtype, scale, heads=16, rank=512, rope=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 150, (batch,), generator=g).tolist()
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(batch, max(blocks_per), dtype=torch.int32)
    slots, at = [], 0
    for i, n in enumerate(lens):
        ids = perm[at:at + blocks_per[i]]
        at += blocks_per[i]
        tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan")).to(dtype)  # garbage in unused rows
    total = sum(lens)
    latent = torch.randn(total, rank, generator=g) * 0.5
    k_rope = torch.randn(total, rope, generator=g) * 2.0
    write_mla_cache(latent, k_rope, cache, torch.tensor(slots, dtype=torch.int64), scale)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.tensor([slots[sum(lens[:i + 1]) - 1] for i in range(batch)]),
        max_query_len=1, max_seq_len=max(lens), block_size=block_size)
    q_latent = (torch.randn(batch, heads, rank, generator=g) * 0.1).to(torch.bfloat16)
    q_rope = (torch.randn(batch, heads, rope, generator=g) * 0.1).to(torch.bfloat16)
    return cache, meta, q_latent, q_rope, lens, tables


def _reference_decode(cache, meta, q_latent, q_rope, scale, softmax_scale, lens, tables):
    """float64 attention over the dequantized cache rows of each sequence (no paging tricks)."""
    bs, rank = cache.shape[1], q_latent.shape[-1]
    out = []
    for i, n in enumerate(lens):
        rows = torch.cat([cache[int(tables[i, p // bs]), p % bs][None] for p in range(n)])
        rows = dequantize(rows, scale).double()
        c, kr = rows[:, :rank], rows[:, rank:]
        s = (q_latent[i].double() @ c.T + q_rope[i].double() @ kr.T) * softmax_scale
        out.append(torch.softmax(s, dim=-1) @ c)
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 32])
def test_mla_decode_vs_fp32_reference_over_dequantized_cache(kv_dtype, batch):
    scale = 0.02 if kv_dtype == torch.float8_e4m3fn else 1.0
    cache, meta, q_latent, q_rope, lens, tables = _random_mla_batch(batch, kv_dtype, scale)
    softmax_scale = 192 ** -0.5
    ours = mla_decode(q_latent, q_rope, cache, meta, torch.tensor([scale]), softmax_scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q_latent.shape
    ref = _reference_decode(cache, meta, q_latent, q_rope, scale, softmax_scale, lens, tables)
    err = (ours.double() - ref).abs().max().item()
    assert torch.isfinite(ours).all()
    assert err <= 2.0 ** -7 * ref.abs().max().item(), (err, ref.abs().max().item())


def test_write_mla_cache_rounding_bound():
    """Stored rows dequantize to the written values within the e4m3 bound (fp8.py): max(2^-4 |x|, 2^-10 s)."""
    g = torch.Generator().manual_seed(2)
    cache = torch.zeros(4, 8, 40, dtype=torch.float8_e4m3fn)
    latent, k_rope = torch.randn(20, 32, generator=g), torch.randn(20, 8, generator=g) * 30
    latent[0, 0] = 1e6  # saturates to 448 * scale, never inf/NaN
    slots = torch.tensor([5 * i % 32 for i in range(19)] + [-1])
    write_mla_cache(latent, k_rope, cache, slots, torch.tensor([0.25]))
    rows = dequantize(cache.view(32, 40)[slots[:19]], 0.25)
    x = torch.cat([latent, k_rope], dim=-1)[:19]
    assert rows[0, 0].item() == 448 * 0.25
    bound = torch.maximum(2.0 ** -4 * x.abs(), torch.full_like(x, 2.0 ** -10 * 0.25))
    assert ((rows - x).abs() <= bound)[1:].all() and ((rows - x).abs() <= bound)[0, 1:].all()


def test_mla_absorbed_decode_equals_expanded_prefill():
    """Both evaluation orders of MLA agree (float32) for decode tokens."""
    g = torch.Generator().manual_seed(3)
    cache, meta, _, _, lens, _ = _random_mla_batch(4, torch.float32, 1.0, heads=4, rank=64, rope=16, seed=3)
    dn, dv = 24, 20
    q_nope = torch.randn(4, 4, dn, generator=g)
    q_rope = torch.randn(4, 4, 16, generator=g)
    w_uk = torch.randn(4, dn, 64, generator=g) * 0.1
    w_uv = torch.randn(4, dv, 64, generator=g) * 0.1
    expanded = mla_prefill(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    absorbed = torch.einsum("thr,hvr->thv", mla_decode(q_latent, q_rope, cache, meta, None, 0.1), w_uv)
    assert (expanded - absorbed).abs().max().item() <= 1e-5 * max(1.0, expanded.abs().max().item())


def test_mla_prefill_row_chunks_equal_one_chunk(monkeypatch):
    """Splitting a prefill's query rows (to bound the score memory) leaves every output row unchanged:
    a 70-token prefill chunk after 30 cached tokens, split into chunks of 2..3 rows vs in one piece."""
    from kvforge.attention import mla_reference

    g = torch.Generator().manual_seed(5)
    bs, rank, rope, heads, dn, dv = 16, 32, 8, 3, 12, 10
    lens = [100, 37]
    qlens = [70, 37]  # sequence 0: 30 cached + 70 new; sequence 1: a fresh prompt
    per = [-(-n // bs) for n in lens]
    cache = torch.randn(sum(per) + 2, bs, rank + rope, generator=g)
    tables = torch.zeros(2, max(per), dtype=torch.int32)
    tables[0, :per[0]] = torch.arange(per[0], dtype=torch.int32)
    tables[1, :per[1]] = torch.arange(per[0], per[0] + per[1], dtype=torch.int32)
    t = sum(qlens)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, qlens[0], t], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             slot_mapping=torch.zeros(t, dtype=torch.int64), max_query_len=max(qlens),
                             max_seq_len=max(lens), block_size=bs)
    q_nope, q_rope = torch.randn(t, heads, dn, generator=g), torch.randn(t, heads, rope, generator=g)
    w_uk, w_uv = torch.randn(heads, dn, rank, generator=g) * 0.2, torch.randn(heads, dv, rank, generator=g) * 0.2
    whole = mla_prefill(q_nope, q_rope, cache, meta, None, 0.2, w_uk, w_uv)
    monkeypatch.setattr(mla_reference, "PREFILL_SCORE_ELEMENTS", heads * 100 * 2 + 5)  # 2 rows at L=100
    split = mla_prefill(q_nope, q_rope, cache, meta, None, 0.2, w_uk, w_uv)
    assert torch.allclose(split, whole, rtol=1e-6, atol=1e-6), (split - whole).abs().max()
    assert whole.abs().sum(-1).gt(0).all()


# ---- (c) block-size negotiation for MLA backends ----------------------------------------------------------

def _mla64():
    from kvforge.attention.mla_reference_backend import MLA_REFERENCE
    from kvforge.planner.declaration import BackendDeclaration, BlockSizes

    return BackendDeclaration(
        name="test_mla_b64", priority=7, layer_kinds=frozenset({"mla"}), platforms=frozenset({"cpu"}),
        kv_dtypes=MLA_REFERENCE.kv_dtypes, head_sizes=None, block_sizes=BlockSizes(sizes=(64,), why="test kernel"),
        quantized_query=MLA_REFERENCE.quantized_query, index_limit=MLA_REFERENCE.index_limit,
        implementation=MLA_REFERENCE.implementation)


def test_forced_block_size_an_mla_backend_rejects_fails_before_weights(tmp_path, monkeypatch, caplog):
    import kvforge.planner.registry as registry
    import kvforge.weights as weights

    cfg = dict(BASE, architectures=["DeepseekV3ForCausalLM"], q_lora_rank=None, n_group=2, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weight files at all
    builtins = registry.builtin_backends()
    monkeypatch.setattr(registry, "builtin_backends", lambda: (_mla64(),) + builtins)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights must not be read when the plan is invalid")

    monkeypatch.setattr(weights, "load_weights", no_weights)
    with pytest.raises(PlanError) as err:
        LLM(str(tmp_path), block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 20, progress=False,
            device="cpu")
    text = str(err.value)
    assert "--block-size 16 cannot work" in text and "test_mla_b64" in text and "one of 64" in text
    assert "use --block-size 64" in text

    from kvforge.planner.inputs import CacheConfig
    from kvforge.planner.resolver import resolve
    from kvforge.spec.architectures import spec_from_hf_config

    spec = spec_from_hf_config(cfg, name="tiny", source="test")
    with caplog.at_level("INFO", logger="kvforge.plan"):
        plan = resolve(spec, CacheConfig(kv_cache_memory=1 << 20))
    assert plan.block_size == 64 and plan.layers[0].backend == "test_mla_b64"
    assert "Setting kv cache block size to 64 for test_mla_b64 backend(s)." in caplog.text
    assert plan.groups[0].page_bytes == 64 * (32 + 8) * 2  # block x (kv_lora_rank + rope) x bf16 (config default)


# ---- (d) fp8 vs bf16 latent cache, greedy -----------------------------------------------------------------

def test_greedy_fp8_latent_cache_vs_bf16(tmp_path):
    """Measured (bf16 model, V3 sigmoid-bias case, 8 prompts x 16 tokens): teacher-forced top-1 agreement
    0.90 over 120 positions; greedy 55/128 positions equal, common prefix 54/128. A tiny random model has
    flat next-token distributions (median top-1/top-2 margin 0.2 logits) and MoE routing flips amplify
    the fp8 rounding (logit max diff 2.3; 0.16 with dense layers only), so greedy paths diverge early.
    The bf16 and fp32 latent caches give identical logits here (bf16 latents are stored exactly)."""
    _save_hf(tmp_path, "v3_sigmoid_bias", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 17, 23, 29, 8, 14, 20)]
    text = torch.randint(0, 256, (120,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs, logits = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_dtype=kv, block_size=16, skip_tokenizer_init=True,
                  kv_cache_memory=1 << 20, progress=False, device="cpu")
        assert llm.engine.pool.kv_caches[0].dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
        assert {layer.query_dtype for layer in llm.plan.layers} == {"bfloat16"}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[kv] = [o.outputs[0].token_ids for o in outs]
        logits[kv] = llm.engine.compute_prompt_logits(text)
    same = sum(a == b for x, y in zip(runs["auto"], runs["fp8"]) for a, b in zip(x, y))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                 for x, y in zip(runs["auto"], runs["fp8"]))
    total = sum(len(x) for x in runs["auto"])
    top1 = (logits["auto"].argmax(-1) == logits["fp8"].argmax(-1)).float().mean().item()
    print(f"fp8 vs bf16 latent cache: teacher-forced top-1 {top1:.3f}; greedy {same}/{total} positions equal, "
          f"common prefix {prefix}/{total}")
    assert torch.isfinite(logits["fp8"]).all()
    assert top1 >= 0.85
    assert prefix >= 0.3 * total


def test_per_token_metadata_hand_counts_and_absorbed_prefill_equals_expanded():
    """The "absorbed" prefill mode (kvforge/attention/triton_mla.py): each query token becomes a decode
    query over its causal prefix. Hand-counted metadata for a mixed step, then the absorbed evaluation
    through that metadata (reference decode, float32) against the expanded reference prefill."""
    from kvforge.attention.triton_mla import per_token_metadata

    g = torch.Generator().manual_seed(5)
    bs, rank, rope, heads = 16, 64, 16, 4
    # three sequences: a 5-token prefill from scratch, one decode token at context 20, a 3-token chunk after 30
    seq_lens = [5, 21, 33]  # query lengths 5, 1, 3 (query_start_loc below)
    tables = torch.tensor([[7, 0, 0], [2, 4, 0], [1, 3, 5]], dtype=torch.int32)
    num_blocks = 8
    cache = torch.full((num_blocks, bs, rank + rope), float("nan"))
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
        write_mla_cache(torch.randn(n, rank, generator=g), torch.randn(n, rope, generator=g), cache, slots, None)
    qsl = [0, 5, 6, 9]
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.full((11,), -1, dtype=torch.int64), 5, 33, bs)
    per, tokens = per_token_metadata(meta, 11)  # 9 real tokens + 2 padding
    assert tokens.tolist() == list(range(9))
    assert per.query_start_loc.tolist() == list(range(10)) and per.max_query_len == 1
    assert per.seq_lens.tolist() == [1, 2, 3, 4, 5, 21, 31, 32, 33]
    assert per.block_tables.tolist() == [tables[0].tolist()] * 5 + [tables[1].tolist()] + [tables[2].tolist()] * 3
    assert per.host_seq_lens == tuple(per.seq_lens.tolist())
    # the tokens of some sequences only (the absorbed ones of a step that expands the others)
    sub, tokens = per_token_metadata(meta, 11, sequences=(0, 2))
    assert tokens.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    assert sub.seq_lens.tolist() == [1, 2, 3, 4, 5, 31, 32, 33] and sub.query_start_loc.tolist() == list(range(9))
    assert sub.block_tables.tolist() == [tables[0].tolist()] * 5 + [tables[2].tolist()] * 3
    # built once per step: every MLA layer of the step gets the same object
    from kvforge.attention.triton_mla import _prefill_step

    first = _prefill_step(meta, 11, "absorbed")
    assert first.per_token.host_seq_lens == per.host_seq_lens and _prefill_step(meta, 11, "absorbed") is first
    assert _prefill_step(meta, 12, "absorbed") is not first

    dn, dv = 24, 20
    q_nope = torch.randn(11, heads, dn, generator=g)
    q_rope = torch.randn(11, heads, rope, generator=g)
    w_uk = torch.randn(heads, dn, rank, generator=g) * 0.1
    w_uv = torch.randn(heads, dv, rank, generator=g) * 0.1
    expanded = mla_prefill(q_nope, q_rope, cache, meta, None, 0.1, w_uk, w_uv)
    q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    absorbed = torch.einsum("thr,hvr->thv", mla_decode(q_latent, q_rope, cache, per, None, 0.1), w_uv)
    assert torch.all(expanded[9:] == 0) and torch.all(absorbed[9:] == 0)
    assert (expanded - absorbed).abs().max().item() <= 1e-5 * max(1.0, expanded.abs().max().item())


def test_prefill_mode_reads_the_step_metadata():
    """The Triton MLA backend's path per sequence of a step: the routing table's rule
    (tests/test_routing_tables.py) on the metadata's query and sequence lengths; a bad engine argument fails
    before any weight is read."""
    import kvforge.attention.triton_mla as triton_mla
    from kvforge.errors import ConfigError

    bound = triton_mla.ABSORBED_PREFILL_MAX_SEQ_LEN

    def step(*rows):  # (query tokens, sequence length) per sequence
        qsl = [0]
        for q, _ in rows:
            qsl.append(qsl[-1] + q)
        lens = [n for _, n in rows]
        return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                 torch.zeros((len(rows), 1), dtype=torch.int32), torch.zeros(qsl[-1], dtype=torch.int64),
                                 max(q for q, _ in rows), max(lens), 16, host_query_start_loc=tuple(qsl),
                                 host_seq_lens=tuple(lens))

    assert triton_mla.sequence_paths(step((8, bound)), "auto") == ["absorbed"]
    assert triton_mla.sequence_paths(step((8, bound + 1)), "auto") == ["sdpa"]
    assert triton_mla.sequence_paths(step((8, 100), (1, 5 * bound)), "auto") == ["absorbed", "absorbed"]
    assert triton_mla.sequence_paths(step((1, 10), (2, bound + 1)), "auto") == ["absorbed", "sdpa"]
    for forced in ("absorbed", "expanded", "sdpa"):
        assert triton_mla.sequence_paths(step((8, bound + 1)), forced) == [forced]
    with pytest.raises(ConfigError, match="--mla-prefill-mode must be one of auto, expanded, absorbed, sdpa"):
        LLM(None, mla_prefill_mode="sometimes", device="cpu", progress=False)


def test_backend_implementations_load_before_the_weights(tmp_path, monkeypatch):
    """A backend implementation that cannot be imported (missing dependency, bad KVFORGE_* setting) stops
    the engine before any weight is read."""
    import importlib

    import kvforge.weights

    _save_hf(tmp_path, "v3_sigmoid_bias")
    loaded = []
    monkeypatch.setattr(kvforge.weights, "load_weights", lambda *a, **k: loaded.append(1))
    real = importlib.import_module

    def refuse_backends(name, *a, **k):
        if name.startswith("kvforge.attention."):
            raise ImportError(f"cannot import {name} (test)")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", refuse_backends)
    with pytest.raises(ImportError, match="kvforge.attention"):
        LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
            device="cpu")
    assert loaded == []
