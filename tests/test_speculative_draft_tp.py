"""Speculative decoding with a draft model at tensor parallelism 2 on CPU (gloo, 2 processes).

Every rank runs its slice of the draft over its own pool's draft layers (the target's KV-head split,
replication rule included); rank 0 broadcasts each draft step like a target step and picks the proposals.
Greedy tokens follow TP=2 without speculation by the near-tie rule of tests/greedy_agreement.py (the verify
rows change the batch's float summation order), and after the run no block is held.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_outputs_agree
from test_speculative_engine import LLAMA, TINY_PROMPTS, save_tiny

pytest.importorskip("transformers")

from kvforge import SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 20, progress=False, device="cpu", max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def draft_config(model, k, **extra):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


def run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    assert llm.engine.block_manager.num_used_blocks == 0  # every finished request freed its blocks, draft's too
    return outs


def reference(llm, prompts):
    """Speculation off at TP=2, then shut down (one tensor-parallel engine per process)."""
    try:
        return run(llm, prompts)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """The tiny random Llama target (``save_tiny`` seeds it: every test sees the same weights)."""
    return save_tiny(tmp_path_factory.mktemp("target"), LLAMA)


@pytest.fixture(scope="module")
def target_tp2_reference(target):
    """The target's greedy outputs for TINY_PROMPTS at TP=2 with speculation off and ENGINE's settings."""
    from kvforge import LLM

    return reference(LLM(target, **ENGINE, tensor_parallel_size=2), TINY_PROMPTS)


CHUNKED_PROMPTS = TINY_PROMPTS + [list(range(100, 140))]
# A 12-token step budget chunks the prompts (the draft follows each chunk on every rank).
CHUNKED_FP8 = dict(kv_cache_dtype="fp8", max_model_len=64, max_num_batched_tokens=12, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def chunked_fp8_reference(target):
    """The target's greedy outputs for CHUNKED_PROMPTS at TP=2 with speculation off, fp8 KV, chunked prefill."""
    from kvforge import LLM

    return reference(LLM(target, **{**ENGINE, **CHUNKED_FP8}), CHUNKED_PROMPTS)


def check_draft_heads(engine, want: list[int]) -> None:
    """Each rank holds the plan's KV heads per draft layer (the target's split or replication rule)."""
    assert [lp.kv_heads_per_rank for lp in engine.plan.draft.layers] == want
    assert [r["draft_kv_heads"] for r in engine.tp.reports] == [want, want]


def test_target_as_its_own_draft(target, target_tp2_reference, engines):
    on = engines(target, tensor_parallel_size=2, speculative_config=draft_config(target, 3))
    check_draft_heads(on.engine, [1, 1])  # 2 KV heads split over 2 ranks
    assert_outputs_agree(run(on, TINY_PROMPTS), target_tp2_reference)
    counters = on.engine.stats()["spec_decode"]
    # The draft is the target, sharded the same way: it proposes the target's argmax (up to summation order).
    assert counters["num_accepted_tokens"] / counters["num_draft_tokens"] > 0.9
    assert on.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kv_heads, per_rank", [(2, 1), (1, 1)])  # split; replicated (1 KV head < 2 ranks)
def test_different_draft_with_fp8_and_chunked_prefill(tmp_path, engines, target, chunked_fp8_reference, kv_heads,
                                                      per_rank):
    torch.manual_seed(1)
    draft = save_tiny(tmp_path / "draft", (LLAMA[0], LLAMA[1], dict(
        LLAMA[2], num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=kv_heads,
        intermediate_size=48)))
    # Back-off off: a random draft's proposals fail, and this test wants them verified every step.
    on = engines(target, speculative_config=draft_config(draft, 3, backoff=False), **CHUNKED_FP8)
    plan = on.engine.plan
    # Per rank the draft layer has the target's page (1 KV head of 16): it joins the target's group.
    assert [(g.layers, g.draft_layers) for g in plan.groups] == [((0, 1), (0,))]
    assert all(layer.kv_dtype == "fp8_e4m3" for layer in plan.draft.layers)
    check_draft_heads(on.engine, [per_rank])
    assert_outputs_agree(run(on, CHUNKED_PROMPTS), chunked_fp8_reference)
    stats = on.engine.stats()
    assert stats["spec_decode"]["num_draft_tokens"] > 50 and stats["kv_blocks_used"] == 0


def test_draft_of_half_the_page_per_rank_shares_page_slots(tmp_path, engines, target, target_tp2_reference):
    """A 2-layer draft of 2 KV heads of 8 (the target: 2 of 16): per rank 1 head of 8, half the rank's page,
    so both draft layers share one page slot of every rank's pool, each on a slice of every page."""
    torch.manual_seed(1)
    draft = save_tiny(tmp_path / "draft", (LLAMA[0], LLAMA[1], dict(
        LLAMA[2], num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=32)))
    on = engines(target, tensor_parallel_size=2, speculative_config=draft_config(draft, 2, backoff=False))
    assert [(g.draft_layers, g.draft_layers_per_slot) for g in on.engine.plan.groups if g.draft_layers] == [((0, 1), 2)]
    check_draft_heads(on.engine, [1, 1])
    assert_outputs_agree(run(on, TINY_PROMPTS), target_tp2_reference)
    stats = on.engine.stats()
    assert stats["spec_decode"]["num_draft_tokens"] > 20 and stats["kv_blocks_used"] == 0


def test_async_scheduling_with_a_draft(target, target_tp2_reference, engines):
    """Async scheduling: the draft follows steps whose last token is still in flight; every rank gathers it
    from rank 0's shared tokens of the step before (the target step's placeholders and the draft's alike)."""
    on = engines(target, tensor_parallel_size=2, async_scheduling=True, speculative_config=draft_config(target, 3))
    engine = on.engine
    assert engine.async_scheduling
    engine.spec_backoff.due = lambda request_id, step: step % 3 == 0  # overlapped steps between the probes
    assert_outputs_agree(run(on, TINY_PROMPTS), target_tp2_reference)
    assert engine.stats()["spec_decode"]["num_drafts"] > 0 and engine.stats()["kv_blocks_used"] == 0


def test_a_draft_without_a_tensor_parallel_implementation_is_refused_before_any_worker_starts():
    from kvforge.distributed.launcher import TPLauncher
    from kvforge.errors import ConfigError

    draft = {"hf_config": {"architectures": ["CsaRingTestForCausalLM"]}, "model_path": None, "load_format": "dummy"}
    with pytest.raises(ConfigError, match="the draft model .*CsaRingTestForCausalLM runs at TP 1 only"):
        TPLauncher(None, None, {"architectures": ["LlamaForCausalLM"]}, "float32", torch.device("cpu"), None,
                   "dummy", draft=draft)
