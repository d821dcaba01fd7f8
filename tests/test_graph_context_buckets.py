"""Decode CUDA graphs per context bucket (kvforge/engine/cuda_graphs.py, invariant 4).

A decode step replays the graph of the smallest context bucket holding its longest sequence, so a
short context runs the kernel and split count the routing table picks at that bucket, not at
``max_model_len``. On CPU, ``DecodeGraphs(capture=False)`` runs the same static inputs eagerly, which
shows which bucket each step used and that crossing a bucket boundary mid-decode keeps the tokens of
the eager engine (near-tie rule of tests/greedy_agreement.py: padding and another split order change
the summation order). On CUDA the captured graphs are compared with the CPU engine.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.engine.cuda_graphs import GRAPH_CONTEXT_BUCKETS, DecodeGraphs, graph_contexts  # noqa: E402

CFG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=256, vocab_size=256, max_position_embeddings=8192, rms_norm_eps=1e-5)
MAX_MODEL_LEN = 8192
# The first prompt starts 8 tokens below the 2048 bucket and crosses it while decoding 24 tokens.
PROMPT_LENS = (2040, 70, 300)


def test_buckets_below_max_model_len_then_max_model_len():
    assert graph_contexts(131072) == [*GRAPH_CONTEXT_BUCKETS, 131072]
    assert graph_contexts(8192) == [2048, 4096, 8192]
    assert graph_contexts(2048) == [2048]
    assert graph_contexts(1000) == [1000]
    # a fixed bucket at most an eighth below max_model_len is left out (its graphs would nearly repeat)
    assert graph_contexts(32808) == [2048, 4096, 8192, 16384, 32808]
    assert graph_contexts(36865) == [2048, 4096, 8192, 16384, 32768, 36865]
    assert graph_contexts(2304) == [2304] and graph_contexts(2305) == [2048, 2305]
    assert graph_contexts(MAX_MODEL_LEN) == sorted(set(graph_contexts(MAX_MODEL_LEN)))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_8k")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval().float()
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _llm(path, device, **kw):
    return LLM(path, block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 24, progress=False,
               device=device, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, dtype="float32", **kw)


def _greedy(llm):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2), use_tqdm=False)


def test_decode_replays_the_smallest_bucket_holding_the_context(tiny_llama):
    eager = _greedy(_llm(tiny_llama, "cpu"))
    llm = _llm(tiny_llama, "cpu")
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_num_seqs=4, capture=False)
    assert runner.graphs.contexts == [2048, 4096, 8192]
    seen = []  # (bucket the step's metadata names, the step's longest context)
    forward = runner.forward

    def spy(ids, pos, meta, *args, **kw):
        metas = meta if isinstance(meta, tuple) else (meta,)
        if metas[0].max_query_len == 1 and metas[0].max_seq_len in runner.graphs.contexts:
            seen.append((metas[0].max_seq_len, int(metas[0].seq_lens.max())))
        return forward(ids, pos, meta, *args, **kw)

    runner.forward = spy
    outs = _greedy(llm)
    assert_outputs_agree(outs, eager, FP32_LOGIT_TOL)
    assert llm.engine.stats()["graph_steps"] >= 20
    assert {bucket for bucket, _ in seen} == {2048, 4096}
    for bucket, longest in seen:
        assert longest <= bucket
        assert bucket == 2048 or longest > 2048  # the smallest bucket holding the context


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_buckets_follow_cpu_greedy(tiny_llama):
    cpu = _greedy(_llm(tiny_llama, "cpu"))
    gpu = _llm(tiny_llama, "cuda")
    graphs = gpu.engine.runner.graphs
    assert graphs is not None and {c for _, c, _ in graphs.graphs} == {2048, 4096, 8192}
    assert_outputs_agree(_greedy(gpu), cpu, FP32_LOGIT_TOL)
    assert gpu.engine.stats()["graph_steps"] >= 20
