"""Counting an output's tokens (``num_token_ids``, ``num_prompt_token_ids``) and taking its newest tokens and
logprobs (``token_ids_since``, ``logprobs_between``) give what the lists give, without copying a snapshot's lists; the metrics hook that runs
for every running request each step counts that way."""

from __future__ import annotations

from kvforge.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    logprobs_between,
    num_prompt_token_ids,
    num_token_ids,
    token_ids_since,
)
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence
from kvforge.server.metrics import RequestTimes, ServerMetrics


def _running(n_out: int) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=100))
    for t in range(n_out):
        seq.append_token(10 + t)
    return seq


def test_a_snapshot_counts_its_own_step_without_copying():
    seq = _running(4)
    comp = seq.to_request_output().outputs[0]
    seq.append_token(99)  # later steps append to the same list
    assert num_token_ids(comp) == 4
    assert "_token_ids" not in comp.__dict__
    assert len(comp.token_ids) == 4 and comp.token_ids == [10, 11, 12, 13]
    assert num_token_ids(comp) == 4


def test_a_replaced_token_list_and_a_plain_output_count_their_list():
    comp = _running(3).to_request_output().outputs[0]
    comp.token_ids = [7]
    assert num_token_ids(comp) == 1
    assert num_token_ids(CompletionOutput(0, "ab", [5, 6])) == 2


def test_the_per_step_metrics_hook_leaves_the_token_list_uncopied():
    seq, metrics, clock = _running(0), ServerMetrics("m"), RequestTimes(arrival=0.0)
    outs = []
    for step in range(1, 6):
        seq.append_token(step)
        out = seq.to_request_output()
        metrics.on_output(clock, out, now=float(step))
        outs.append(out)
    assert all("_token_ids" not in o.outputs[0].__dict__ for o in outs)
    assert clock.num_tokens == 5 and clock.first_token_time == 1.0 and clock.last_token_time == 5.0
    itl = {s.name: s.value for s in metrics.registry.collect() for s in s.samples
           if s.name.endswith("inter_token_latency_seconds_count") or s.name.endswith("inter_token_latency_seconds_sum")}
    assert [v for k, v in sorted(itl.items())] == [4.0, 4.0]  # count 4 gaps, sum 4 seconds


def test_new_tokens_and_the_prompt_count_of_a_snapshot_leave_its_lists_uncopied():
    seq = _running(5)
    out = seq.to_request_output()
    seq.append_token(99)
    comp = out.outputs[0]
    assert token_ids_since(comp, 3) == [13, 14] and token_ids_since(comp, 5) == [] and token_ids_since(comp, 0) == [
        10, 11, 12, 13, 14]
    assert num_prompt_token_ids(out) == 3
    assert "_token_ids" not in comp.__dict__ and "_prompt_token_ids" not in out.__dict__
    new = token_ids_since(comp, 3)
    new.append(0)  # the caller's own list
    assert comp.token_ids == [10, 11, 12, 13, 14] and out.prompt_token_ids == [1, 2, 3]
    assert token_ids_since(comp, 3) == [13, 14] and num_prompt_token_ids(out) == 3


def test_new_tokens_and_the_prompt_count_of_plain_and_replaced_lists():
    plain = RequestOutput("p", None, [4, 5], [CompletionOutput(0, "", [1, 2, 3])])
    assert token_ids_since(plain.outputs[0], 1) == [2, 3] and num_prompt_token_ids(plain) == 2
    out = _running(4).to_request_output()
    out.prompt_token_ids, out.outputs[0].token_ids = [9], [8, 7]
    assert num_prompt_token_ids(out) == 1 and token_ids_since(out.outputs[0], 1) == [7]


def test_logprobs_between_gives_the_entries_asked_for_without_copying_the_others():
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=100, logprobs=1))
    for t in range(5):
        seq.append_token(10 + t, {10 + t: -0.5 * t, 99: -9.0})
    comp = seq.to_request_output().outputs[0]
    seq.append_token(20, {20: -1.0})
    got = logprobs_between(comp, 3, 9)
    assert "_logprobs" not in comp.__dict__
    assert got == comp.logprobs[3:5] and len(got) == 2 and logprobs_between(comp, 1, 2) == comp.logprobs[1:2]
    got[0].clear()  # the caller's own dict
    assert logprobs_between(comp, 3, 4)[0] == comp.logprobs[3] != {}
    assert logprobs_between(_running(3).to_request_output().outputs[0], 0, 3) == []  # no logprobs asked for
    assert logprobs_between(CompletionOutput(0, "", [1], logprobs=[{1: -0.1}]), 0, 5) == [{1: -0.1}]
