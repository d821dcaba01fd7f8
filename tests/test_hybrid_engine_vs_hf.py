"""Gemma 3 and gpt-oss through the whole engine (plan -> KV pool with a block table per group, sliding
blocks freed, reference backend with windows and sinks -> sampler) against transformers, float32 on CPU.

Tiny random checkpoints (tests/tiny_checkpoints.py: 16-token window, prompts of 3-4x the window) in
blocks of 4 tokens. Teacher-forced logits: max |ours - hf| <= 1e-4 * max(1, max |hf|). Greedy
tokens: batched, with prefill chunks of 24 tokens (chunk edges fall inside and beyond the window),
again with prefix-cache hits, and at TP=2 over gloo; each follows transformers' greedy stream until a
near-tie of its logits within that tolerance (tests/greedy_agreement.py).
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB, WINDOW, make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 21, progress=False, device="cpu", max_num_batched_tokens=24)
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    long = torch.randint(0, VOCAB, (57,), generator=g).tolist()
    return [long, long[:40] + torch.randint(0, VOCAB, (9,), generator=g).tolist(),
            torch.randint(0, VOCAB, (44,), generator=g).tolist()]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        run = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return run.sequences[0, len(prompt):].tolist(), top2_margins(torch.cat(run.logits))


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_engine_matches_transformers(family, tmp_path, engines):
    hf, _ = make_checkpoint(family, tmp_path)
    llm = engines(tmp_path)
    kinds = sorted(g.kind for g in llm.plan.groups)
    assert "sliding" in kinds and "full" in kinds
    assert {g.sliding_window for g in llm.plan.groups if g.kind == "sliding"} == {WINDOW}
    prompts = _prompts()

    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    ours = llm.engine.compute_prompt_logits(prompts[0])
    assert (ours - ref).abs().max().item() <= tol

    expected = [_hf_greedy(hf, p) for p in prompts]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for run in ("cold", "prefix-cached"):
        hits_before = llm.engine.stats()["prefix_cache_hits"]
        outs = llm.generate(reqs, GREEDY, use_tqdm=False)
        for k, (out, (want, margins)) in enumerate(zip(outs, expected)):
            assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol, what=f"{family} {run} prompt {k}")
        if run == "prefix-cached":  # every prompt was seen: its full blocks come from the cache
            assert llm.engine.stats()["prefix_cache_hits"] > hits_before

    tp2 = engines(tmp_path, tensor_parallel_size=2)
    outs = tp2.generate(reqs, GREEDY, use_tqdm=False)
    for k, (out, (want, margins)) in enumerate(zip(outs, expected)):
        assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol, what=f"{family} TP=2 prompt {k}")


def test_max_model_len_below_the_window_is_stated_and_runs_like_full_attention(tmp_path, engines):
    """A window the sequences can never exceed: the plan says so, and greedy tokens equal transformers'."""
    hf, _ = make_checkpoint("gemma3", tmp_path)
    llm = engines(tmp_path, max_model_len=12)
    assert any(f"sliding window {WINDOW} >= --max-model-len 12" in w for w in llm.plan.warnings)
    assert "never cuts" in llm.plan.summary()
    prompt = _prompts()[0][:6]
    want, margins = _hf_greedy(hf, prompt)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        tol = 1e-4 * max(1.0, hf(torch.tensor([prompt + want[:6]])).logits.abs().max().item())
    assert_greedy_agrees(got, want[:6], margins, tol, what="max-model-len 12")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
def test_engine_matches_transformers_on_cuda(family, eager, tmp_path, engines):
    """float32 on CUDA: both route to the Triton paged kernels (windows; gpt-oss's sinks on the tl.dot
    kernel); Gemma 3 decodes in CUDA graphs where asked, gpt-oss too where torch._grouped_mm can be captured
    in float32 (else eager, the plan's runner saying why). Greedy tokens follow transformers' float32 greedy
    on CUDA until a near-tie within 1e-4 * max |logit|."""
    hf, _ = make_checkpoint(family, tmp_path, head_dim=32)  # a head size the Triton kernels take
    hf = hf.cuda()
    llm = engines(tmp_path, device="cuda", enforce_eager=eager, block_size=16)  # Triton: multiples of 16
    backends = {layer.backend for layer in llm.plan.layers}
    assert backends == {"triton_paged"}
    if not eager:
        runner = llm.engine.runner
        assert runner.graphs is not None or (family == "gpt-oss" and "MoE" in runner.graphs_off_reason)
    prompts = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0].float().cpu()
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for k, (p, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            run = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
        want = run.sequences[0, len(p):].tolist()
        assert_greedy_agrees(out.outputs[0].token_ids, want, top2_margins(torch.cat(run.logits).cpu()), tol,
                             what=f"{family} cuda prompt {k}")
