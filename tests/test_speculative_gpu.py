"""Speculative decoding on CUDA: the Triton paged and MLA backends take the verify step's 1 + k query
rows (replayed from CUDA graphs when every sequence verifies k proposals, tests/test_verify_graphs.py;
eagerly otherwise), bf16 and fp8 KV.

Reference: the same engine with speculation off, asked for logprobs so greedy tokens are compared by
the near-tie rule of tests/greedy_agreement.py: the verify step's batch shape changes the summation
order, which can flip a near-tie. Tolerance as tests/test_engine_gpu.py: FP32_LOGIT_TOL in float32;
in bfloat16, 8 bf16 steps at the largest |logit| (2^-5 of it; 4x that with an fp8 KV cache). Skipped
without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=256, vocab_size=256, max_position_embeddings=2048,
             rms_norm_eps=1e-5, torch_dtype="bfloat16")
DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=192, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64, qk_rope_head_dim=16,
                qk_nope_head_dim=32, v_head_dim=32, vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-5,
                q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                torch_dtype="bfloat16")
PROMPTS = [[5, 6, 7, 8] * 8, [9, 9, 3] * 10, list(range(40, 140)), [1, 2, 3, 4, 5] * 40]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
#: The embedded model's engines take this much KV cache, not 90% of a GPU that other test processes share.
KV_MEMORY = "1GiB"


def _run(path, **kw):
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, kv_cache_memory=1 << 28, progress=False,
              device="cuda", max_num_seqs=8, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return llm, outs


def _tolerance(llm, dtype: str, kv: str) -> float:
    if dtype == "float32":
        return FP32_LOGIT_TOL
    scale = max(1.0, llm.engine.compute_prompt_logits(PROMPTS[-1]).abs().max().item())
    return scale * 2.0**-5 * (4 if kv == "fp8" else 1)


@pytest.mark.parametrize("model", ["llama", "deepseek"])
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_agrees_with_speculation_off(tmp_path, model, dtype, kv, k):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA if model == "llama" else DEEPSEEK))
    off, ref = _run(str(tmp_path), dtype=dtype, kv_cache_dtype=kv)
    llm, outs = _run(str(tmp_path), dtype=dtype, kv_cache_dtype=kv, num_speculative_tokens=k)
    assert_outputs_agree(outs, ref, _tolerance(off, dtype, kv))
    stats = llm.engine.stats()
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    assert stats["async_scheduling"] is True  # steps without proposals overlap; verification steps resolve at once
    assert stats["eager_steps"] > 0  # the prefill steps, and verify steps with fewer than k proposals


def test_embedded_model_repeats_a_paragraph_faster_in_steps():
    text = "The quick brown fox jumps over the lazy dog. The early bird catches the worm. A stitch in time saves nine."
    prompt = f"Repeat this text exactly: {text}\nRepeated: {text}\nRepeated:"
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    off = LLM(device="cuda", progress=False, dtype="float32", kv_cache_memory=KV_MEMORY)
    ref = off.generate([prompt], params, use_tqdm=False)
    llm = LLM(device="cuda", progress=False, dtype="float32", kv_cache_memory=KV_MEMORY, num_speculative_tokens=4)
    outs = llm.generate([prompt], params, use_tqdm=False)
    assert_outputs_agree(outs, ref, FP32_LOGIT_TOL)
    assert outs[0].speculative.acceptance_rate > 0.3
    assert llm.engine.stats()["num_steps"] < 64


@pytest.mark.parametrize("model", ["llama", "llama-sliced", "deepseek"])
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "fp8")])
def test_draft_model_agrees_with_speculation_off(tmp_path, model, dtype, kv):
    """A 1-layer draft of the target's family (dummy weights, another seed of the same shapes but fewer
    layers), its layer in the target's group of the pool, on CUDA, its proposals verified by the Triton
    backends; "llama-sliced": a 2-layer draft of 1 KV head where the target has 2, so half the page: both
    draft layers share one page slot, each on a slice of every page (a cache view strided by the page)."""
    config = LLAMA if model != "deepseek" else DEEPSEEK
    draft = dict(config, num_hidden_layers=1) if model != "llama-sliced" else dict(config, num_key_value_heads=1)
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    (tmp_path / "draft" / "config.json").write_text(json.dumps(draft))
    off, ref = _run(str(tmp_path / "target"), dtype=dtype, kv_cache_dtype=kv)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    llm, outs = _run(str(tmp_path / "target"), dtype=dtype, kv_cache_dtype=kv, speculative_config=spec)
    assert_outputs_agree(outs, ref, _tolerance(off, dtype, kv))
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    if model == "llama-sliced":
        assert [g.draft_layers_per_slot for g in llm.engine.plan.groups if g.draft_layers] == [2]


def test_embedded_model_as_its_own_draft_on_cuda():
    from kvforge.spec.embedded import embedded_model_path

    prompt = "Write a short note about the sea."
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    ref = LLM(device="cuda", progress=False, dtype="float32", kv_cache_memory=KV_MEMORY).generate([prompt], params, use_tqdm=False)
    llm = LLM(device="cuda", progress=False, dtype="float32", kv_cache_memory=KV_MEMORY, speculative_config={
        "method": "draft_model", "model": str(embedded_model_path()), "num_speculative_tokens": 4})
    outs = llm.generate([prompt], params, use_tqdm=False)
    assert_outputs_agree(outs, ref, FP32_LOGIT_TOL)
    assert outs[0].speculative.acceptance_rate > 0.9


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("draft_kind, dtype, kv", [("self", "float32", "auto"), ("one-layer", "bfloat16", "fp8")])
def test_draft_model_at_tp2_agrees_with_speculation_off(tmp_path, draft_kind, dtype, kv):
    """TP=2 on two GPUs (NCCL, decode CUDA graphs on every rank): the draft's slice runs on each rank over its
    pool's draft layers, rank 0 picks the proposals. "self": the target as its own draft (dummy weights of one
    seed, so the same model): acceptance > 0.9; "one-layer": a 1-layer draft joining the target's group."""
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(LLAMA))
    draft = LLAMA if draft_kind == "self" else dict(LLAMA, num_hidden_layers=1)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(draft))
    off, ref = _run(str(tmp_path / "target"), dtype=dtype, kv_cache_dtype=kv, tensor_parallel_size=2)
    tol = _tolerance(off, dtype, kv)
    off.engine.shutdown()  # one tensor-parallel engine per process
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    llm, outs = _run(str(tmp_path / "target"), dtype=dtype, kv_cache_dtype=kv, tensor_parallel_size=2,
                     speculative_config=spec)
    try:
        assert_outputs_agree(outs, ref, tol)
        counters = llm.engine.stats()["spec_decode"]
        assert counters["num_draft_tokens"] > 0 and llm.engine.block_manager.num_used_blocks == 0
        if draft_kind == "self":
            assert counters["num_accepted_tokens"] / counters["num_draft_tokens"] > 0.9
        assert [r["draft_kv_heads"] for r in llm.engine.tp.reports] == [[1] * draft["num_hidden_layers"]] * 2
    finally:
        llm.engine.shutdown()
