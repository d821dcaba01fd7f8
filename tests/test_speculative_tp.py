"""Speculative decoding at tensor parallelism 2 on CPU (gloo, 2 processes): the verify step's 1 + k
rows go through the step broadcast like a prefill chunk; rank 0 verifies. Greedy tokens follow the
TP=1 engine without speculation (near-tie rule of tests/greedy_agreement.py: the all-reduces change
the summation order)."""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 21, progress=False, device="cpu", max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def test_tp2_speculation_matches_tp1(tmp_path, engines):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256, max_position_embeddings=256,
                                   rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    reqs = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 6, [9, 9, 3] * 15, list(range(30, 61)))]
    want = engines(tmp_path).generate(reqs, GREEDY, use_tqdm=False)
    tp2 = engines(tmp_path, tensor_parallel_size=2, num_speculative_tokens=3)
    assert_outputs_agree(tp2.generate(reqs, GREEDY, use_tqdm=False), want)
    stats = tp2.engine.stats()
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_tp2_speculation_with_async_scheduling(tmp_path, engines):
    """Async scheduling: steps that verify share no sampled tokens with the workers, steps that do not verify
    do; the workers receive shared tokens only when rank 0 sends them (a ``t`` wake-up), so both kinds of
    step interleave without pairing mismatched collectives."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256, max_position_embeddings=256,
                                   rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(cfg).eval().float().save_pretrained(tmp_path, safe_serialization=True)
    reqs = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 6, [9, 9, 3] * 15, list(range(30, 61)))]
    want = engines(tmp_path).generate(reqs, GREEDY, use_tqdm=False)
    tp2 = engines(tmp_path, tensor_parallel_size=2, num_speculative_tokens=3, async_scheduling=True)
    assert tp2.engine.async_scheduling
    assert_outputs_agree(tp2.generate(reqs, GREEDY, use_tqdm=False), want)
    stats = tp2.engine.stats()
    assert stats["spec_decode"]["num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0
