"""The whole engine path (plan -> paged KV pool -> reference backend -> sampler)
against Hugging Face transformers on tiny random configs, float32 on CPU.

Block size 4 so that prompts span many non-contiguous blocks. Tolerance:
max |ours - hf| <= 1e-4 * max(1, max |hf|) on logits (float32 arithmetic in a
different order; measured ~1e-6). Greedy tokens follow transformers' until a near-tie of its
logits within that tolerance (tests/greedy_agreement.py).
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
}


def _save_hf(tmp_path, case):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def engine_with_matching_prompt_logits(tmp_path, hf, g: torch.Generator) -> tuple[LLM, list[int], float]:
    """The float32 CPU engine over the checkpoint saved at ``tmp_path`` (block size 4), a 23-token prompt drawn
    from ``g`` whose logits it computes within the tolerance of ``hf``'s (asserted), and that tolerance."""
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 22, progress=False, device="cpu")
    prompt = torch.randint(0, 256, (23,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = llm.engine.compute_prompt_logits(prompt)
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= tol
    return llm, prompt, tol


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_logits_and_greedy_match_hf(tmp_path, case):
    hf = _save_hf(tmp_path, case)
    g = torch.Generator().manual_seed(1)
    llm, prompt, tol = engine_with_matching_prompt_logits(tmp_path, hf, g)

    # Greedy decode through the scheduler (prefill + 12 decode steps, 3 prompts batched).
    prompts = [prompt, prompt[:7], torch.randint(0, 256, (40,), generator=g).tolist()]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for k, (p, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref_run = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                  eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expect = ref_run.sequences[0, len(p):].tolist()
        assert_greedy_agrees(out.outputs[0].token_ids, expect, top2_margins(torch.cat(ref_run.logits)), tol,
                             what=f"{case} prompt {k}")


def test_pool_allocates_exactly_the_plan(tmp_path):
    _save_hf(tmp_path, "llama3")
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="fp8", block_size=8, skip_tokenizer_init=True,
              kv_cache_memory=3_000_000, progress=False, device="cpu")
    plan = llm.plan
    group = plan.groups[0]
    # 2 layers x 2 KV heads x (16 + 16) fp8 bytes per token = 128 bytes; page = 8 x 64 per layer
    assert plan.bytes_per_token == 2 * 2 * 32 and group.page_bytes == 8 * 64
    assert llm.engine.pool.nbytes == plan.num_blocks * plan.group_size * group.page_bytes <= 3_000_000
    assert plan.num_blocks == 3_000_000 // (2 * 8 * 64)
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.engine.pool.kv_caches)
    assert llm.engine.block_manager.num_blocks == plan.num_blocks
