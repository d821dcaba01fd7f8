"""One MLA decode case, as the engine routes it, to profile with Nsight Compute.

    PYTHONPATH=. ncu --clock-control none -k regex:mla_decode --launch-skip 1 --launch-count 1 \\
        --section SourceCounters -o rep python3 benchmarks/ncu_mla_decode.py fp8 --heads 16 --batch 32 --ctx 16384
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv   # per-instruction stalls, conflicts

Runs the engine's decode entry three times (a warm-up launch, then the ones to profile); random cache rows, a
random block table. ``cache``: bf16, fp8 (e4m3) or e5m2; ``--query fp8_e4m3``: the plan's e4m3 query.
Which kernel runs is the routing table's choice (docs/ROUTING.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mla_decode import SOFTMAX_SCALE, make_case  # noqa: E402

from kvforge.kernels.triton_mla_decode import mla_decode  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", choices=sorted(DTYPES))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--query", choices=["fp8_e4m3"], default=None)
    a = p.parse_args()
    cache, meta, ql, qr = make_case(a.batch, a.ctx, a.heads, DTYPES[a.cache])
    scale = torch.tensor([1.0], device="cuda")
    for _ in range(3):
        mla_decode(ql, qr, cache, meta, scale, SOFTMAX_SCALE, query_dtype=a.query)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
