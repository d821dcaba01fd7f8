"""Counting an output's tokens (``num_token_ids``) gives ``len(token_ids)`` without copying the snapshot's list,
and the metrics hook that runs for every running request each step counts that way."""

from __future__ import annotations

from kvforge.engine.outputs import CompletionOutput, num_token_ids
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
