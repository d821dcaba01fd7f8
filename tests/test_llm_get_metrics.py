"""``LLM.get_metrics()``: the prometheus series as vLLM's reader dataclasses, checked against counts and times
taken from the outputs and the calls themselves; and the conversion of each prometheus type
(kvforge/metrics_reader.py)."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry, Summary
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram

from kvforge import SamplingParams
from kvforge.metrics_reader import Counter, Gauge, Histogram, Metric, Vector, read_registry
from kvforge.server.metrics import ENGINE_METRICS, PREFIX, ServerMetrics

PROMPTS = ["The capital of France is", "A list of prime numbers: 2, 3, 5, 7,", "Q: What is 2 + 2? A:"]
TEXT = ("The quick brown fox jumps over the lazy dog. The early bird catches the worm. "
        "A stitch in time saves nine.")
REPEAT = f"Repeat this text exactly: {TEXT}\nRepeated: {TEXT}\nRepeated:"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
ACCEPTED_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos"


def by_name(metrics: list[Metric]) -> dict[str, Metric]:
    """Series by name, a labelled family's by ``name{label=value}`` (the labels past ``model_name``)."""
    named = {}
    for m in metrics:
        extra = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k != "model_name")
        named[f"{m.name}{{{extra}}}" if extra else m.name] = m
    assert len(named) == len(metrics), "one series per name and labels on one engine"
    return named


def counter_deltas(before: dict[str, Metric], after: dict[str, Metric]) -> dict[str, int]:
    return {name: m.value - before[name].value for name, m in after.items() if isinstance(m, Counter)}


