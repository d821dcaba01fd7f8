"""DeepSeek-V2/V3 (MLA + MoE) tensor parallelism on CPU (gloo, 2 processes): TP=2 against TP=1.

Tiny random checkpoints (transformers ``save_pretrained``), float32, one torch thread per process.
Query heads split, the MLA latent cache replicated, routed experts split by index, shared experts and
dense MLPs column/row-parallel, vocab-parallel embedding / LM head. TP=2 logits equal TP=1 logits within
``1e-5 * max(1, max |tp1|)`` and greedy tokens follow TP=1's until a near-tie of its logits
(tests/greedy_agreement.py); dummy weights agree across TP sizes.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import SamplingParams  # noqa: E402
from kvforge.distributed.launcher import expected_pool_bytes  # noqa: E402

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            vocab_size=255, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_scaling=dict(type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                              original_max_position_embeddings=64, beta_fast=32, beta_slow=1))
CASES = {
    # V2: no q_lora, softmax + group-limited greedy routing
    "v2_group_limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
    # V3: sigmoid + e_score_correction_bias, group-limited, q_lora, two shared experts
    "v3_sigmoid_bias": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, n_shared_experts=2,
                             routed_scaling_factor=2.5)),
}
ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 20, progress=False, device="cpu", max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _save(tmp_path, case):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return cfg


def _diff(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item(), 1e-5 * max(1.0, a.abs().max().item())


def _prompts(vocab):
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (45,), generator=g).tolist()  # > max_num_batched_tokens: chunked prefill
    return [long, long[:7], long[:20] + [1, 2, 3], torch.randint(0, vocab, (13,), generator=g).tolist()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_tp2_matches_tp1(tmp_path, engines, case):
    cfg = _save(tmp_path, case)
    tp1 = engines(tmp_path)
    tp2 = engines(tmp_path, tensor_parallel_size=2)
    prompts = _prompts(cfg.vocab_size)

    a = tp1.engine.compute_prompt_logits(prompts[0])
    b = tp2.engine.compute_prompt_logits(prompts[0])
    assert b.shape == (45, cfg.vocab_size)
    diff, bound = _diff(a, b)
    print(f"{case}: max |tp2 - tp1| {diff:.3g}, max |tp1| {a.abs().max().item():.3g}")
    assert diff <= bound, diff

    reqs = [{"prompt_token_ids": p} for p in prompts]
    assert_outputs_agree(tp2.generate(reqs, GREEDY, use_tqdm=False), tp1.generate(reqs, GREEDY, use_tqdm=False))

    # The latent cache is replicated: one "KV head" per rank, TP=1's bytes per token, the plan's pool bytes.
    assert all(lp.kv_heads_per_rank == 1 and lp.heads_per_rank == 2 for lp in tp2.plan.layers)
    assert tp2.plan.bytes_per_token == tp1.plan.bytes_per_token
    want = expected_pool_bytes(tp2.plan)
    for r in tp2.engine.tp.reports:
        assert r["nbytes"] == want and r["heads"] == 2 and r["kv_heads"] == [1] * cfg.num_hidden_layers


def test_deepseek_tp2_dummy_weights_match_tp1(tmp_path, engines):
    cfg = _save(tmp_path, "v3_sigmoid_bias")
    tp1 = engines(tmp_path, load_format="dummy", seed=3)
    tp2 = engines(tmp_path, load_format="dummy", seed=3, tensor_parallel_size=2)
    prompt = _prompts(cfg.vocab_size)[3]
    diff, bound = _diff(tp1.engine.compute_prompt_logits(prompt), tp2.engine.compute_prompt_logits(prompt))
    assert diff <= bound, diff
