"""CPU tokens/s for SmolLM2-135M (embedded GGUF): prefill and decode, batch 1 and 16, per KV dtype.

    python benchmarks/bench_cpu_smollm2.py [--kv bf16 fp8] [--reps 3] [--prompt-len 256] [--gen 32]

Prefill tok/s = prompt tokens / time of a max_tokens=1 run. Decode tok/s =
batch x gen / (time of a gen+1 run - time of the max_tokens=1 run). Random
prompt token ids (seeded), ignore_eos. Median [min-max] over --reps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from kvforge import LLM, SamplingParams

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model dtype {args.dtype}")
    print(f"{'kv':6s} {'batch':>5s} {'prefill tok/s':>24s} {'decode tok/s':>24s}")
    rng = random.Random(0)
    for kv in args.kv:
        llm = LLM(kv_cache_dtype=kv, dtype=args.dtype, progress=False, enable_prefix_caching=False)
        for batch in args.batches:
            pre, dec = [], []
            for _ in range(args.reps):
                prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]}
                           for _ in range(batch)]
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
                t1 = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.gen + 1, ignore_eos=True),
                             use_tqdm=False)
                t2 = time.perf_counter()
                pre.append(batch * args.prompt_len / (t1 - t0))
                dec.append(batch * args.gen / max((t2 - t1) - (t1 - t0), 1e-9))

            def fmt(xs):
                return f"{statistics.median(xs):8.1f} [{min(xs):.1f}-{max(xs):.1f}]"

            print(f"{kv:6s} {batch:5d} {fmt(pre):>24s} {fmt(dec):>24s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
