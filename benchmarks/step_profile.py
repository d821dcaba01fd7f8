"""Where the steady steps of one stream go: wall time, kernels, host Python and host waits.

    python benchmarks/step_profile.py MODEL_DIR --load-format dummy --device cuda --max-model-len 4096 \\
        --skip-tokenizer-init --input-len 1024 1024 \\
        --speculative-config '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2, "backoff": false}'

Takes the offline benchmark's engine flags; one request of ``--input-len MIN`` random token ids, greedy,
long enough for every step below. After ``--warm-steps`` steps it times ``--steps`` steps, each with the device
synchronized before and after (median [min-max] ms; tokens a step from the engine's count), then runs
``--steps`` more under torch.profiler (on CUDA: kernel time a step and the top kernels) and ``--steps`` more
under cProfile (host: the engine's functions by cumulative time, and the top functions by own time, where a
host read of device values shows as the wait of ``tolist`` / ``item``). With the device synchronized every
step, a step's wall time minus its kernel time is the time the device waited for the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvforge.bench.offline import add_offline_args
from kvforge.config import EngineArgs
from kvforge.engine.sampling_params import SamplingParams
from kvforge.llm import LLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(engine, n: int) -> tuple[list[float], float]:
    """Wall seconds of ``n`` synchronized steps, and the mean tokens a step generated."""
    walls, before = [], engine.generation_tokens_total
    for _ in range(n):
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(engine.device)
        walls.append(time.perf_counter() - t0)
    return walls, (engine.generation_tokens_total - before) / n


def kernel_table(engine, n: int) -> str:
    """Kernel time a step and the top kernels over ``n`` steps (CUDA only)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        _sync(engine.device)
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return (f"kernels: {total / n / 1e3:.3f} ms a step\n"
            + events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


def host_table(engine, n: int) -> str:
    """cProfile of ``n`` steps: kvforge's functions by cumulative time, then all by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        engine.step()
    _sync(engine.device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats("kvforge", 30)
    stats.sort_stats("tottime").print_stats(20)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_args(p)
    p.add_argument("--steps", type=int, default=50, help="steps a part (timed, kernels, host)")
    p.add_argument("--warm-steps", type=int, default=20, help="steps before the first timed one")
    args = p.parse_args()
    llm = LLM(**EngineArgs.from_cli_args(args).__dict__)
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = engine.spec.vocab_size
    spec = engine.speculative
    per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    steps = args.warm_steps + 3 * args.steps
    prompt = [rng.randrange(10, vocab - 10) for _ in range(args.input_len[0])]
    engine.add_request("profiled", prompt, SamplingParams(temperature=0, max_tokens=per_step * (steps + 8),
                                                          ignore_eos=True))
    for _ in range(args.warm_steps):
        engine.step()
    walls, tokens = timed_steps(engine, args.steps)
    ms = sorted(w * 1e3 for w in walls)
    print(f"step: {statistics.median(ms):.3f} ms [{ms[0]:.3f}-{ms[-1]:.3f}] over {args.steps} synchronized steps, "
          f"{tokens:.2f} tokens a step")
    if engine.device.type == "cuda":
        print(kernel_table(engine, args.steps))
    print(host_table(engine, args.steps))
    if not engine.has_unfinished_requests():
        raise SystemExit("the request finished before the last profiled step; the figures above cover fewer steps")


if __name__ == "__main__":
    main()
