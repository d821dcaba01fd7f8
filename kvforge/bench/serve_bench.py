"""``kvforge bench serve``: a load generator for an OpenAI-compatible server.

Each request is a streaming ``/v1/completions`` call (at temperature 0 unless ``--temperature``) with a
unique prompt of about ``--isl`` tokens (random words from a seeded RNG,
prefixed with a unique id so the prefix cache cannot serve it) and
``max_tokens=--osl`` with ``ignore_eos``. Token counts come from the server's
``usage`` (``stream_options.include_usage``); TTFT and inter-token latency are
measured from the stream as it arrives: every chunk with a choice is a token
arrival (a server streams each step's tokens, text or not, as vLLM does).

The schedule behind the worst gaps: after each repetition the load generator
reads the server's record of recent engine steps (``GET /debug/steps``, kvforge
servers) and reports, for the longest inter-token gaps, the steps whose tokens
came between the two chunks and how many prefill tokens they ran. Steps and
chunks are matched on wall-clock time, so this needs the client on the server's
host (or clocks in sync).

Flow: ``--warmup`` discarded passes (``--warmup-requests`` requests each,
default one per concurrency slot; they also calibrate words per token so the
timed prompts land near ISL), then ``--repetitions`` timed passes of
``--num-requests`` requests at ``--concurrency``. The report gives every
repetition and the median / min / max across repetitions, and flags a cold
first repetition (slower than 1.5x the median of the rest) as an outlier.

Wiring (kvforge/cli.py)::

    from kvforge.bench.serve_bench import add_bench_serve_args, bench_serve_main
    p = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server")
    add_bench_serve_args(p)
    p.set_defaults(func=bench_serve_main)     # bench_serve_main(namespace) -> exit code
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from kvforge.cli_args import (
    ArgumentParser,
    http_url,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from kvforge.cli_vllm_flags import VllmFlag, add_vllm_flags
from kvforge.server.api_keys import CLIENT_API_KEY_HELP, client_api_key, unauthorized_hint

OUTLIER_FACTOR = 1.5
DEFAULT_BASE_URL = "http://127.0.0.1:8000"

# Short, common English words: mostly one token each for BPE vocabularies.
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from by hot word but what some "
    "we can out other were all there when up use your how said each she which do their time if will way about "
    "many then them write would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side been now find any "
    "new work part take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover food sun four between "
    "state keep eye never last let thought city tree cross farm hard start might story saw far sea draw left late "
    "run while press close night real life few north open seem together next white children begin got walk "
    "example ease paper group always music those both mark often letter until mile river car feet care second "
    "book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
    "color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon"
).split()


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None  # seconds
    latency: float | None = None  # seconds, request start to last byte
    itls: list[float] = field(default_factory=list)  # seconds between content chunks
    chunk_times: list[float] = field(default_factory=list)  # wall-clock arrival of each content chunk (itls[i]: i -> i+1)
    start: float = 0.0
    end: float = 0.0
    prompt: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


# -- prompts ------------------------------------------------------------------------------


def build_prompt(uid: str, n_words: int, rng: random.Random) -> str:
    return f"[{uid}] " + " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


class PromptFactory:
    """Unique prompts of about ``isl`` tokens; ``calibrate`` refines words per token from usage."""

    def __init__(self, isl: int, seed: int):
        self.isl = isl
        self.rng = random.Random(seed)
        self.words = max(1, isl - 8)  # first guess: the id prefix takes ~8 tokens, one token a word
        self.counter = 0

    def make(self, tag: str, words: int | None = None) -> str:
        self.counter += 1
        uid = f"{tag}-{self.counter}-{self.rng.randrange(1 << 30):08x}"
        return build_prompt(uid, words or self.words, self.rng)

    def make_warmup(self, tag: str, n: int) -> list[tuple[str, int]]:
        """Warm-up prompts at two lengths (full and half) so ``calibrate`` can fit a line."""
        half = max(1, self.words // 2)
        return [(self.make(tag, w), w) for w in (self.words if i % 2 == 0 else half for i in range(n))]

    def calibrate(self, samples: list[tuple[int, int]]) -> None:
        """Fit prompt_tokens = a + b * words from (words, prompt_tokens) and aim the word count at ISL."""
        samples = [(w, t) for w, t in samples if t]
        if not samples:
            return
        xs = sorted({w for w, _ in samples})
        mean_t = statistics.fmean(t for _, t in samples)
        mean_w = statistics.fmean(w for w, _ in samples)
        if len(xs) >= 2:
            b = sum((w - mean_w) * (t - mean_t) for w, t in samples) / sum((w - mean_w) ** 2 for w, _ in samples)
            if b > 0:
                a = mean_t - b * mean_w
                self.words = max(1, round((self.isl - a) / b))
                return
        self.words = max(1, round(mean_w * self.isl / mean_t))


# -- one request --------------------------------------------------------------------------


async def send_request(session, url: str, model: str, prompt: str, osl: int, headers: dict,
                       timeout_s: float, temperature: float = 0.0) -> RequestResult:
    import aiohttp

    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": osl,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, start=time.perf_counter(), prompt=prompt)
    last = None
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                res.error = f"HTTP {resp.status}: {body}"
                return res
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message')}"
                    return res
                now = time.perf_counter()
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.completion_tokens = obj["usage"]["completion_tokens"]
                if obj.get("choices"):  # one step's tokens (the usage chunk has no choices)
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itls.append(now - last)
                    last = now
                    res.chunk_times.append(time.time())
            res.end = time.perf_counter()
            res.latency = res.end - res.start
            if not done:
                res.error = "stream ended without [DONE]"
            elif not res.completion_tokens:
                res.error = "no usage in the stream (does the server support stream_options.include_usage?)"
            else:
                res.ok = True
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = res.end or time.perf_counter()
    return res


async def run_pass(session, url, model, prompts: list[str], osl: int, concurrency: int, headers: dict,
                   timeout_s: float, temperature: float = 0.0) -> tuple[list[RequestResult], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def worker():
        while True:
            try:
                p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await send_request(session, url, model, p, osl, headers, timeout_s, temperature))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results, time.perf_counter() - t0


# -- statistics ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    return {
        "mean": 1000 * statistics.fmean(values),
        "p50": 1000 * percentile(values, 50),
        "p90": 1000 * percentile(values, 90),
        "p99": 1000 * percentile(values, 99),
        "n": len(values),
    }


def summarize_pass(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "requests_succeeded": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else None,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput_tok_s": output_tokens / duration if duration else None,
        "total_throughput_tok_s": (prompt_tokens + output_tokens) / duration if duration else None,
        "ttft_ms": dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": dist_ms([x for r in ok for x in r.itls]),
        "e2e_ms": dist_ms([r.latency for r in ok if r.latency is not None]),
    }


SUMMARY_KEYS = (
    ("requests_succeeded", None),
    ("requests_failed", None),
    ("mean_prompt_tokens", None),
    ("duration_s", None),
    ("request_throughput", None),
    ("output_throughput_tok_s", None),
    ("total_throughput_tok_s", None),
    ("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"),
    ("tpot_ms", "p50"), ("tpot_ms", "p90"), ("tpot_ms", "p99"),
    ("itl_ms", "p50"), ("itl_ms", "p90"), ("itl_ms", "p99"),
)


def _get(rep: dict, key: str, sub: str | None):
    v = rep.get(key)
    return v[sub] if sub and v is not None else v


def summarize_repetitions(reps: list[dict]) -> dict:
    """Median / min / max across repetitions, plus the cold-first-repetition flag."""
    summary = {}
    for key, sub in SUMMARY_KEYS:
        vals = [_get(r, key, sub) for r in reps if _get(r, key, sub) is not None]
        name = f"{key}_{sub}" if sub else key
        summary[name] = (
            {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        )
    outlier = None
    if len(reps) >= 2:
        rest = statistics.median(r["duration_s"] for r in reps[1:])
        ratio = reps[0]["duration_s"] / rest if rest else None
        outlier = {
            "first_repetition_is_outlier": bool(ratio and ratio > OUTLIER_FACTOR),
            "first_to_rest_duration_ratio": ratio,
            "threshold": OUTLIER_FACTOR,
        }
    summary["cold_start"] = outlier
    return summary


# -- the schedule behind the worst gaps -------------------------------------------------------------

WORST_GAPS = 5


async def fetch_steps(session, base_url: str) -> list[dict] | None:
    """The server's record of recent engine steps, or None when it keeps none (not a kvforge server)."""
    try:
        async with session.get(f"{base_url}/debug/steps") as resp:
            if resp.status != 200:
                return None
            return (await resp.json())["steps"]
    except Exception:
        return None


