"""Speculative method mtp on CUDA: the MTP layer's passes (their own CUDA graphs where a pass fits one, else
eager) and the target's verify steps (eager, or a verification CUDA graph when every sequence verifies all k
proposals; the MTP layer then reads the graph's hidden states) on the Triton MLA backend, bf16 and fp8 KV; Qwen3-Next's MTP layer on the
Triton paged and Gated DeltaNet kernels. Skipped without CUDA.

Reference: the same engine with speculation off, compared by the near-tie rule of
tests/greedy_agreement.py with the tolerance of tests/test_speculative_gpu.py. The checkpoint whose
MTP layer computes the target's next-token function (tests/test_mtp_engine.py) must accept every
proposal on CUDA too.
"""

from __future__ import annotations

import json

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEEPSEEK_MTP = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=128, num_hidden_layers=3,
                    num_attention_heads=4, intermediate_size=192, moe_intermediate_size=64, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64,
                    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=256,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, q_lora_rank=48, n_group=4, topk_group=2,
                    norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                    torch_dtype="bfloat16")
PROMPTS = [[5, 6, 7, 8] * 8, [9, 9, 3] * 10, list(range(40, 140)), [1, 2, 3, 4, 5] * 40]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)


def _run(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, kv_cache_memory=1 << 28, progress=False, device="cuda",
              max_num_seqs=8, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_agrees_with_speculation_off(tmp_path, dtype, kv, k):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_MTP))
    off, ref = _run(str(tmp_path), load_format="dummy", dtype=dtype, kv_cache_dtype=kv)
    tol = FP32_LOGIT_TOL
    if dtype != "float32":
        scale = max(1.0, off.engine.compute_prompt_logits(PROMPTS[-1]).abs().max().item())
        tol = scale * 2.0**-5 * (4 if kv == "fp8" else 1)
    llm, outs = _run(str(tmp_path), load_format="dummy", dtype=dtype, kv_cache_dtype=kv,
                     speculative_config={"method": "mtp", "num_speculative_tokens": k, "backoff": False})
    assert_outputs_agree(outs, ref, tol)
    stats = llm.engine.stats()
    assert [layer.index for layer in llm.engine.plan.draft.layers] == [3]
    assert stats["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_computing_the_target_is_accepted_on_cuda(tmp_path, dtype):
    """float32: every proposal accepted (equal logits). bfloat16: the MTP layer's extra norm of a normed
    bf16 vector scales its logits by 1 +- 2^-8, which may flip a near-tie, so most, not all."""
    from mtp_checkpoint import save_deepseek_v3_with_mtp
    from test_mtp_engine import _target_function_checkpoint

    save_deepseek_v3_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    off, ref = _run(str(tmp_path), dtype=dtype)
    tol = FP32_LOGIT_TOL if dtype == "float32" else 2.0**-5 * max(
        1.0, off.engine.compute_prompt_logits(PROMPTS[-1]).abs().max().item())
    llm, outs = _run(str(tmp_path), dtype=dtype, speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                                   "backoff": False})
    assert_outputs_agree(outs, ref, tol)
    stats = llm.engine.stats()
    counters = stats["spec_decode"]
    assert counters["num_draft_tokens"] > 50
    if dtype == "float32":
        assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters
    else:
        assert counters["num_accepted_tokens"] >= 0.9 * counters["num_draft_tokens"], counters
    if llm.engine.runner.graphs is not None:  # MoE capture needs grouped GEMMs of the dtype
        assert stats["graph_steps"] > 0  # verify steps replayed graphs; the MTP layer read their hidden states


