"""What a step reports as decode and prefill tokens (the step record, /debug/steps, /metrics) when
decoding sequences verify proposals."""

from test_scheduler import make_sched, prompt_of
from test_speculative_scheduler import VerifyingRunner

from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence


def test_a_step_counts_verified_proposals_as_decode_tokens():
    # A decoding sequence with k proposals computes 1 + k query rows, all of them decode tokens; a prompt
    # admitted in the same step is prefill.
    sched, bm = make_sched(num_blocks=32, block_size=4, budget=32)
    for i in range(2):
        sched.add(Sequence(f"r{i}", prompt_of(i, 5), SamplingParams(max_tokens=8, ignore_eos=True)))
    runner = VerifyingRunner(bm)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (10, 0)
    first, second = sorted(sched.running, key=lambda s: s.arrival)
    first.spec_token_ids = [1, 2, 3]
    second.spec_token_ids = []
    sched.add(Sequence("r2", prompt_of(2, 6), SamplingParams(max_tokens=4, ignore_eos=True)))
    out = sched.schedule()
    assert sorted(len(s.spec_token_ids) for s in out.scheduled) == [0, 0, 3]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == ((1 + 3) + 1, 6)
    assert out.num_batched_tokens == 11


def test_a_step_that_proposes_counts_its_proposals_in_its_time(tmp_path):
    """The proposals come before the step's launch and delay every stream in it: the step's record counts
    them, so the gaps a client sees add up to the steps behind them."""
    import json
    import time

    from test_generate_cli import TINY_LLAMA

    from kvforge.llm import LLM

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    engine = llm.engine
    propose, slow = engine.proposer.propose, 0.05

    calls = []

    def slow_propose(seqs):
        calls.append(engine.step_log.total)  # the index the step proposing now will take
        time.sleep(slow)
        return propose(seqs)

    engine.proposer.propose = slow_propose
    llm.generate([{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}],
                 SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps = {s.step: s for s in engine.step_log.last(100)}
    assert len(calls) >= 2 and all(steps[i].seconds >= slow for i in calls), (calls, steps)
    llm.shutdown()
