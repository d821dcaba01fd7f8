"""Prometheus text exposition (format 0.0.4), written by hand.

Engine gauges and counters come from ``engine.stats()``; latency histograms
and per-request counters are kept by the server as outputs stream out.
"""

from __future__ import annotations

import bisect
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "abort")


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(labels: dict | None) -> str:
    if not labels:
        return ""
    parts = []
    for k, v in labels.items():
        v = str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{k}="{v}"')
    return "{" + ",".join(parts) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip(list(self.buckets) + [math.inf], self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{_fmt(float(le))}"}} {acc}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    """Per-request accounting done by the server (engine numbers come from stats())."""

    def __init__(self):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = {r: 0 for r in FINISH_REASONS}
        self.prompt_tokens = 0  # of finished requests, as reported in their usage
        self.generation_tokens = 0
        self.rejected: dict[str, int] = {}  # reason -> count (invalid, queue_full, unauthorized, ...)
        self.http_requests: dict[tuple[str, int], int] = {}

    # -- hooks from the async engine --------------------------------------------

    def on_output(self, stream, out, now: float) -> None:
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        new = n - stream.num_tokens
        if new <= 0:
            return
        if stream.first_token_time is None:
            stream.first_token_time = now
            self.ttft.observe(now - stream.arrival)
            if new > 1:
                self.itl.observe(0.0, new - 1)
        else:
            # Several tokens in one step (e.g. speculative decoding) share the gap.
            self.itl.observe((now - stream.last_token_time) / new, new)
        stream.last_token_time = now
        stream.num_tokens = n

    def on_finish(self, stream, out, now: float) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.finished[reason or "stop"] = self.finished.get(reason or "stop", 0) + 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.generation_tokens += stream.num_tokens
        self.e2e.observe(now - stream.arrival)
        if stream.num_tokens > 1 and stream.first_token_time is not None:
            self.tpot.observe((now - stream.first_token_time) / (stream.num_tokens - 1))

    def on_abort(self, stream) -> None:
        self.finished["abort"] += 1

    def on_reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def on_http(self, path: str, status: int) -> None:
        key = (path, status)
        self.http_requests[key] = self.http_requests.get(key, 0) + 1

    # -- exposition ---------------------------------------------------------------

    def render(self, stats: dict, *, in_flight: int, model_name: str) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_fmt(value)}")

        def stat(key):
            v = stats.get(key, 0)
            return v if v is not None else 0

        m = {"model_name": model_name}
        metric("kvforge_num_requests_running", "gauge", "Requests in the engine's running batch.",
               [(m, stat("num_running"))])
        metric("kvforge_num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               [(m, stat("num_waiting"))])
        metric("kvforge_server_requests_in_flight", "gauge", "Requests accepted by the server and not finished.",
               [(m, in_flight)])
        used, total = stat("kv_blocks_used"), stat("kv_blocks_total")
        metric("kvforge_kv_blocks_used", "gauge", "KV cache blocks in use.", [(m, used)])
        metric("kvforge_kv_blocks_total", "gauge", "KV cache blocks in the pool.", [(m, total)])
        metric("kvforge_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0-1).",
               [(m, used / total if total else 0.0)])
        queries, hits = stat("prefix_cache_queries"), stat("prefix_cache_hits")
        metric("kvforge_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [(m, queries)])
        metric("kvforge_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
               [(m, hits)])
        metric("kvforge_prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries (tokens) since start.",
               [(m, hits / queries if queries else 0.0)])
        metric("kvforge_num_preemptions_total", "counter", "Requests preempted (recomputed) by the scheduler.",
               [(m, stat("num_preemptions"))])
        metric("kvforge_prompt_tokens_total", "counter", "Prompt tokens processed by the engine.",
               [(m, stat("prompt_tokens_total"))])
        metric("kvforge_generation_tokens_total", "counter", "Tokens generated by the engine.",
               [(m, stat("generation_tokens_total"))])
        metric("kvforge_request_success_total", "counter", "Requests finished, by finish reason.",
               [({**m, "finished_reason": r}, c) for r, c in sorted(self.finished.items())])
        metric("kvforge_request_prompt_tokens_total", "counter",
               "Prompt tokens of finished (non-aborted) requests, as reported in their usage.",
               [(m, self.prompt_tokens)])
        metric("kvforge_request_generation_tokens_total", "counter",
               "Completion tokens of finished (non-aborted) requests, as reported in their usage.",
               [(m, self.generation_tokens)])
        metric("kvforge_request_rejected_total", "counter", "Requests refused before reaching the engine.",
               [({**m, "reason": r}, c) for r, c in sorted(self.rejected.items())])
        metric("kvforge_http_requests_total", "counter", "HTTP requests by path and status.",
               [({"path": p, "status": s}, c) for (p, s), c in sorted(self.http_requests.items())])
        for name, hist, help_ in (
            ("kvforge_time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
            ("kvforge_inter_token_latency_seconds", self.itl, "Time between successive output tokens."),
            ("kvforge_time_per_output_token_seconds", self.tpot, "Per request: (e2e - ttft) / (tokens - 1)."),
            ("kvforge_e2e_request_latency_seconds", self.e2e, "Time from arrival to the last token."),
        ):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            lines.extend(hist.lines(name))
        return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """Parse exposition text into {'name{labels}': value} (tests and the load generator use it)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def metric_sum(parsed: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` over all label sets."""
    total = 0.0
    for key, v in parsed.items():
        base = key.split("{", 1)[0]
        if base == name:
            total += v
    return total
