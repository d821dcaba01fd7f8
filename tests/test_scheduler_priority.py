"""The priority scheduling policy (``--scheduling-policy priority``, kvforge/engine/scheduler.py): waiting requests
are admitted lowest priority first, the least urgent running request is the one preempted, outputs are those of
the fcfs policy; under fcfs a priority is refused."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, expected_output, make_sched, prompt_of, run_all

from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence
from kvforge.errors import ConfigError, InvalidRequestError


def _params(max_tokens=4):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_waiting_requests_run_lowest_priority_first():
    sched, bm = make_sched(max_num_seqs=1, policy="priority")
    for name, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        sched.add(Sequence(name, prompt_of(ord(name), 5), _params(), priority=priority))
    order = []

    def admitted(out):
        order.extend(s.seq.request_id for s in out.scheduled if s.start_pos == 0)

    done = run_all(sched, FakeRunner(bm), on_step=admitted)
    assert order == ["b", "d", "c", "a"]  # by priority, arrival order among equals
    for name in "abcd":
        assert done[name].output_token_ids == expected_output(prompt_of(ord(name), 5), 4)


def test_fcfs_keeps_arrival_order_and_refuses_priorities():
    sched, bm = make_sched(max_num_seqs=1)
    for name in "abc":
        sched.add(Sequence(name, prompt_of(ord(name), 5), _params()))
    order = []
    run_all(sched, FakeRunner(bm), on_step=lambda out: order.extend(
        s.seq.request_id for s in out.scheduled if s.start_pos == 0))
    assert order == ["a", "b", "c"]
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as err:
        sched.add(Sequence("x", prompt_of(1, 5), _params(), priority=3))
    assert err.value.field == "priority"
    with pytest.raises(ConfigError, match="scheduling policy must be one of fcfs, priority"):
        make_sched(policy="lifo")


@pytest.mark.parametrize("policy, victim", [("fcfs", "urgent"), ("priority", "relaxed")])
def test_the_least_urgent_running_request_is_preempted(policy, victim):
    """Two requests that cannot both grow in 6 blocks of 4: fcfs preempts the later arrival, the priority
    policy the less urgent one, which arrived first."""
    sched, bm = make_sched(num_blocks=6, block_size=4, budget=64, policy=policy)
    urgent_priority = -1 if policy == "priority" else 0
    sched.add(Sequence("relaxed", prompt_of(1, 8), _params(8)))
    sched.add(Sequence("urgent", prompt_of(2, 8), _params(8), priority=urgent_priority))
    preempted = []
    done = run_all(sched, FakeRunner(bm), on_step=lambda out: preempted.extend(s.request_id for s in out.preempted))
    assert preempted and set(preempted) == {victim}
    for name, i in (("relaxed", 1), ("urgent", 2)):  # nothing generated is lost
        assert done[name].output_token_ids == expected_output(prompt_of(i, 8), 8)
    assert bm.num_used_blocks == 0


def test_an_urgent_prompt_does_not_stall_decoding_streams():
    """A decoding stream of low priority keeps its token in every step while an urgent long prompt is
    computed in chunks of at most the threshold beside it."""
    sched, bm = make_sched(num_blocks=256, budget=64, max_model_len=512, long_prefill_token_threshold=16,
                           policy="priority")
    sched.add(Sequence("stream", prompt_of(1, 6), _params(30), priority=5))
    runner = FakeRunner(bm)
    for _ in range(3):
        sched.update(out := sched.schedule(), runner.execute(out))
    sched.add(Sequence("urgent", prompt_of(2, 100), _params(2), priority=0))
    for _ in range(8):
        out = sched.schedule()
        tokens = {s.request_id: s.num_new_tokens for s in out.scheduled}
        assert tokens.get("stream") == 1 and out.num_prefill_tokens <= 16, tokens
        sched.update(out, runner.execute(out))


def test_a_preempted_request_waits_in_its_priority_place():
    sched, bm = make_sched(num_blocks=6, block_size=4, budget=64, max_num_seqs=2, policy="priority")
    sched.add(Sequence("low", prompt_of(1, 8), _params(8), priority=5))
    sched.add(Sequence("high", prompt_of(2, 8), _params(8), priority=0))
    runner = FakeRunner(bm)
    while not sched.waiting or sched.waiting[0].request_id != "low":
        sched.update(out := sched.schedule(), runner.execute(out))
    sched.add(Sequence("middle", prompt_of(3, 4), _params(2), priority=3))
    sched.add(Sequence("lowest", prompt_of(4, 4), _params(2), priority=9))
    assert [s.request_id for s in sched.waiting] == ["middle", "low", "lowest"]


def test_engine_and_server_take_priorities():
    """The embedded model under ``--scheduling-policy priority`` with one sequence at a time: requests finish
    in priority order; over HTTP ``priority`` is taken, and refused (400 naming it) under fcfs."""
    import json
    import urllib.error
    import urllib.request

    from fake_engine import smollm2_test_engine

    from kvforge.server.app import ServerThread, create_app

    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=1, extra_args=(
        "--kv-cache-memory", "64M", "--scheduling-policy", "priority"))
    fcfs = smollm2_test_engine(max_model_len=256, max_num_seqs=1, extra_args=("--kv-cache-memory", "64M"))
    try:
        for name, priority in (("a", 1), ("b", 0), ("c", 2), ("d", -1)):
            engine.add_request(name, f"Say {name}", SamplingParams(max_tokens=3, ignore_eos=True), priority=priority)
        finished = []
        while engine.has_unfinished_requests():
            finished += [out.request_id for out in engine.step() if out.finished]
        assert finished == ["d", "b", "a", "c"]
        body = {"prompt": ["Hi", "Hello"], "max_tokens": 2, "priority": 4}  # the request's, not one prompt's
        for eng, status in ((engine, 200), (fcfs, 400)):
            with ServerThread(create_app(eng)) as srv:
                req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        got, answer = r.status, json.loads(r.read())
                except urllib.error.HTTPError as e:
                    got, answer = e.code, json.loads(e.read())
            assert got == status, answer
            if status == 400:
                assert answer["error"]["param"] == "priority" and "--scheduling-policy priority" in \
                    answer["error"]["message"]
    finally:
        engine.shutdown()
        fcfs.shutdown()