def gap_schedule(results: list[RequestResult], steps: list[dict] | None, worst: int = WORST_GAPS) -> dict | None:
    """For the ``worst`` longest inter-token gaps of a pass: the engine steps whose tokens came between
    the two chunks (``a < step.finished <= b`` in wall-clock time), their prefill and decode tokens and
    step times. ``at_or_above_p99`` sums up every gap at or above the pass's ITL p99 the same way.
    A gap older than the oldest recorded step has ``steps: None``.

    A gap's length is its inter-token latency (``RequestResult.itls``, the monotonic clock), so the
    worst gaps are the largest ITL samples even when the wall clock steps during the pass; the wall
    clock only places the gap among the server's steps."""
    if steps is None:
        return None
    gaps = sorted(((itl, a, b) for r in results if r.ok
                   for itl, a, b in zip(r.itls, r.chunk_times, r.chunk_times[1:])), reverse=True)
    oldest = steps[0]["launched"] if steps else math.inf

    def behind(a, b):
        if a < oldest:
            return None
        return [s for s in steps if a < s["finished"] <= b]

    def describe(gap, a, b):
        ss = behind(a, b)
        if ss is None:
            return {"gap_ms": 1000 * gap, "steps": None}
        return {"gap_ms": 1000 * gap, "steps": len(ss),
                "prefill_tokens": sum(s["num_prefill_tokens"] for s in ss),
                "decode_tokens": sum(s["num_decode_tokens"] for s in ss),
                "max_step_prefill_tokens": max((s["num_prefill_tokens"] for s in ss), default=0),
                "step_ms": [round(1000 * s["seconds"], 1) for s in ss]}

    p99 = percentile([g for g, _, _ in gaps], 99)
    tail = [describe(*g) for g in gaps if p99 is not None and g[0] >= p99]
    known = [d for d in tail if d["steps"] is not None]
    return {
        "worst": [describe(*g) for g in gaps[:worst]],
        "at_or_above_p99": {
            "gaps": len(tail),
            "recorded": len(known),
            "max_prefill_tokens": max((d["prefill_tokens"] for d in known), default=None),
            "max_steps": max((d["steps"] for d in known), default=None),
            "median_prefill_tokens": statistics.median(d["prefill_tokens"] for d in known) if known else None,
        },
    }