def test_counters_count_the_outputs_and_gauges_the_idle_engine(smol_llm):
    llm = smol_llm()
    before = by_name(llm.get_metrics())
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 12)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = by_name(llm.get_metrics())

    delta = counter_deltas(before, after)
    assert delta[PREFIX + "generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 3 + 7 + 12
    assert delta[PREFIX + "prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert 0 <= delta[PREFIX + "prefix_cache_hits"] <= delta[PREFIX + "prefix_cache_queries"]

    gauges = {name: m.value for name, m in after.items() if isinstance(m, Gauge)}
    for idle in ("num_requests_running", "num_requests_waiting", "num_requests_in_flight", "kv_cache_usage_perc",
                 "kv_blocks_used"):
        assert gauges[PREFIX + idle] == 0, idle
    assert gauges[PREFIX + "kv_blocks_total"] == llm.plan.num_blocks > 0


def test_series_are_the_servers_with_reader_types_and_the_model_label(smol_llm):
    llm = smol_llm()
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    metrics = llm.get_metrics()
    kinds = {PREFIX + name: {"gauge": Gauge, "counter": Counter}[kind] for name, kind, _ in ENGINE_METRICS}
    server = ServerMetrics("x")
    histograms = {name: Histogram for name, h in vars(server).items() if hasattr(h, "observe")}
    assert len(histograms) == 15
    kinds |= {PREFIX + "request_success": Counter}
    kinds |= {m.name: Histogram for m in read_registry(server.registry) if isinstance(m, Histogram)}
    assert {m.name: type(m) for m in metrics} == kinds  # counters without _total; none speculative here
    assert sum(type(m) is Histogram for m in metrics) == 15
    for m in metrics:
        assert m.name.startswith("kvforge:"), m.name
        labels = {"model_name": llm.engine.model_name}
        if m.name == PREFIX + "request_success":
            labels["finished_reason"] = m.labels.get("finished_reason")
        assert m.labels == labels, m
    assert all(isinstance(m.value, int) for m in metrics if isinstance(m, Counter))


def test_request_histograms_count_the_calls_requests_and_steps(smol_llm):
    llm = smol_llm()
    before = by_name(llm.get_metrics())
    lengths = (3, 7, 12)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.monotonic()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    wall = time.monotonic() - start
    after = by_name(llm.get_metrics())

    def added(name):
        a, b = after[PREFIX + name], before[PREFIX + name]
        return a.count - b.count, a.sum - b.sum

    assert added("request_generation_tokens") == (3, sum(lengths))
    assert added("request_prompt_tokens") == (3, sum(len(o.prompt_token_ids) for o in outs))
    assert added("request_params_max_tokens") == (3, sum(lengths))
    assert added("request_params_n") == (3, 3)
    success = {r: after[f"{PREFIX}request_success{{finished_reason={r}}}"].value
               - before[f"{PREFIX}request_success{{finished_reason={r}}}"].value for r in ("stop", "length", "abort")}
    assert success == {"stop": 0, "length": 3, "abort": 0}

    # One first token a request and one gap for each later token; each request's latencies lie within the call.
    ttft_n, ttft_s = added("time_to_first_token_seconds")
    e2e_n, e2e_s = added("e2e_request_latency_seconds")
    itl_n, itl_s = added("inter_token_latency_seconds")
    assert (ttft_n, e2e_n, itl_n) == (3, 3, sum(lengths) - 3)
    assert 0 < ttft_s < e2e_s <= 3 * wall
    # The last token of each request comes at its e2e latency: its first token, then its gaps.
    assert itl_s == pytest.approx(e2e_s - ttft_s, rel=1e-6, abs=1e-6)
    assert added("request_time_per_output_token_seconds")[0] == 3
    # Queue, prefill and decode split each request's e2e latency (float sums of the same differences).
    phases = sum(added(name)[1] for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                                              "request_decode_time_seconds"))
    assert phases == pytest.approx(e2e_s, rel=1e-6, abs=1e-6)

    # One observation a step, its tokens the engine's counters' (a step log is the record of the engine's steps).
    delta = counter_deltas(before, after)
    steps_n, tokens = added("iteration_tokens_total")
    prefill_n, prefill = added("iteration_prefill_tokens")
    assert steps_n == prefill_n == llm.engine.num_steps - before_steps(before) > 0
    assert prefill == delta[PREFIX + "prompt_tokens"] - delta[PREFIX + "prefix_cache_hits"]
    assert tokens - prefill == sum(lengths) - 3  # each request's first token comes from its last prefill step


def before_steps(before: dict[str, Metric]) -> int:
    return before[PREFIX + "iteration_tokens_total"].count


def test_speculative_acceptance_by_position_is_a_vector_summing_to_the_accepted_counter(smol_llm):
    llm = smol_llm(speculative_config=NGRAM)
    before = by_name(llm.get_metrics())
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([REPEAT, PROMPTS[1]], greedy, use_tqdm=False)
    after = by_name(llm.get_metrics())

    delta = counter_deltas(before, after)
    accepted = sum(o.speculative.num_accepted_tokens for o in outs)
    assert accepted > 0  # the repeated text is proposed and accepted
    assert delta[PREFIX + "spec_decode_num_accepted_tokens"] == accepted
    assert delta[PREFIX + "spec_decode_num_draft_tokens"] == sum(o.speculative.num_draft_tokens for o in outs)
    assert delta[PREFIX + "spec_decode_num_drafts"] == sum(o.speculative.num_drafts for o in outs)
    assert delta[PREFIX + "generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 32

    vector = after[ACCEPTED_PER_POS]
    assert isinstance(vector, Vector) and vector.labels == {"model_name": llm.engine.model_name}
    assert len(vector.values) == 3 and all(isinstance(v, int) for v in vector.values)
    assert sum(vector.values) == after[PREFIX + "spec_decode_num_accepted_tokens"].value
    added = [a - b for a, b in zip(vector.values, before[ACCEPTED_PER_POS].values)]
    assert sum(added) == accepted and added[0] >= added[1] >= added[2]  # a later proposal needs the ones before


def test_read_registry_converts_each_prometheus_type():
    registry = CollectorRegistry()
    hist = PromHistogram("kvforge:latency_seconds", "h", ["model_name"], buckets=(0.1, 1.0), registry=registry)
    for seconds in (0.05, 0.5, 0.7, 3.0):
        hist.labels("m").observe(seconds)
    PromCounter("kvforge:things", "c", ["model_name"], registry=registry).labels("m").inc(5)
    by_pos = PromCounter("kvforge:accepted_per_pos", "v", ["model_name", "position"], registry=registry)
    by_pos.labels("m", "0").inc(4)
    by_pos.labels("m", "2").inc(1)  # position 1 never counted: 0 in the vector

    assert read_registry(registry) == [
        Histogram("kvforge:latency_seconds", {"model_name": "m"}, count=4, sum=4.25,
                  buckets={"0.1": 1, "1.0": 3, "+Inf": 4}),
        Counter("kvforge:things", {"model_name": "m"}, 5),
        Vector("kvforge:accepted_per_pos", {"model_name": "m"}, [4, 0, 1]),
    ]

    Summary("kvforge:sizes", "s", registry=registry)
    with pytest.raises(ValueError, match="kvforge:sizes: a summary"):
        read_registry(registry)


def test_an_output_limit_of_none_is_counted_as_the_rest_of_the_context(smol_llm):
    llm = smol_llm(max_model_len=40)
    before = by_name(llm.get_metrics())[PREFIX + "request_params_max_tokens"]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    after = by_name(llm.get_metrics())[PREFIX + "request_params_max_tokens"]
    generated = len(out.outputs[0].token_ids)
    assert generated == 40 - len(out.prompt_token_ids)  # it ran to the end of the context
    assert (after.count - before.count, after.sum - before.sum) == (1, generated)
