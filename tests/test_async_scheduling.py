"""Overlapped scheduling (``--async-scheduling``, kvforge/engine/overlap.py) against the synchronous
engine on the real SmolLM2 GGUF (CPU), under natural EOS, stop strings, seeded sampling,
preemption, prefix-cache hits and aborts; the same accounting.

What is guaranteed: when every request runs to ``max_tokens`` (``ignore_eos``, no stop strings),
both engines run the same rows in the same order at every step, so logits, tokens and logprobs are
bitwise equal (CPU float32 kernels are deterministic for equal shapes). A request that ends on EOS
or a stop string still occupies a row of the overlapped engine's next step (its result dropped),
and preemption or a prefix hit changes what is computed together; those shapes change the float
summation order, so logits differ in the last bits and greedy outputs are compared by the near-tie
rule of tests/greedy_agreement.py.
"""

from __future__ import annotations

import pytest
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree
from test_engine_smollm2 import FP32_BLOCK_BYTES, PROMPTS

from kvforge import SamplingParams
from kvforge.engine.scheduler import Scheduler


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("params", [
    # natural EOS ends two requests early (after 18 and 20 tokens), the others run to max_tokens
    SamplingParams(temperature=0, max_tokens=24, logprobs=2),
    SamplingParams(temperature=0, max_tokens=30, stop=[".", "\n"], logprobs=3),
], ids=["greedy-eos", "stop-strings"])
def test_async_greedy_agrees_with_sync(smol_llm, params):
    """Requests end at different steps, so the batches differ: near-tie rule, logprobs within
    FP32_LOGIT_TOL."""
    sync = smol_llm()
    overlapped = smol_llm(async_scheduling=True)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    agreed = assert_outputs_agree(got, want, FP32_LOGIT_TOL)
    assert agreed >= 0.9 * sum(len(o.outputs[0].token_ids) for o in want)
    reasons = {o.outputs[0].finish_reason for o in want}
    assert "stop" in reasons, "the case must end some requests before max_tokens"
    stats = overlapped.engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=12, seed=3, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
], ids=["seeded", "seeded-logprobs", "greedy"])
def test_async_equals_sync_when_batches_match(smol_llm, params):
    """Every request runs to max_tokens: the same rows at every step in both engines, hence bitwise
    equal logits, and exactly equal tokens, text and logprobs (seeded rows draw from their own
    generators, advanced once per step in both engines)."""
    sync = smol_llm()
    overlapped = smol_llm(async_scheduling=True)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    if params.logprobs:
        assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
    assert overlapped.engine.stats()["kv_blocks_used"] == 0


def test_async_accounting_matches_sync(smol_llm):
    params = SamplingParams(temperature=0, max_tokens=20)
    sync, overlapped = smol_llm(seed=11), smol_llm(seed=11, async_scheduling=True)
    before = [e.engine.stats() for e in (sync, overlapped)]
    outs = [e.generate(PROMPTS[:6], params, use_tqdm=False) for e in (sync, overlapped)]
    after = [e.engine.stats() for e in (sync, overlapped)]
    delta = [{k: a[k] - b[k] for k in ("prompt_tokens_total", "generation_tokens_total",
                                       "prefill_tokens_computed")} for a, b in zip(after, before)]
    assert delta[0] == delta[1]
    assert delta[1]["generation_tokens_total"] == sum(len(o.outputs[0].token_ids) for o in outs[1])


def test_async_preemption_keeps_outputs(smol_llm, monkeypatch):
    """A recompute after preemption computes the prompt again in another batch: near-tie rule."""
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    base = smol_llm()
    small = smol_llm(kv_cache_memory=12 * FP32_BLOCK_BYTES, max_model_len=192, async_scheduling=True)
    want = base.generate(PROMPTS[:8], params, use_tqdm=False)
    before = small.engine.stats()["num_preemptions"]
    got = small.generate(PROMPTS[:8], params, use_tqdm=False)
    stats = small.engine.stats()
    assert stats["num_preemptions"] > before, "the test must actually preempt"
    assert_outputs_agree(got, want, FP32_LOGIT_TOL)
    assert stats["kv_blocks_used"] == 0


def test_async_resolves_first_under_memory_pressure(smol_llm, monkeypatch):
    """When the next step might not fit (``Scheduler.next_step_may_preempt``), the overlapped engine
    resolves the step in flight before scheduling, so sequences that finished in it free their blocks
    first. Outputs agree with the synchronous engine (the preemptions differ, so greedy with the
    near-tie rule), and no more preemptions than it (before this rule, finished sequences held
    their blocks one step longer and async preempted more)."""
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    params = SamplingParams(temperature=0, max_tokens=32, stop=["."], logprobs=2)
    prompts = (PROMPTS * 4)[:16]
    kw = dict(kv_cache_memory=14 * FP32_BLOCK_BYTES, max_model_len=192)
    sync, overlapped = smol_llm(**kw), smol_llm(async_scheduling=True, **kw)
    before = [e.engine.stats() for e in (sync, overlapped)]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    after = [e.engine.stats() for e in (sync, overlapped)]
    assert_outputs_agree(got, want, FP32_LOGIT_TOL)
    preempted = [a["num_preemptions"] - b["num_preemptions"] for a, b in zip(after, before)]
    assert preempted[0] > 0, "the case must put the pool under pressure"
    assert after[1]["async_pressure_resolves"] > before[1]["async_pressure_resolves"]
    assert preempted[1] <= preempted[0]