# -- server metrics ------------------------------------------------------------------------------


async def scrape_metrics(session, base_url: str) -> dict[str, float] | None:
    from kvforge.server.metrics import parse_prometheus

    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_prometheus(await resp.text())
    except Exception:
        return None


def _metrics_delta(before, after) -> dict | None:
    from kvforge.server.metrics import metric_sum

    if not before or not after:
        return None
    out = {}
    for name in ("kvforge:request_success_total", "kvforge:request_prompt_tokens_sum",
                 "kvforge:request_generation_tokens_sum", "kvforge:prompt_tokens_total",
                 "kvforge:generation_tokens_total", "kvforge:num_preemptions_total",
                 "kvforge:prefix_cache_hits_total", "kvforge:prefix_cache_queries_total"):
        out[name] = metric_sum(after, name) - metric_sum(before, name)
    drafts, proposed, accepted = SPEC_DECODE_COUNTERS
    if any(key.split("{", 1)[0] == proposed for key in after):  # the server speculates
        for name in SPEC_DECODE_COUNTERS:
            out[name] = metric_sum(after, name) - metric_sum(before, name)
        out["spec_decode_acceptance_rate"] = out[accepted] / out[proposed] if out[proposed] else 0.0
        out["spec_decode_mean_accepted_length"] = 1.0 + out[accepted] / out[drafts] if out[drafts] else 1.0
    return out


