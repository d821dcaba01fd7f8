"""The serving benchmark's closed loop with the real scheduler and a cost model of each step, on CPU.

Plays ``kvforge bench serve`` (``--concurrency`` requests in flight, ``--num-requests`` per repetition,
prompts of ``--isl`` tokens, ``--osl`` tokens each, ignore_eos) through the real ``Scheduler`` and
``BlockManager``; a step's time comes from a model instead of a GPU:

* linear layers: max(weight bytes / bandwidth, 2 x matmul parameters x step tokens / GEMM rate);
* prefill attention: 4 x layers x hidden x new tokens x (prefix + new / 2) FLOPs at the attention rate;
* decode attention: each decoding sequence's KV bytes read at 85% of the bandwidth;
* 1 ms of other work per step.

Every stream gets its token when its step ends (no host or delivery time). The defaults describe
Llama-3.1-8B on an H200 (docs/BENCHMARKS.md: copy bandwidth, GEMM and tl.dot prefill rates). It
estimates what ``--long-prefill-token-threshold`` does to TTFT, ITL and throughput; it is not a
measurement.

    python benchmarks/schedule_model.py --isl 4096 --thresholds 0,4096,2048,1024 [--kv fp8]
"""

from __future__ import annotations

import argparse
import statistics

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence


def step_seconds(out, a) -> float:
    kv_token_bytes = a.kv_bytes_per_token * (0.5 if a.kv == "fp8" else 1.0)
    t = max(a.weight_bytes / a.bandwidth, 2 * a.matmul_params * out.num_batched_tokens / a.gemm_flops)
    attention_flops = kv_bytes = 0.0
    for s in out.scheduled:
        if s.num_new_tokens > 1:
            attention_flops += 4 * a.layers * a.hidden * s.num_new_tokens * (s.start_pos + s.num_new_tokens / 2)
        else:
            kv_bytes += (s.start_pos + 1) * kv_token_bytes
    return t + attention_flops / a.attention_flops + kv_bytes / (0.85 * a.bandwidth) + 0.001


def fill(sched, a, queue: list[int], active: dict, rep: int, now: float) -> None:
    """Add requests from ``queue`` until ``--concurrency`` are in flight (``active``: id -> [arrival, last token])."""
    while queue and len(active) < a.concurrency:
        rid = f"{rep}-{queue.pop(0)}"
        sched.add(Sequence(rid, [1] * a.isl, SamplingParams(max_tokens=a.osl, ignore_eos=True)))
        active[rid] = [now, None]


def run(a, threshold: int) -> tuple[float, float, float]:
    """Medians over repetitions of (TTFT p50 s, ITL p99 s, total tokens/s)."""
    bm = BlockManager(a.num_blocks, 16, False)
    sched = Scheduler(bm, 256, a.max_num_batched_tokens, a.isl + a.osl + 1, long_prefill_token_threshold=threshold)
    now, reps = 0.0, []
    for rep in range(a.repetitions):
        queue, active, start, ttft, itl = list(range(a.num_requests)), {}, now, [], []

        fill(sched, a, queue, active, rep, now)
        while active:
            out = sched.schedule()
            now += step_seconds(out, a)
            sampled = {s.request_id: 5 for s in out.scheduled if s.do_sample}
            finished = sched.update(out, sampled)
            for rid in sampled:
                times = active[rid]
                (ttft if times[1] is None else itl).append(now - (times[0] if times[1] is None else times[1]))
                times[1] = now
            for seq in finished:
                del active[seq.request_id]
            fill(sched, a, queue, active, rep, now)
        itl.sort()
        reps.append((statistics.median(ttft), itl[int(0.99 * (len(itl) - 1))],
                     a.num_requests * (a.isl + a.osl) / (now - start)))
    return tuple(statistics.median(r[k] for r in reps) for k in range(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isl", type=int, default=4096)
    p.add_argument("--osl", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--thresholds", default="0,4096,2048,1024", help="comma-separated; 0 = the whole budget")
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--num-blocks", type=int, default=60000)
    p.add_argument("--matmul-params", type=float, default=7.5e9)
    p.add_argument("--weight-bytes", type=float, default=15.0e9)
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s")
    p.add_argument("--gemm-flops", type=float, default=650e12, help="sustained GEMM FLOP/s of a prefill step")
    p.add_argument("--attention-flops", type=float, default=260e12, help="prefill attention FLOP/s")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--kv-bytes-per-token", type=float, default=131072, help="bf16 K and V of all layers")
    a = p.parse_args()
    for threshold in (int(x) for x in a.thresholds.split(",")):
        ttft, itl, total = run(a, threshold)
        print(f"ISL {a.isl} {a.kv} threshold {threshold:5d}: TTFT p50 {1000 * ttft:6.0f} ms  "
              f"ITL p99 {1000 * itl:5.0f} ms  total {total:7.0f} tok/s")


if __name__ == "__main__":
    main()
