"""Model-level agreement of the declared e4m3 MLA query, on CPU.

See docs/PLANNER.md, "Evidence that a quantized cache is right".

The fp8 score product (kvforge/kernels/gluon_mla_decode_ws.py) rounds the decode query to e4m3 per (token,
head); its GPU tests hold it within 2^-6 of the PyTorch reference fed the query rounded the same way
(``mla_reference.round_query_e4m3``). Here that rounding is applied inside the CPU reference's decode, in a
tiny bf16 DeepSeek-V3 at DeepSeek's MLA widths (latent 512, rope 64, 16 heads, dense layers) with an fp8
e4m3 latent cache, and compared with the exact query: the next-token distribution of a decode step after
prompts of 8-120 random tokens (the prefill's token is the same in both runs, so the decode step's inputs
are). For scale the same comparison is made between the bf16 and the fp8 cache with the exact query.

Measured (2026-11-30, 29 positions): query rounding KL 3.3e-5 mean (6.7e-5 max), top-1 29/29; fp8 vs bf16
cache KL 2.2e-4 mean, top-1 26/26. The assertions: the query rounding moves no decode-step top-1 token
and costs at most half the KL of the fp8 cache itself. A random model, not real weights (no DeepSeek
checkpoint is available offline); the real-weights evidence for fp8 KV is SmolLM2's (docs/BENCHMARKS.md,
"Quality of fp8 KV").
"""

from __future__ import annotations

import pytest
import test_deepseek_mla as t
import torch

from kvforge import LLM, SamplingParams
from kvforge.attention import mla_reference as ref

POSITIONS = list(range(8, 121, 4))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla_widths")
    t._save_hf(path, "v3_sigmoid_bias", dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=16,
               first_k_dense_replace=t.BASE["num_hidden_layers"])  # fmt: skip
    return str(path)


def _decode_step_logprobs(path, kv, round_query, monkeypatch):
    """For each prompt ``text[:p]``: the first generated token (prefill) and the log-softmax of the logits of
    the decode step that follows it."""
    exact = ref.mla_decode
    calls = []

    def rounded(q_latent, q_rope, *args, **kwargs):
        calls.append(q_latent.shape[0])
        return exact(*ref.round_query_e4m3(q_latent, q_rope), *args, **kwargs)

    monkeypatch.setattr(ref, "mla_decode", rounded if round_query else exact)
    llm = LLM(path, dtype="bfloat16", block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 24,
              progress=False, device="cpu", kv_cache_dtype=kv, max_num_seqs=64)  # fmt: skip
    seen = {}
    sample = llm.engine.sampler.sample_sequences

    def recording(logits, seqs, *args, **kwargs):
        for row, seq in zip(logits, seqs):
            seen.setdefault(seq.request_id, []).append(torch.log_softmax(row.float(), -1))
        return sample(logits, seqs, *args, **kwargs)

    monkeypatch.setattr(llm.engine.sampler, "sample_sequences", recording)
    text = torch.randint(0, 256, (POSITIONS[-1],), generator=torch.Generator().manual_seed(11)).tolist()
    outs = llm.generate([{"prompt_token_ids": text[:p]} for p in POSITIONS],
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # fmt: skip
    monkeypatch.setattr(ref, "mla_decode", exact)
    assert not round_query or sum(calls) >= len(POSITIONS), calls  # every decode token went through the rounding
    return [(o.outputs[0].token_ids[0], seen[o.request_id][1]) for o in outs]


def _compare(a, b):
    """(decode-step top-1 agreements, KL(a || b) per position) over the positions whose prefill token agrees."""
    top1, kls = [], []
    for (tok_a, lp_a), (tok_b, lp_b) in zip(a, b):
        if tok_a == tok_b:
            top1.append(bool(lp_a.argmax() == lp_b.argmax()))
            kls.append(float((lp_a.exp() * (lp_a - lp_b)).sum()))
    return top1, torch.tensor(kls)


def test_e4m3_query_rounding_costs_less_than_the_fp8_cache(model_path, monkeypatch):
    bf16 = _decode_step_logprobs(model_path, "auto", False, monkeypatch)
    fp8 = _decode_step_logprobs(model_path, "fp8", False, monkeypatch)
    fp8_q = _decode_step_logprobs(model_path, "fp8", True, monkeypatch)
    top1_q, kl_q = _compare(fp8, fp8_q)
    top1_kv, kl_kv = _compare(bf16, fp8)
    print(f"\nquery rounding: top-1 {sum(top1_q)}/{len(top1_q)}, KL mean {kl_q.mean():.2e} max {kl_q.max():.2e}; "
          f"fp8 vs bf16 cache: top-1 {sum(top1_kv)}/{len(top1_kv)}, KL mean {kl_kv.mean():.2e}")
    assert len(top1_q) == len(POSITIONS) and all(top1_q)
    assert len(top1_kv) >= len(POSITIONS) // 2 and kl_kv.mean() > 0
    assert kl_q.mean() <= 0.5 * kl_kv.mean()