SPEC_DECODE_COUNTERS = ("kvforge:spec_decode_num_drafts_total", "kvforge:spec_decode_num_draft_tokens_total",
                        "kvforge:spec_decode_num_accepted_tokens_total")


# -- the benchmark ---------------------------------------------------------------------------------


class WarmUpFailed(RuntimeError):
    """Every request of a warm-up pass failed (its first error in the message)."""


async def run_benchmark(
    base_url: str,
    *,
    isl: int = 128,
    osl: int = 128,
    concurrency: int = 8,
    num_requests: int = 64,
    repetitions: int = 3,
    warmup: int = 1,
    warmup_requests: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    temperature: float = 0.0,
    log=print,
) -> dict:
    import aiohttp

    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url}/v1/completions"
    factory = PromptFactory(isl, seed)
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        if model is None:
            async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    hint = f"; {unauthorized_hint(bool(api_key))}" if resp.status == 401 else ""
                    raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {(await resp.text())[:200]}{hint}")
                model = (await resp.json())["data"][0]["id"]
        totals = {"requests_sent": 0, "requests_succeeded": 0, "requests_failed": 0, "prompt_tokens": 0,
                  "output_tokens": 0}

        def count(summary, n):
            totals["requests_sent"] += n
            for k in ("requests_succeeded", "requests_failed", "prompt_tokens", "output_tokens"):
                totals[k] += summary[k]

        warm = []
        for w in range(warmup):
            n = warmup_requests or concurrency
            pairs = factory.make_warmup(f"warm{w}", n)
            results, dur = await run_pass(session, url, model, [p for p, _ in pairs], osl, concurrency, headers,
                                          timeout_s, temperature)
            s = summarize_pass(results, dur)
            count(s, n)
            warm.append(s)
            log(f"warm-up {w + 1}/{warmup}: {s['requests_succeeded']}/{n} ok in {dur:.2f}s (discarded)")
            if not s["requests_succeeded"]:
                raise WarmUpFailed(f"every request of warm-up pass {w + 1} failed, so the timed runs would too; "
                                   f"the first: {s['errors'][0] if s['errors'] else 'no answer'}")
            words_of = dict(pairs)
            factory.calibrate([(words_of[r.prompt], r.prompt_tokens) for r in results if r.ok])
        before = await scrape_metrics(session, base_url)  # after the warm-up: the deltas are the timed runs'
        reps, pooled = [], []
        for rep in range(repetitions):
            prompts = [factory.make(f"r{rep}") for _ in range(num_requests)]
            results, dur = await run_pass(session, url, model, prompts, osl, concurrency, headers, timeout_s,
                                          temperature)
            s = summarize_pass(results, dur)
            s["repetition"] = rep
            s["gap_schedule"] = gap_schedule(results, await fetch_steps(session, base_url))
            count(s, num_requests)
            reps.append(s)
            pooled.extend(results)
            log(_rep_line(s))
            if s["errors"]:
                log(f"  {s['requests_failed']} failed; the first: {s['errors'][0]}")
        after = await scrape_metrics(session, base_url)
    summary = summarize_repetitions(reps) if reps else {}
    overall = summarize_pass(pooled, sum(r["duration_s"] for r in reps)) if reps else None
    if overall:
        overall.pop("duration_s")
    return {
        "config": {"base_url": base_url, "model": model, "isl": isl, "osl": osl, "concurrency": concurrency,
                   "num_requests": num_requests, "repetitions": repetitions, "warmup": warmup,
                   "warmup_requests": warmup_requests or concurrency, "seed": seed, "temperature": temperature,
                   "words_per_prompt": factory.words},
        "warmup": warm,
        "repetitions": reps,
        "summary": summary,
        "overall": overall,
        "totals": totals,
        "server_metrics_delta": _metrics_delta(before, after),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _rep_line(s: dict) -> str:
    return (f"rep {s['repetition']}: {s['requests_succeeded']} ok / {s['requests_failed']} failed, "
            f"{_fmt(s['duration_s'], '.2f')}s, out {_fmt(s['output_throughput_tok_s'])} tok/s, "
            f"total {_fmt(s['total_throughput_tok_s'])} tok/s, TTFT p50 {_fmt(s['ttft_ms']['p50'])} ms, "
            f"TPOT p50 {_fmt(s['tpot_ms']['p50'])} ms, ITL p99 {_fmt(s['itl_ms']['p99'])} ms")


def format_report(report: dict) -> str:
    lines = []
    c = report["config"]
    lines.append(f"model {c['model']}  ISL~{c['isl']} OSL {c['osl']}  concurrency {c['concurrency']}  "
                 f"{c['num_requests']} requests x {c['repetitions']} repetitions")
    lines.append(f"{'metric':<28}{'median':>12}{'min':>12}{'max':>12}")
    for name, v in report["summary"].items():
        if name == "cold_start" or v is None:
            continue
        lines.append(f"{name:<28}{_fmt(v['median'], '.2f'):>12}{_fmt(v['min'], '.2f'):>12}{_fmt(v['max'], '.2f'):>12}")
    cold = report["summary"].get("cold_start")
    if cold and cold["first_repetition_is_outlier"]:
        lines.append(f"NOTE: repetition 0 took {cold['first_to_rest_duration_ratio']:.2f}x the median of the rest "
                     f"(> {cold['threshold']}x): cold start outlier; judge by the median.")
    worst = [(g, r["repetition"]) for r in report["repetitions"] if r.get("gap_schedule")
             for g in r["gap_schedule"]["worst"]]
    if worst:
        worst.sort(key=lambda x: -x[0]["gap_ms"])
        lines.append("worst inter-token gaps and the engine steps behind them (prefill tokens per step):")
        for g, rep in worst[:WORST_GAPS]:
            if g["steps"] is None:
                lines.append(f"  {g['gap_ms']:8.1f} ms  rep {rep}: before the oldest recorded step")
                continue
            per_step = ", ".join(f"{ms} ms" for ms in g["step_ms"])
            lines.append(f"  {g['gap_ms']:8.1f} ms  rep {rep}: {g['steps']} step(s), {g['prefill_tokens']} prefill "
                         f"tokens (at most {g['max_step_prefill_tokens']} in one), {g['decode_tokens']} decode "
                         f"tokens; steps {per_step}")
        tails = [r["gap_schedule"]["at_or_above_p99"] for r in report["repetitions"] if r.get("gap_schedule")]
        most = [t["max_prefill_tokens"] for t in tails if t["max_prefill_tokens"] is not None]
        if most:
            lines.append(f"gaps >= ITL p99: at most {max(most)} prefill tokens and "
                         f"{max(t['max_steps'] for t in tails if t['max_steps'] is not None)} step(s) behind one")
    delta = report.get("server_metrics_delta") or {}
    if "spec_decode_acceptance_rate" in delta:
        lines.append(f"speculative decoding: acceptance {delta['spec_decode_acceptance_rate']:.1%}, mean accepted "
                     f"length {delta['spec_decode_mean_accepted_length']:.2f} (server counters over the timed runs)")
    t = report["totals"]
    lines.append(f"totals (incl. warm-up): {t['requests_succeeded']}/{t['requests_sent']} ok, "
                 f"{t['prompt_tokens']} prompt + {t['output_tokens']} output tokens")
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = report["repetitions"]
    xs = [r["repetition"] for r in reps]
    cold = report["summary"].get("cold_start") or {}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    width = 0.4
    out = [r["output_throughput_tok_s"] or 0 for r in reps]
    tot = [r["total_throughput_tok_s"] or 0 for r in reps]
    bars = ax.bar([x - width / 2 for x in xs], out, width, label="output tok/s")
    ax.bar([x + width / 2 for x in xs], tot, width, label="total tok/s")
    if cold.get("first_repetition_is_outlier") and bars:
        bars[0].set_hatch("//")
        ax.annotate("cold", (xs[0] - width / 2, out[0]), ha="center", va="bottom")
    ax.set_title("throughput per repetition")
    ax.set_xlabel("repetition")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1.25 * max(tot + out + [1]))  # room above the bars for the legend
    ax.legend(loc="upper right", ncols=2)
    for ax, key, title in ((axes[0][1], "ttft_ms", "TTFT (ms)"), (axes[1][0], "tpot_ms", "TPOT (ms)"),
                           (axes[1][1], "itl_ms", "inter-token latency (ms)")):
        for q in ("p50", "p90", "p99"):
            ax.plot(xs, [r[key][q] if r[key][q] is not None else float("nan") for r in reps], marker="o", label=q)
        ax.set_title(title)
        ax.set_xlabel("repetition")
        ax.set_xticks(xs)
        ax.legend()
    c = report["config"]
    fig.suptitle(f"kvforge bench serve: {c['model']}  ISL~{c['isl']} OSL {c['osl']}  C={c['concurrency']}  "
                 f"M={c['num_requests']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- CLI -----------------------------------------------------------------------------------------------


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default=None, type=http_url,
                        help=f"server root (default {DEFAULT_BASE_URL}, or the one --host and --port name)")
    parser.add_argument("--host", default=None, help="vLLM's: the server's host (http://HOST:PORT; default "
                                                     "127.0.0.1), instead of --base-url")
    parser.add_argument("--port", type=positive_int, default=None, help="vLLM's: the server's port (default 8000), "
                                                                         "instead of --base-url")
    parser.add_argument("--model", default=None, help="model name (default: the first at /v1/models)")
    parser.add_argument("--api-key", default=None, help=CLIENT_API_KEY_HELP)
    parser.add_argument("--isl", "--random-input-len", dest="isl", type=positive_int, default=128,
                        help="input tokens per request, approximately (default %(default)s)")
    parser.add_argument("--osl", "--random-output-len", dest="osl", type=positive_int, default=128,
                        help="output tokens per request, ignore_eos (default %(default)s)")
    parser.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=positive_int, default=8,
                        help="requests in flight at once (default %(default)s)")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=positive_int, default=64,
                        help="requests per timed repetition (default %(default)s)")
    parser.add_argument("--dataset-name", choices=["random"], default="random",
                        help="vLLM's flag: the prompts are random text (the only dataset here)")
    parser.add_argument("--repetitions", type=positive_int, default=3, help="timed repetitions (default %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="discarded warm-up passes (default %(default)s)")
    parser.add_argument("--warmup-requests", type=positive_int, default=None,
                        help="requests per warm-up pass (default: --concurrency)")
    parser.add_argument("--seed", type=int, default=0, help="prompt RNG seed (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's sampling temperature (0: greedy, the default; > 0 samples, as most "
                             "served traffic does)")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="per-request timeout in seconds (default %(default)s)")
    parser.add_argument("--out", "--result-filename", dest="out", type=output_file, default=None,
                        help="write the JSON report here")
    parser.add_argument("--save-result", action="store_true",
                        help="vLLM's: write the JSON report (to --result-filename, or a timestamped file in "
                             "--result-dir); --out alone writes it too")
    parser.add_argument("--result-dir", default=None, help="vLLM's: the folder of the --save-result report "
                                                           "(a relative --result-filename is taken inside it)")
    parser.add_argument("--plot", type=output_file, default=None, help="write a PNG plot here (matplotlib)")
    add_vllm_flags(parser, BENCH_SERVE_FLAGS, "bench serve")
    return parser


