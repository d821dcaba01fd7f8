"""The engine's step record through the real server (embedded SmolLM2, CPU): ``GET /debug/steps``,
the step histograms on ``/metrics``, and the load generator's report of the steps behind the worst
inter-token gaps. A small budget and threshold make prompts go through in several chunks."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

from kvforge.bench import serve_bench as sb  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.metrics import metric_sum, parse_prometheus  # noqa: E402

BUDGET, THRESHOLD = 64, 16


@pytest.fixture(scope="module")
def server():
    engine = smollm2_test_engine(max_model_len=512, max_num_seqs=8, extra_args=(
        "--max-num-batched-tokens", str(BUDGET), "--long-prefill-token-threshold", str(THRESHOLD)))
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()


def get_json(url: str):
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return r.read()


def test_a_long_prompt_runs_in_threshold_chunks_next_to_a_decoding_stream(server):
    before = get_json(server.url + "/debug/steps")["total_steps"]
    metrics_before = parse_prometheus(urllib.request.urlopen(server.url + "/metrics").read().decode())
    first_chunk = threading.Event()
    chunk_times = []

    def stream():
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({
            "prompt": [1, 2, 3, 4, 5], "max_tokens": 64, "ignore_eos": True, "temperature": 0,
            "stream": True}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    chunk_times.append(time.time())
                    first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(120)
    post_json(server.url + "/v1/completions", {"prompt": list(range(10, 160)), "max_tokens": 2,
                                               "ignore_eos": True, "temperature": 0})
    t.join(120)
    assert len(chunk_times) >= 2

    record = get_json(server.url + "/debug/steps")
    steps = [s for s in record["steps"] if s["step"] >= before]
    assert record["total_steps"] - before == len(steps) > 0
    assert [s["step"] for s in steps] == list(range(before, record["total_steps"]))
    for s in steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] <= BUDGET
        assert s["seconds"] >= 0 and s["finished"] >= s["launched"]
        if s["num_decode_tokens"]:
            assert s["num_prefill_tokens"] <= THRESHOLD, s
    # the 150-token prompt went through next to the decoding stream, a threshold's worth a step
    mixed = [s for s in steps if s["num_decode_tokens"] and s["num_prefill_tokens"]]
    assert sum(s["num_prefill_tokens"] for s in mixed) >= 150 - BUDGET
    assert max(s["num_prefill_tokens"] for s in mixed) == THRESHOLD
    # between the stream's first and last chunk every step decoded (the stream's own token at least)
    inside = [s for s in steps if chunk_times[0] < s["finished"] < chunk_times[-1]]
    assert inside and all(s["num_decode_tokens"] >= 1 for s in inside)

    metrics = parse_prometheus(urllib.request.urlopen(server.url + "/metrics").read().decode())

    def delta(name):
        return metric_sum(metrics, name) - metric_sum(metrics_before, name)

    # The server observes each step once the loop that resolved it returns; the last may still be due.
    assert delta("kvforge:iteration_tokens_total_count") == pytest.approx(len(steps), abs=1)
    if delta("kvforge:iteration_tokens_total_count") == len(steps):
        assert delta("kvforge:iteration_tokens_total_sum") == sum(
            s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps)
        assert delta("kvforge:iteration_prefill_tokens_sum") == sum(s["num_prefill_tokens"] for s in steps)


def test_debug_steps_last_and_bad_values(server):
    post_json(server.url + "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 4, "ignore_eos": True})
    record = get_json(server.url + "/debug/steps?last=2")
    assert len(record["steps"]) == 2 and record["steps"][-1]["step"] == record["total_steps"] - 1
    assert record["capacity"] >= 2
    for bad in ("0", "-3", "x"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + f"/debug/steps?last={bad}")
        assert e.value.code == 400
        assert json.loads(e.value.read())["error"]["param"] == "last"


def test_bench_reports_the_steps_behind_the_worst_gaps(server):
    report = asyncio.run(sb.run_benchmark(server.url, isl=120, osl=12, concurrency=3, num_requests=6,
                                          repetitions=1, warmup=0, log=lambda *_: None))
    rep = report["repetitions"][0]
    assert rep["requests_succeeded"] == 6
    sched = rep["gap_schedule"]
    assert len(sched["worst"]) == sb.WORST_GAPS
    gaps = [g["gap_ms"] for g in sched["worst"]]
    # the worst gap is the largest ITL sample, so at least the interpolated p99 (up to float rounding)
    assert gaps == sorted(gaps, reverse=True) and gaps[0] >= rep["itl_ms"]["p99"] * (1 - 1e-12)
    for g in sched["worst"]:
        # the stream's next token came from a step in the gap; every such step decoded, so it held at
        # most the threshold of prefill
        assert g["steps"] >= 1, g
        assert g["max_step_prefill_tokens"] <= THRESHOLD
        assert g["prefill_tokens"] <= THRESHOLD * g["steps"]
        assert g["decode_tokens"] >= g["steps"]
    assert sched["at_or_above_p99"]["max_prefill_tokens"] <= THRESHOLD * sched["at_or_above_p99"]["max_steps"]
    text = sb.format_report(report)
    assert "worst inter-token gaps" in text and "prefill tokens" in text


def test_gap_schedule_picks_the_steps_between_two_chunks():
    """Pure: chunk arrivals at 10.0, 10.1, 10.5 (gaps 100 and 400 ms); steps finishing at 10.05
    (before the first gap's end), 10.1 (on it), 10.3 and 10.45 (inside the second gap)."""
    def step(i, finished, prefill, decode, seconds):
        return {"step": i, "launched": finished - seconds, "finished": finished, "seconds": seconds,
                "num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_seqs": decode + (prefill > 0)}

    steps = [step(0, 9.99, 0, 2, 0.01), step(1, 10.05, 0, 2, 0.05), step(2, 10.1, 0, 2, 0.05),
             step(3, 10.3, 2048, 1, 0.2), step(4, 10.45, 512, 2, 0.15)]
    r = sb.RequestResult(ok=True, itls=[0.1, 0.4], chunk_times=[10.0, 10.1, 10.5])
    sched = sb.gap_schedule([r, sb.RequestResult(ok=False, chunk_times=[10.0, 99.0])], steps, worst=3)
    assert [round(g["gap_ms"]) for g in sched["worst"]] == [400, 100]
    wide, narrow = sched["worst"]
    assert (wide["steps"], wide["prefill_tokens"], wide["decode_tokens"], wide["max_step_prefill_tokens"]) == (
        2, 2560, 3, 2048)
    assert wide["step_ms"] == [200.0, 150.0]
    assert (narrow["steps"], narrow["prefill_tokens"], narrow["step_ms"]) == (2, 0, [50.0, 50.0])
    assert sched["at_or_above_p99"]["gaps"] == 1 and sched["at_or_above_p99"]["max_prefill_tokens"] == 2560
    # a gap that starts before the oldest recorded step is not attributed; no record at all gives None
    assert sb.gap_schedule([r], steps[3:], worst=2)["worst"][1]["steps"] is None
    assert sb.gap_schedule([r], None) is None


def test_a_wall_clock_step_is_not_a_gap():
    """The wall clock stepping 9 s forward between two chunks 50 ms apart (a time-sync adjustment):
    the gap is the 50 ms the monotonic clock saw, and the steps behind it are still found by the
    wall clock, which the server's record shares."""
    steps = [{"step": 0, "launched": 10.0, "finished": 10.04, "seconds": 0.04, "num_prefill_tokens": 0,
              "num_decode_tokens": 1, "num_seqs": 1},
             {"step": 1, "launched": 19.06, "finished": 19.09, "seconds": 0.03, "num_prefill_tokens": 16,
              "num_decode_tokens": 1, "num_seqs": 2}]
    r = sb.RequestResult(ok=True, itls=[0.05, 0.03], chunk_times=[10.04, 19.09, 19.12])
    worst = sb.gap_schedule([r], steps, worst=2)["worst"]
    assert [round(g["gap_ms"]) for g in worst] == [50, 30]
    assert worst[0]["steps"] == 1 and worst[0]["prefill_tokens"] == 16
