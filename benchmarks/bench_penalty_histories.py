"""Host cost of the token histories that penalties read: Python lists against ``Sequence.token_arrays``.

Rerun anywhere (CPU):

    python benchmarks/bench_penalty_histories.py [--rows 256] [--prompt 1000] [--output 1000] [--reps 15]

Each repetition builds the padded prompt and output id tensors of ``rows`` requests the way
``apply_penalties`` does (kvforge/engine/penalties.py), once from the sequences' Python lists and once
from their cached int64 arrays (after one more token is appended, as in a decode step). Median [min-max] ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvforge.engine.penalties import _padded  # noqa: E402
from kvforge.engine.sequence import Sequence  # noqa: E402

VOCAB = 128256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--output", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    rng = random.Random(0)
    seqs = [Sequence(f"r{i}", [rng.randrange(VOCAB) for _ in range(args.prompt)]) for i in range(args.rows)]
    for s in seqs:
        for _ in range(args.output):
            s.append_token(rng.randrange(VOCAB))
        s.token_arrays()
    cpu = torch.device("cpu")
    times = {"lists": [], "arrays": []}
    for _ in range(args.reps):
        for s in seqs:
            s.append_token(rng.randrange(VOCAB))
        t = time.perf_counter()
        _padded([s.prompt_token_ids for s in seqs], VOCAB, cpu)
        _padded([s.output_token_ids for s in seqs], VOCAB, cpu)
        times["lists"].append(time.perf_counter() - t)
        t = time.perf_counter()
        arrays = [s.token_arrays() for s in seqs]
        _padded([a[0] for a in arrays], VOCAB, cpu)
        _padded([a[1] for a in arrays], VOCAB, cpu)
        times["arrays"].append(time.perf_counter() - t)
    print(f"{args.rows} rows, {args.prompt} prompt + ~{args.output} output tokens, torch {torch.__version__}")
    for name, ts in times.items():
        ms = [1e3 * x for x in ts]
        print(f"{name:>6}: {statistics.median(ms):7.2f} ms [{min(ms):.2f}-{max(ms):.2f}]")


if __name__ == "__main__":
    main()