#: vLLM's ``vllm bench serve`` flags that name what kvforge's bench always does.
BENCH_SERVE_FLAGS = (
    VllmFlag(("--backend",), True, ("vllm", "openai"), "requests go to the server's /v1/completions, as vLLM's "
             "vllm and openai backends send them"),
    VllmFlag(("--endpoint",), True, ("/v1/completions",), "requests go to /v1/completions"),
    VllmFlag(("--request-rate",), True, ("inf",), "requests are sent as fast as --max-concurrency allows"),
)


def resolve_destinations(args) -> str | None:
    """``args.base_url`` from ``--base-url`` or vLLM's ``--host`` / ``--port``, and the report's file from
    ``--out`` / ``--result-filename``, ``--save-result`` and ``--result-dir``; the error to print, or None."""
    if args.base_url is not None and (args.host is not None or args.port is not None):
        return "give the server as --base-url or as --host and --port, not both"
    if args.base_url is None:
        args.base_url = (DEFAULT_BASE_URL if args.host is None and args.port is None
                         else f"http://{args.host or '127.0.0.1'}:{args.port or 8000}")
    if args.result_dir is not None or (args.save_result and args.out is None):
        name = args.out or f"kvforge-bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        try:
            args.out = output_file(os.path.join(args.result_dir or ".", name))
        except argparse.ArgumentTypeError as e:
            return f"--result-dir: {e}"
    return None


