"""The proposal back-off (kvforge/speculative/backoff.py) and the engine around it: a sequence whose
probes gain nothing skips proposals for 2, 4, 8, ... steps (at most ``max_skip``), an accepted proposal
ends the streak, and skipping never changes greedy output (speculation off is the reference)."""

from __future__ import annotations

from test_speculative_engine import GarbageProposer, embedded, generate, token_ids

from kvforge import SamplingParams
from kvforge.speculative.backoff import ProposalBackoff


def test_streak_schedule():
    b = ProposalBackoff(min_streak=3, max_skip=8)
    probes, step = [], 0
    while step < 60:
        if b.due("r", step):
            probes.append(step)
            b.record("r", step, 3, 0)
        step += 1
    # Probes at 0, 1, 2 (streak below 3), then gaps of 2, 4, 8, 8, ... skipped steps.
    assert probes[:7] == [0, 1, 2, 5, 10, 19, 28]
    assert all(b - a == 9 for a, b in zip(probes[5:], probes[6:]))


def test_an_acceptance_ends_the_streak_and_forget_resets():
    b = ProposalBackoff(min_streak=1, max_skip=32)
    b.record("r", 0, 2, 0)
    assert not b.due("r", 1) and not b.due("r", 2) and b.due("r", 3)
    b.record("r", 3, 2, 1)
    assert b.due("r", 4)
    b.record("r", 4, 0, 0)  # nothing proposed counts as a probe without gain
    assert not b.due("r", 5)
    b.forget("r")
    assert b.due("r", 5)


PROMPTS = ["Write a short note about the sea.", "Count: one, two, three, four, five, six,"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_garbage_proposals_back_off_and_keep_greedy_output():
    ref = token_ids(generate(embedded(), PROMPTS, PARAMS))
    on = embedded(num_speculative_tokens=3)
    on.engine.proposer = GarbageProposer(3, on.engine.spec.vocab_size)
    outs = generate(on, PROMPTS, PARAMS)
    assert token_ids(outs) == ref
    drafts = on.engine.stats()["spec_decode"]["num_drafts"]
    assert 0 < drafts < 20  # every request probed, far from once per token (2 x 23 decode steps)

    every = embedded(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "backoff": False})
    every.engine.proposer = GarbageProposer(3, every.engine.spec.vocab_size)
    assert token_ids(generate(every, PROMPTS, PARAMS)) == ref
    assert every.engine.stats()["spec_decode"]["num_drafts"] >= 42  # without back-off: (nearly) every decode step


def test_async_steps_feed_a_draft_model_through_placeholders(tmp_path):
    """Under async scheduling the steps without proposals overlap: the draft follows them with the in-flight
    token gathered on the device. A tiny Llama as its own draft, probed every third step or so: its KV of every
    followed position must equal the target's, or its proposals (the target's own argmax) would be rejected."""
    from test_speculative_engine import LLAMA, TINY_PROMPTS, save_tiny

    from kvforge import LLM

    path = save_tiny(tmp_path, LLAMA)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = token_ids(generate(LLM(path, **kw), TINY_PROMPTS, params))
    on = LLM(path, async_scheduling=True, **kw,
             speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    engine = on.engine
    assert engine.async_scheduling and engine.spec_backoff is not None
    # Probe again three plain steps after a probe's tokens (its proposals are all accepted: 3 tokens).
    probed = {}
    engine.spec_backoff.record = lambda request_id, clock, proposed, accepted: probed.__setitem__(request_id, clock)
    engine.spec_backoff.due = lambda request_id, clock: clock >= probed.get(request_id, -6) + 6
    launched = []
    launch = engine._launch
    engine._launch = lambda out, prev, *began: (launched.append(prev is not None), launch(out, prev, *began))[1]
    assert token_ids(generate(on, TINY_PROMPTS, params, check=False)) == ref  # (its invariants assume sync steps)
    spec = engine.stats()["spec_decode"]
    assert spec["num_drafts"] >= 10 and spec["num_accepted_tokens"] >= 0.95 * spec["num_draft_tokens"], spec
    assert sum(launched) >= 5, launched  # steps launched while their predecessor was in flight
