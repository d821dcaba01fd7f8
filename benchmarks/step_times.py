"""Where an offline run's time goes, step by step: the workload of ``kvforge bench offline`` stepped
synchronously, each step's wall time with the device synchronized before and after, grouped into steps
with prompt tokens and decode steps (those by running batch, in power-of-two buckets); then, on CUDA, a
torch.profiler kernel table of the prompt-only work (every request with ``max_tokens=1``).

    python benchmarks/step_times.py deepseek-v2-lite --load-format dummy --device cuda \\
        --skip-tokenizer-init --max-model-len 4096 --num-prompts 64 --input-len 100 512 --output-len 64 192

Takes the offline benchmark's flags (engine and workload). Synchronous stepping forgoes the overlap of
``--async-scheduling`` on purpose: each step's time is then its own. The first pass over the workload
is a warm-up (not reported); ``--repetitions`` passes follow.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvforge.bench.offline import add_offline_args, make_workload, warm_up
from kvforge.config import EngineArgs
from kvforge.engine.sampling_params import SamplingParams
from kvforge.llm import LLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_pass(llm: LLM, in_lens: list[int], params, rng: random.Random) -> list[tuple[int, int, float]]:
    """Every step of one pass over the workload: (prompt tokens computed, requests running after it, s)."""
    engine = llm.engine
    vocab = engine.spec.vocab_size
    for i, (n, p) in enumerate(zip(in_lens, params)):
        engine.add_request(f"steps-{rng.random()}-{i}", [rng.randrange(10, vocab - 10) for _ in range(n)], p)
    steps = []
    while engine.has_unfinished_requests():
        before = engine.stats()["prefill_tokens_computed"]
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(engine.device)
        dt = time.perf_counter() - t0
        after = engine.stats()
        steps.append((after["prefill_tokens_computed"] - before, after["num_running"], dt))
    return steps


def report(steps: list[tuple[int, int, float]]) -> None:
    prompt = [s for s in steps if s[0] > 0]
    decode = [s for s in steps if s[0] == 0]
    total = sum(s[2] for s in steps)
    print(f"{len(steps)} steps, {total:.3f} s: {len(prompt)} with prompt tokens {sum(s[2] for s in prompt):.3f} s "
          f"(tokens, running after, ms: {[(s[0], s[1], round(s[2] * 1e3, 1)) for s in prompt]}); "
          f"{len(decode)} decode {sum(s[2] for s in decode):.3f} s")
    buckets: dict[int, list[float]] = {}
    for _, running, dt in decode:
        buckets.setdefault(1 << (max(1, running) - 1).bit_length(), []).append(dt * 1e3)
    print("  decode steps by running batch (bucket: steps, median ms):",
          {b: (len(v), round(statistics.median(v), 2)) for b, v in sorted(buckets.items())})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_args(p)
    args = p.parse_args()
    llm = LLM(**EngineArgs.from_cli_args(args).__dict__)
    rng = random.Random(args.seed)
    in_lens, _, params = make_workload(args.num_prompts, args.input_len, args.output_len, rng)
    warm_up(llm)
    one_pass(llm, in_lens, params, rng)
    for rep in range(args.repetitions):
        print(f"pass {rep}: ", end="")
        report(one_pass(llm, in_lens, params, rng))
    if llm.engine.device.type != "cuda":
        return
    vocab = llm.engine.spec.vocab_size
    first = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * len(in_lens)

    def prompts():
        return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(n)]} for n in in_lens]

    llm.generate(prompts(), first, use_tqdm=False)
    batch = prompts()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _sync(llm.engine.device)
        t0 = time.perf_counter()
        llm.generate(batch, first, use_tqdm=False)
        _sync(llm.engine.device)
        print(f"prompts only (max_tokens=1): {time.perf_counter() - t0:.3f} s")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
