"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against Hugging Face transformers.

A tiny random Llama saved with ``save_pretrained``, float32 on CPU, block size 4.
The reference is ``log_softmax`` of transformers' logits in float64. Tolerance
2e-4 absolute on every logprob: float32 logits agree with transformers' within
1e-4 x max|logit| (tests/test_engine_vs_hf.py; the logits here are below 2 in
magnitude), and log-softmax shifts them by the same amount at most twice.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402

VOCAB = 256
TOL = 2e-4
CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval().float()
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def _llm(path, **kw):
    args = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
                kv_cache_memory=1 << 22, progress=False, device="cpu")
    return LLM(path, **{**args, **kw})


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """float64 log-softmax of transformers' logits: row p scores token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _check(out, prompt, ref, k):
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt)
    assert pl[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        entry = pl[i]
        assert abs(entry[prompt[i]] - row[prompt[i]].item()) <= TOL, (i, entry[prompt[i]], row[prompt[i]].item())
        # The rank: the tokens whose logprob is at least the prompt token's, itself included (vLLM's count);
        # a token within 2 x TOL of it may fall on either side in float32.
        target = row[prompt[i]].item()
        rank = entry[prompt[i]].rank
        assert entry[prompt[i]].logprob == entry[prompt[i]] and next(iter(entry)) == prompt[i]  # vLLM's fields
        if len(entry) == k + 1:  # the prompt token is not among the top k: its own rank
            assert 1 + int((row > target + 2 * TOL).sum()) <= rank <= int((row > target - 2 * TOL).sum()), i
        top_ranks = sorted(v.rank for t, v in entry.items() if t != prompt[i] or len(entry) == k)
        assert top_ranks == list(range(1, k + 1))
        assert len(entry) in (k, k + 1)  # the top k, plus the prompt token when it is not among them
        # The k largest of the entry are the top k (the prompt token, if extra, is not above them).
        ours = sorted(((v, t) for t, v in entry.items()), reverse=True)[:k]
        top_vals = row.topk(k).values.tolist() if k else []
        for (v, t), ref_v in zip(ours, top_vals):
            assert abs(v - ref_v) <= TOL  # the k-th best value
            assert abs(row[t].item() - v) <= TOL  # and the id's own reference logprob


@pytest.mark.parametrize("chunked,overlapped", [(False, False), (True, False), (True, True)],
                         ids=["one_prefill", "chunked_prefill", "chunked_prefill_async_scheduling"])
def test_prompt_logprobs_match_transformers(hf_model, chunked, overlapped):
    model, path = hf_model
    # Chunked: 16 tokens a step, so the 41-token prompt is scored over three steps, batched with others.
    llm = _llm(path, max_num_batched_tokens=16 if chunked else 2048, enable_chunked_prefill=True,
               async_scheduling=overlapped)
    assert llm.engine.async_scheduling == overlapped
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (41, 9, 2)]
    ks = [5, 0, 2]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p, k in zip(outs, prompts, ks):
        _check(out, p, _reference(model, p), k)
        assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_prompt_rows_scored_in_slices_match_transformers(hf_model, monkeypatch, tp):
    """Slices of 3 rows (the engine's are 256): a 41-token prompt is scored in 14 slices beside the
    sampled rows of other requests in the same step; at TP 2 the workers take rank 0's slice length."""
    import kvforge.engine.prompt_scoring as prompt_scoring

    monkeypatch.setattr(prompt_scoring, "SLICE_ROWS", 3)
    model, path = hf_model
    llm = _llm(path, tensor_parallel_size=tp)
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (41, 6, 12)]
        ks = [3, None, 1]
        params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k) for k in ks]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for out, p, k in zip(outs, prompts, ks):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check(out, p, _reference(model, p), k)


def test_prompt_logprobs_survive_preemption(hf_model):
    """A KV cache of two sequences' worth for three: prompts scored in 16-token chunks are preempted and
    recomputed; each prompt token's entry and rank is recorded once and still matches transformers."""
    model, path = hf_model
    llm = _llm(path, kv_cache_memory=65536, max_model_len=128, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (60, 50, 40)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0  # the case tests what it is meant to
    for out, p in zip(outs, prompts):
        _check(out, p, _reference(model, p), 2)


def test_a_rank_counts_the_tokens_tied_with_it():
    """Exact ties (a quantized head can give two tokens one row): a rank counts every token at least as
    likely, itself included, as vLLM's rank does."""
    from kvforge.engine.prompt_scoring import PromptScoring, score_rows

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]] * 4)
    scoring = PromptScoring(torch.tensor([2, 1, 0, 3]), 2, [])
    score_rows(lambda hidden: logits[:hidden.shape[0]], torch.zeros(4, 1), 3, scoring)
    assert scoring.result.token_ranks.tolist() == [2, 2, 3, 4]  # the rank an entry gives a token outside the top
    assert scoring.result.top_ids[:, 0].tolist() in ([1] * 4, [2] * 4)


def test_prompt_logprobs_skip_the_prefix_cache_and_leave_others_alone(hf_model):
    model, path = hf_model
    llm = _llm(path, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 24))
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    # The prompt's blocks are cached now; a request asking for prompt logprobs still scores every token.
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _check(out, prompt, _reference(model, prompt), 1)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_one_token_prompt_has_only_the_leading_none(hf_model):
    _, path = hf_model
    llm = _llm(path)
    out = llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_out_of_range_is_refused():
    from kvforge.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
def test_prompt_logprobs_on_cuda_match_transformers(tmp_path, eager):
    """The Triton backend on CUDA (float32 weights and KV, IEEE float32 dots; async scheduling, the CUDA
    default), chunked prefill of 32 tokens a step: the same tolerance as on CPU."""
    config = dict(CONFIG, hidden_size=128, intermediate_size=256)  # head dim 32, the kernel's smallest
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval().float()
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="auto", block_size=16, skip_tokenizer_init=True,
              kv_cache_memory=1 << 24, progress=False, device="cuda", enforce_eager=eager,
              max_num_batched_tokens=32, enable_chunked_prefill=True)
    assert {layer.backend for layer in llm.plan.layers} == {"triton_paged"}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (70, 13)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p in zip(outs, prompts):
        _check(out, p, _reference(model, p), 3)
    llm.shutdown()
