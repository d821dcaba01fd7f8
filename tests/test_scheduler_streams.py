"""The scheduling rule for running streams: every decoding sequence gets its token in every step its
blocks allow, and between two tokens of a stream runs one step with at most one bounded prefill chunk
(``long_prefill_token_threshold`` while decodes run, the budget otherwise). Scheduler level, with the
token-id "model" of tests/test_scheduler.py, which also checks every sequence's cached context."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from test_scheduler import FakeRunner, expected_output, prompt_of  # noqa: E402


def decoding(sched: Scheduler) -> list[Sequence]:
    """Running sequences that are due exactly one token (their prompt is done) and may still get one."""
    return [s for s in sched.running
            if s.num_tokens + s.num_pending - s.num_computed_tokens == 1 and s.num_computed_tokens >= s.num_prompt_tokens
            and not sched._reaches_length_limit(s)]


class StreamWatch:
    """Checks the rule step by step and keeps, per request, the prefill tokens of the steps between
    two of its tokens."""

    def __init__(self, sched: Scheduler, threshold: int):
        self.sched = sched
        self.threshold = threshold
        self.prefill_since: dict[str, int] = {}  # request -> prefill tokens since its last token
        self.worst_gap_prefill = 0
        self.steps = 0

    def step(self, runner: FakeRunner) -> list[Sequence]:
        due = decoding(self.sched)
        out = self.sched.schedule()
        self.steps += 1
        got = {s.request_id for s in out.scheduled if s.do_sample}
        preempted = {s.request_id for s in out.preempted}
        starved = [s.request_id for s in due if s.request_id not in got and s.request_id not in preempted]
        assert not starved, f"step {self.steps}: decoding {starved} got no token"
        # The decodes are the tokens of the streams that were due one; every other token (prompt chunks, a
        # prompt's last token alone, recomputes, admissions) is prefill.
        due_ids = {s.request_id for s in due}
        decode = sum(s.num_new_tokens for s in out.scheduled if s.request_id in due_ids)
        assert out.num_decode_tokens == decode, f"step {self.steps}"
        assert out.num_prefill_tokens + out.num_decode_tokens == out.num_batched_tokens
        if out.num_decode_tokens and self.threshold:
            assert out.num_prefill_tokens <= self.threshold, (
                f"step {self.steps}: {out.num_prefill_tokens} prefill tokens next to decodes")
        for rid in list(self.prefill_since):
            self.prefill_since[rid] += out.num_prefill_tokens
        for rid in got:
            if rid in self.prefill_since:
                self.worst_gap_prefill = max(self.worst_gap_prefill, self.prefill_since[rid])
            self.prefill_since[rid] = 0
        for rid in preempted:  # a recompute is a new first token, not a gap of the stream
            self.prefill_since.pop(rid, None)
        finished = self.sched.update(out, runner.execute(out))
        for seq in finished:
            self.prefill_since.pop(seq.request_id, None)
        return finished


def run_streams(sched: Scheduler, arrivals: dict[int, list[Sequence]], threshold: int,
                runner: FakeRunner | None = None) -> tuple[dict, StreamWatch]:
    runner = runner or FakeRunner(sched.block_manager)
    watch = StreamWatch(sched, threshold)
    done = {}
    step = 0
    while arrivals or sched.has_unfinished_requests():
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        for seq in watch.step(runner):
            done[seq.request_id] = seq
        step += 1
        assert step < 5000, "no progress"
    return done, watch


def test_running_decodes_get_a_token_every_step_while_long_prompts_arrive():
    """16 streams decode while a long prompt arrives every few steps: each stream gets a token in
    every step, and the prefill run between two of its tokens stays within the threshold."""
    budget, threshold = 256, 32
    bm = BlockManager(1024, 4, True)
    sched = Scheduler(bm, 64, budget, 512, long_prefill_token_threshold=threshold)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short = [Sequence(f"d{i}", prompt_of(i, 5), params) for i in range(16)]
    long = [Sequence(f"p{i}", prompt_of(20 + i, 200), SamplingParams(max_tokens=4, ignore_eos=True))
            for i in range(6)]
    arrivals = {0: short}
    for i, seq in enumerate(long):
        arrivals[2 + 3 * i] = [seq]
    done, watch = run_streams(sched, arrivals, threshold)
    assert watch.worst_gap_prefill == threshold  # the long prompts went through in chunks of the threshold
    for seq in short + long:
        assert done[seq.request_id].output_token_ids == expected_output(
            seq.prompt_token_ids, seq.params.max_tokens)


def test_an_older_prompt_mid_prefill_does_not_starve_a_decode():
    """A prompt that arrived first but was queued second (it is older by arrival) is mid-prefill while
    the other stream decodes: the decode still gets its token every step, next to one chunk."""
    bm = BlockManager(256, 4, False)
    sched = Scheduler(bm, 8, 16, 256)
    old = Sequence("old", prompt_of(1, 100), SamplingParams(max_tokens=3, ignore_eos=True))
    young = Sequence("young", prompt_of(2, 2), SamplingParams(max_tokens=12, ignore_eos=True))
    assert old.arrival < young.arrival
    sched.add(young)
    sched.add(old)
    runner = FakeRunner(bm)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append({s.request_id: s.num_new_tokens for s in out.scheduled})
        sched.update(out, runner.execute(out))
    assert steps[0] == {"young": 2, "old": 14}
    young_steps = [i for i, st in enumerate(steps) if "young" in st]
    assert young_steps == list(range(12)), f"young got no token in steps {sorted(set(range(12)) - set(young_steps))}"
    assert all(st.get("old", 0) <= 15 for st in steps)  # one chunk: the budget less young's token
    assert young.output_token_ids == expected_output(young.prompt_token_ids, 12)
    assert old.output_token_ids == expected_output(old.prompt_token_ids, 3)


def test_a_step_without_decodes_uses_the_whole_budget():
    bm = BlockManager(256, 4, False)
    sched = Scheduler(bm, 8, 64, 256, long_prefill_token_threshold=8)
    for i in range(3):
        sched.add(Sequence(f"r{i}", prompt_of(i, 30), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 30), ("r1", 30), ("r2", 4)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (64, 0)
    sched.update(out, FakeRunner(bm).execute(out))
    out = sched.schedule()  # r0 and r1 decode now: r2's next chunk is cut to the threshold
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 8)]


def test_a_prompts_last_token_alone_is_prefill_not_a_decode():
    """A prompt whose last chunk is one token is prefill: on an idle engine it does not count as a decode that
    would cut the step to the threshold, and beside a decode it counts toward the threshold."""
    bm = BlockManager(256, 4, False)
    sched = Scheduler(bm, 8, 64, 256, long_prefill_token_threshold=8)
    sched.add(Sequence("a", prompt_of(0, 65), SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.add(Sequence("b", prompt_of(1, 200), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 64)]
    sched.update(out, FakeRunner(bm).execute(out))
    out = sched.schedule()  # nothing decodes yet: a's last token and 63 of b's, the whole budget
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 63)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (64, 0)

    bm = BlockManager(256, 4, False)
    sched = Scheduler(bm, 8, 64, 256, long_prefill_token_threshold=8)
    runner = FakeRunner(bm)
    sched.add(Sequence("d", prompt_of(2, 5), SamplingParams(max_tokens=20, ignore_eos=True)))
    out = sched.schedule()
    sched.update(out, runner.execute(out))  # d decodes from now on
    sched.add(Sequence("r", prompt_of(3, 9), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()  # beside d's decode r gets the threshold's 8 tokens
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 1), ("r", 8)]
    sched.update(out, runner.execute(out))
    sched.add(Sequence("q", prompt_of(4, 30), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()  # r's last token is prefill: with it q gets 7 tokens, 8 in all beside the decode
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("d", 1), ("r", 1), ("q", 7)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (8, 1)


def test_the_threshold_is_off_without_chunked_prefill_and_must_not_be_negative():
    bm = BlockManager(64, 4, False)
    assert Scheduler(bm, 4, 64, 64, enable_chunked_prefill=False,
                     long_prefill_token_threshold=8).long_prefill_token_threshold == 0
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        Scheduler(bm, 4, 64, 64, long_prefill_token_threshold=-1)


def test_preemption_takes_a_prompt_mid_prefill_before_a_decode():
    """Out of blocks, the step keeps the decode and preempts the sequence mid-prefill, even when that
    one is older by arrival."""
    # Blocks of one token; with a decode in the step a prefill takes at most 2 tokens (threshold), so old's
    # prompt is still mid-prefill when young's growth has used the room left at old's admission.
    bm = BlockManager(24, 1, False)
    sched = Scheduler(bm, 4, 16, 64, long_prefill_token_threshold=2)
    old = Sequence("old", prompt_of(1, 20), SamplingParams(max_tokens=3, ignore_eos=True))
    young = Sequence("young", prompt_of(2, 2), SamplingParams(max_tokens=12, ignore_eos=True))
    runner = FakeRunner(bm)
    sched.add(young)
    sched.add(old)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("young", 2), ("old", 14)]
    while not out.preempted:
        sched.update(out, runner.execute(out))
        out = sched.schedule()
        assert old.num_computed_tokens < old.num_prompt_tokens or out.preempted  # still mid-prefill
    assert [s.request_id for s in out.preempted] == ["old"]
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("young", 1)]
    sched.update(out, runner.execute(out))
    done, _ = run_streams(sched, {}, threshold=0, runner=runner)
    assert done["young"].output_token_ids == expected_output(young.prompt_token_ids, 12)
    assert done["old"].output_token_ids == expected_output(old.prompt_token_ids, 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 32),
    threshold=st.integers(0, 12),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    reqs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 8), st.integers(0, 6)),
                  min_size=1, max_size=8),
)
def test_random_workloads_keep_the_rule_and_exact_outputs(num_blocks, block_size, budget, threshold,
                                                          max_num_seqs, prefix, reqs):
    max_model_len = 24
    budget = max(budget, max_num_seqs)  # room for every running decode (a smaller budget must drop some)
    bm = BlockManager(num_blocks, block_size, prefix)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, long_prefill_token_threshold=threshold)
    arrivals: dict[int, list[Sequence]] = {}
    expected = {}
    for k, (family, plen, max_tokens, step) in enumerate(reqs):
        seq = Sequence(f"r{k}", prompt_of(family, plen), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        if sched.max_blocks_needed(seq) > num_blocks:
            continue
        arrivals.setdefault(step, []).append(seq)
        expected[seq.request_id] = expected_output(seq.prompt_token_ids, min(max_model_len - plen, max_tokens))
    done, watch = run_streams(sched, arrivals, threshold)
    limit = threshold if threshold else budget
    assert watch.worst_gap_prefill <= max(limit, 0)
    assert {r: s.output_token_ids for r, s in done.items()} == expected
    assert bm.num_used_blocks == 0


def test_engine_flag_is_checked_before_anything_loads():
    from kvforge.config import EngineArgs

    with pytest.raises(ConfigError, match="needs chunked prefill"):
        EngineArgs(long_prefill_token_threshold=512, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="must be >= 0"):
        EngineArgs(long_prefill_token_threshold=-1)
    assert EngineArgs(enable_chunked_prefill=False).long_prefill_token_threshold is None  # the default stays valid


def test_without_chunked_prefill_the_budget_holds_the_longest_prompt(monkeypatch):
    """vLLM's habit: with chunked prefill off and no --max-num-batched-tokens, a step holds max_model_len
    tokens; an explicit smaller budget fails before any weight is read."""
    from kvforge.config import EngineArgs
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.errors import ConfigError

    args = dict(device="cpu", progress=False, kv_cache_memory=1 << 28, max_model_len=4096, skip_tokenizer_init=True,
                enable_chunked_prefill=False)
    engine = LLMEngine(EngineArgs(**args))
    assert engine.scheduler.max_num_batched_tokens == 4096
    engine.shutdown()

    def fail(*a, **k):
        raise AssertionError("weights were loaded before the flag was checked")

    monkeypatch.setattr("kvforge.models.registry.build_model", fail)
    with pytest.raises(ConfigError, match="lower --max-model-len"):
        LLMEngine(EngineArgs(**args, max_num_batched_tokens=2048))
