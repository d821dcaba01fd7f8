"""The startup warm-up (kvforge/engine/warm_up.py): which requests it runs, and that an engine that warmed
up is indistinguishable from one that did not: the same counters, no cached prefix of its prompts, the same
greedy tokens for the same requests."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvforge import LLM, SamplingParams
from kvforge.attention.routing.mla import ABSORBED_PREFILL_MAX_SEQ_LEN
from kvforge.attention.routing.paged import SDPA_PREFILL
from kvforge.config import EngineArgs
from kvforge.engine import warm_up as warm_up_module
from kvforge.engine.warm_up import BASE_PROMPT_LENGTHS, CAPACITY_FRACTION, SHORT_QUERIES, warm_up_rounds
from kvforge.errors import ConfigError

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
MAX_LEN = 512
BUDGET = 256  # a step budget below the longest warm-up prompt: that prompt is chunked


@pytest.mark.parametrize("max_model_len", [2, 3, 8, 64, 512, 4096, 131072])
@pytest.mark.parametrize("step_budget", [16, 2048, 8192])
@pytest.mark.parametrize("capacity", [40, 5000, float("inf")])
def test_rounds_fit_the_engine(max_model_len, step_budget, capacity):
    rounds = warm_up_rounds(max_model_len, step_budget, capacity, vocab_size=100)
    for requests in rounds:
        assert requests and sum(r.prompt_len + r.max_tokens for r in requests) <= CAPACITY_FRACTION * capacity
        for r in requests:
            assert 1 <= r.prompt_len < max_model_len and r.max_tokens >= 1
            assert r.prompt_len + r.max_tokens <= max_model_len
            assert all(0 <= t < 100 for t in r.prompt_token_ids())
            assert len(r.prompt_token_ids()) == r.prompt_len
    if not rounds:
        return
    first = rounds[0]
    assert [r.prompt_len for r in first] == sorted({r.prompt_len for r in first})  # shortest first, distinct
    assert [r.max_tokens for r in first] == sorted(r.max_tokens for r in first)
    assert all(len(requests) == 1 for requests in rounds[1:])  # later requests run alone
    starts = [r.segments[0] for requests in rounds for r in requests]
    for requests in rounds[1:]:
        r = requests[0]
        if len(r.segments) > 1:  # a continuation: it starts with a whole round-1 prompt
            assert r.segments[:-1] in [f.segments for f in first]
            starts.remove(r.segments[0])
    assert len({t for t, _ in starts}) == len(starts)  # other prompts share no first token


def test_rounds_reach_the_paths_where_the_limits_allow():
    rounds = warm_up_rounds(131072, 8192, float("inf"), vocab_size=128256)
    first = rounds[0]
    assert max(r.prompt_len for r in first) > 8192  # one prompt takes two steps
    assert len({r.max_tokens for r in first}) == len(first)  # every request ends in its own step
    lens = {r.prompt_len for r in first}
    assert min(lens) < SDPA_PREFILL.min_query_len < max(lens) and max(lens) > ABSORBED_PREFILL_MAX_SEQ_LEN
    later = [requests[0] for requests in rounds[1:]]
    assert {r.prompt_len for r in later if len(r.segments) == 1} == set(SHORT_QUERIES)
    bases = [r.segments[0][1] for r in later if len(r.segments) > 1]
    assert max(bases) > 8192 and min(bases) + SHORT_QUERIES[-1] <= ABSORBED_PREFILL_MAX_SEQ_LEN


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval().float()
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_LEN,
               max_num_batched_tokens=BUDGET, kv_cache_memory=1 << 24, progress=False, **kw)


def _run(llm):
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (5, 40, 300)]
    # Starts with the shortest warm-up prompt (one block of token 11): no cached block may serve it.
    prompts.append({"prompt_token_ids": [11] * 16 + [7] * 20})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True}, {"num_speculative_tokens": 2}],
                         ids=["sync", "async", "ngram"])
def test_warmed_engine_matches_an_unwarmed_one(model_dir, monkeypatch, kw):
    steps = []
    run = warm_up_module.run_warm_up
    monkeypatch.setattr(warm_up_module, "run_warm_up", lambda engine: steps.append(run(engine)) or steps[-1])
    cold = _llm(model_dir, warm_up=False, **kw)
    assert steps == []
    warm = _llm(model_dir, warm_up=True, **kw)
    try:
        assert len(steps) == 1 and steps[0] >= 8  # it ran: a round of several prompts, then requests alone
        assert warm.engine.stats() == cold.engine.stats()
        assert warm.engine.step_log.total == 0 and warm.engine.runner.num_eager_steps == 0
        bm_warm, bm_cold = warm.engine.block_manager, cold.engine.block_manager
        assert bm_warm.num_free_blocks == bm_cold.num_free_blocks
        # Greedy float32 on one CPU process: the same requests take the same steps on both engines (neither
        # holds anything from before), so the same kernels on the same inputs give bit-equal logits.
        assert _run(warm) == _run(cold)
        assert warm.engine.stats() == cold.engine.stats()
        assert warm.engine.stats()["prefix_cache_hits"] == 0
    finally:
        warm.engine.shutdown()
        cold.engine.shutdown()


def test_default_is_off_on_cpu(model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(warm_up_module, "run_warm_up", lambda engine: calls.append(engine))
    llm = _llm(model_dir)
    llm.engine.shutdown()
    assert calls == []


@pytest.mark.parametrize("kw, words", [(dict(calculate_kv_scales=True), "--calculate-kv-scales")])
def test_refused_combinations_name_the_option(kw, words):
    with pytest.raises(ConfigError, match=words):
        EngineArgs(warm_up=True, **kw)
    EngineArgs(warm_up=None, **kw)  # the default turns itself off there instead


def test_tensor_parallel_warm_up_is_opt_in():
    """At TP > 1 the default leaves the warm-up off (not measured on several GPUs); asking for it is allowed
    (tests/test_tp.py runs it on two CPU ranks)."""
    assert EngineArgs(warm_up=True, tensor_parallel_size=2).warm_up is True
    assert EngineArgs(tensor_parallel_size=2).warm_up is None


def test_a_cache_of_one_sequence_warms_up(tmp_path):
    """Sliding-window groups take a window plus a chunk each: with the least memory the plan accepts (one
    sequence of max-model-len computing a chunk of the step budget), the warm-up runs and the engine then
    serves a request of max-model-len."""
    import re

    from tiny_checkpoints import make_checkpoint

    from kvforge.errors import PlanError

    make_checkpoint("gemma3", tmp_path, sliding_window=128, max_position_embeddings=1024)
    kw = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, progress=False, block_size=4,
              max_model_len=700, max_num_batched_tokens=512)
    with pytest.raises(PlanError, match="only while it decodes") as info:
        LLM(str(tmp_path), kv_cache_memory=280576, **kw)  # one decoding sequence's bytes
    need = int(re.search(r"give at least (\d+) bytes", str(info.value)).group(1))
    cold = LLM(str(tmp_path), warm_up=False, kv_cache_memory=need, **kw)
    warm = LLM(str(tmp_path), warm_up=True, kv_cache_memory=need, **kw)
    try:
        assert warm.engine.stats() == cold.engine.stats()
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        outs = [llm.generate([{"prompt_token_ids": [7] * 699}], params, use_tqdm=False) for llm in (warm, cold)]
        assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    finally:
        warm.engine.shutdown()
        cold.engine.shutdown()


def test_without_chunked_prefill_no_prompt_exceeds_the_base_lengths():
    """A prompt longer than the step budget only makes sense when it is chunked: without chunked prefill the
    budget is max_model_len, and such a prompt would be one huge prefill."""
    rounds = warm_up_rounds(131072, 131072, float("inf"), vocab_size=1000, chunked_prefill=False)
    assert max(r.prompt_len for requests in rounds for r in requests) <= max(BASE_PROMPT_LENGTHS) + SHORT_QUERIES[-1]


@pytest.mark.parametrize("flags, expected", [([], None), (["--warm-up"], True), (["--no-warm-up"], False)])
def test_cli_flag(flags, expected):
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(flags)).warm_up is expected