def test_async_prefix_cache_hit(smol_llm):
    """A prefix hit prefills only the suffix (another summation order): near-tie rule."""
    llm = smol_llm(async_scheduling=True, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    shared = ("You are a helpful assistant. Answer briefly and precisely. Context: the Eiffel tower is in "
              "Paris, the Colosseum is in Rome, and the Sagrada Familia is in Barcelona. ")
    llm.generate(shared + "Where is the Colosseum?", params, use_tqdm=False)
    second = llm.generate(shared + "Where is the Eiffel tower?", params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 32
    plain = smol_llm(enable_prefix_caching=False)
    want = plain.generate(shared + "Where is the Eiffel tower?", params, use_tqdm=False)
    assert_outputs_agree([second], want, FP32_LOGIT_TOL)


def test_async_abort_in_flight(smol_llm):
    """Aborting a request whose token is in flight frees it at once; the others are unaffected
    (their batch shrinks, so near-tie rule)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    want = smol_llm().generate(PROMPTS[:3], params, use_tqdm=False)
    engine = smol_llm(async_scheduling=True, seed=9).engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", p, params)
    for _ in range(5):
        engine.step()
    assert engine.scheduler.requests["r1"].num_pending == 1
    engine.abort_request("r1")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "r1" not in done
    assert_outputs_agree([done["r0"], done["r2"]], [want[0], want[2]], FP32_LOGIT_TOL)
    assert engine.stats()["kv_blocks_used"] == 0


def test_async_preempted_before_resolve_keeps_prefix_cache():
    """A sequence preempted while its last step is still unresolved keeps that step's full blocks in the
    prefix cache (registered at launch, as the synchronous update does), so its recompute hits them
    instead of recomputing from scratch (a long chunked prompt used to thrash)."""
    from kvforge.engine.block_manager import BlockManager
    from kvforge.engine.sequence import Sequence

    # Block size 4, 9 blocks. a: 12 prompt tokens and a long output; b: 16 prompt tokens, prefilled one token
    # a step beside a's decode (threshold 1). b is admitted with its whole prompt and a block of growth
    # for each in the free blocks; a's growth outruns that while b is still mid-prefill.
    bm = BlockManager(num_blocks=9, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, long_prefill_token_threshold=1)
    a = Sequence("a", list(range(1, 13)), SamplingParams(max_tokens=24, ignore_eos=True))
    b = Sequence("b", list(range(100, 116)), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    prev = sched.schedule()  # a: 12 tokens; b: its first 4-token chunk (one full block)
    assert [(s.request_id, s.num_new_tokens) for s in prev.scheduled] == [("a", 12), ("b", 4)]
    sched.advance(prev)  # launched, not resolved
    while True:
        computed = b.num_computed_tokens  # counts the launched, unresolved step
        cur = sched.schedule()
        if cur.preempted:
            break
        sched.advance(cur)
        sched.resolve(prev, {"a": 7})
        prev = cur
    assert cur.preempted == [b] and not b.block_table and 4 < computed < 16
    assert len(bm.lookup_prefix(b)) == computed // 4, "b's computed blocks must stay in the prefix cache"
    sched.advance(cur)
    sched.resolve(prev, {"a": 7})
    bm.check_invariants([a])


def test_next_step_may_preempt_counts_blocks_by_hand():
    """Block size 4, 6 blocks. a: 12 prompt tokens (3 blocks), b: 4 (1 block) -> 2 free blocks after the
    first step, a block of growth for each. Both decode in lock step, a token in flight each: the in-flight
    tokens at positions 12 and 4 need a block each (2 of 2 free -> False); the next three lie in held
    blocks (False); after the fifth launch a's 17th token needs a 5th block and b's 9th a 3rd, none
    free -> True. b's fifth token is its last (max_tokens=5): once resolved b frees its 2 blocks, and
    a needs 1 of 2 free -> False."""
    from kvforge.engine.block_manager import BlockManager
    from kvforge.engine.sequence import Sequence

    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    a = Sequence("a", list(range(1, 13)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = Sequence("b", list(range(100, 104)), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [s.request_id for s in step.scheduled] == ["a", "b"] and bm.num_free_blocks == 2
    assert not sched.next_step_may_preempt()  # the scheduled chunks already own their blocks
    for k in range(1, 6):
        sched.advance(step)  # one token in flight for each
        assert sched.next_step_may_preempt() == (k == 5), k
        if k == 5:
            break
        sched.resolve(step, {"a": 7, "b": 9})
        step = sched.schedule()
        assert not step.preempted
    finished = sched.resolve(step, {"a": 7, "b": 9})  # b reaches max_tokens=5 and frees its 2 blocks
    assert [s.request_id for s in finished] == ["b"] and bm.num_free_blocks == 2
    assert not sched.next_step_may_preempt()


def test_async_scheduling_refused_for_ring_models_before_weights():
    """Ring (CsaRing) models keep per-request state slots bound to the synchronous step: an explicit
    --async-scheduling fails with the reason, before any weight is read."""
    from kvforge import LLM
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match="async-scheduling.*ring"):
        LLM("csa-ring-test", load_format="dummy", async_scheduling=True, progress=False)