def _fix_hint(error: str, base_url: str, key_sent: bool) -> str:
    """The fix for an error that stops the bench (where the error does not already say it): a refused API
    key, or no server at the URL."""
    if "HTTP 401" in error:
        hint = unauthorized_hint(key_sent)
        return "" if hint in error else f"; {hint}"
    if "ClientConnectorError" in error or "ServerDisconnectedError" in error:
        return f"; is a server running there? start one with `kvforge serve` (--base-url {base_url})"
    return ""


def bench_serve_main(args) -> int:
    """Entry point for ``kvforge bench serve``; exit code 1 when any timed request failed."""
    if args is None or isinstance(args, (list, tuple)):
        args = add_bench_serve_args(ArgumentParser(prog="kvforge bench serve")).parse_args(args)
    problem = resolve_destinations(args)
    if problem is not None:
        print(f"kvforge bench serve: error: {problem}", file=sys.stderr)
        return 2
    if not args.temperature >= 0:  # also NaN
        print("kvforge bench serve: error: --temperature must be a number >= 0", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvforge bench serve: error: --plot needs matplotlib: pip install 'kvforge[bench]' (or "
                  "matplotlib), or drop --plot", file=sys.stderr)
            return 2
    api_key = client_api_key(args.api_key)
    try:
        report = asyncio.run(run_benchmark(
            args.base_url, isl=args.isl, osl=args.osl, concurrency=args.concurrency,
            num_requests=args.num_requests, repetitions=args.repetitions, warmup=args.warmup,
            warmup_requests=args.warmup_requests, model=args.model, api_key=api_key, seed=args.seed,
            timeout_s=args.timeout, temperature=args.temperature,
        ))
    except WarmUpFailed as e:
        print(f"kvforge bench serve: error: {e}{_fix_hint(str(e), args.base_url, bool(api_key))}", file=sys.stderr)
        return 2
    except Exception as e:  # cannot reach the server at all
        text = f"{type(e).__name__}: {e}"
        print(f"kvforge bench serve: error: {text}{_fix_hint(text, args.base_url, bool(api_key))}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    failed = sum(r["requests_failed"] for r in report["repetitions"])
    if any(e.startswith("HTTP 401") for r in report["repetitions"] for e in r["errors"]):
        print(f"kvforge bench serve: error: HTTP 401: {unauthorized_hint(bool(api_key))}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(bench_serve_main(sys.argv[1:]))