def _run_qwen3_next(path, **kw):
    llm = LLM(path, skip_tokenizer_init=True, kv_cache_memory=1 << 28, progress=False, device="cuda",
              max_num_seqs=8, **kw)
    prompts = [[p % 128 for p in prompt] for prompt in PROMPTS]
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "fp8")])
def test_qwen3_next_mtp_agrees_with_speculation_off(tmp_path, dtype, kv):
    """Qwen3-Next's MTP layer (dummy weights) beside the Triton Gated DeltaNet kernels, whose state slots roll
    back after every verify step."""
    from tiny_checkpoints import QWEN3_NEXT

    config = {**QWEN3_NEXT, "architectures": ["Qwen3NextForCausalLM"], "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    off, ref = _run_qwen3_next(str(tmp_path), load_format="dummy", dtype=dtype, kv_cache_dtype=kv)
    tol = FP32_LOGIT_TOL
    if dtype != "float32":
        scale = max(1.0, off.engine.compute_prompt_logits(PROMPTS[0]).abs().max().item())
        tol = scale * 2.0**-5 * (4 if kv == "fp8" else 1)
    llm, outs = _run_qwen3_next(str(tmp_path), load_format="dummy", dtype=dtype, kv_cache_dtype=kv,
                                speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 3,
                                                    "backoff": False})
    assert_outputs_agree(outs, ref, tol)
    assert [layer.index for layer in llm.engine.plan.draft.layers] == [4]
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0


def test_qwen3_next_mtp_computing_the_target_is_accepted_on_cuda(tmp_path):
    from qwen3_next_mtp_checkpoint import save_qwen3_next_with_mtp
    from test_mtp_qwen3_next_engine import _target_function_checkpoint

    save_qwen3_next_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    off, ref = _run_qwen3_next(str(tmp_path), dtype="float32")
    llm, outs = _run_qwen3_next(str(tmp_path), dtype="float32",
                                speculative_config={"method": "mtp", "num_speculative_tokens": 3, "backoff": False})
    assert_outputs_agree(outs, ref, FP32_LOGIT_TOL)
    counters = llm.engine.stats()["spec_decode"]
    assert counters["num_draft_tokens"] > 50
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters


@pytest.mark.parametrize("arch", ["deepseek", "qwen3_next"])
def test_mtp_graph_passes_equal_eager_passes(tmp_path, arch):
    """The MTP layer's captured passes (single tokens, and a decoding sequence's observed rows) against the
    same passes run eagerly on the same inputs (tests/mtp_graph_passes.py), bf16 with dummy weights: within
    2^-5 of the largest head input (the attention's split counts differ between a graph's context bucket and
    the eager step, so the bf16 rounding differs; a stale or misplaced row moves the output by its own size).
    The output still equals speculation off."""
    from mtp_graph_passes import run_graph_passes_twice
    from tiny_checkpoints import QWEN3_NEXT

    # head_dim 32: the smallest head size of the Triton paged backend, whose layers capture graphs
    config = DEEPSEEK_MTP if arch == "deepseek" else {**QWEN3_NEXT, "architectures": ["Qwen3NextForCausalLM"],
                                                      "head_dim": 32, "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [{"prompt_token_ids": [p % 128 for p in prompt]} for prompt in PROMPTS]
    kw = dict(skip_tokenizer_init=True, kv_cache_memory=1 << 28, progress=False, device="cuda", max_num_seqs=8,
              load_format="dummy", dtype="bfloat16")
    off = LLM(str(tmp_path), **kw)
    ref = off.generate(prompts, PARAMS, use_tqdm=False)
    scale = max(1.0, off.engine.compute_prompt_logits(prompts[0]["prompt_token_ids"]).abs().max().item())
    llm = LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 2, "backoff": False}, **kw)
    runner = llm.engine.draft_runner
    assert runner.graphs is not None, runner.graphs_off_reason
    passes = run_graph_passes_twice(runner)
    assert_outputs_agree(llm.generate(prompts, PARAMS, use_tqdm=False), ref, scale * 2.0**-5)
    assert len(passes) > 40 and max(diff for _, _, diff in passes) <= 2.0**-5, passes
    assert llm.engine.stats()["proposer_steps"]["graph"] == len(passes)
