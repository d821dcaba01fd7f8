"""A Llama-3.1-8B decode step's GEMMs on cuBLAS at a range of batch sizes, against each product's floor.

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_gemms.py [--rows 16 64 128 192 256]
        [--blas-library cublas cublaslt] [--rep 10]

Products ``x [rows, K] @ weight[N, K].T`` in bf16 (``F.linear``) for the projections of one layer (qkv 6144 x
4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) and the LM head (128256 x 4096). Each is captured
in a CUDA graph and its replay timed with ``triton.testing.do_bench``, which clears L2 before each call (so
the weight streams from HBM; a replay of one short kernel also carries a few us of launch that a step's own
graph does not). The floor of a product is its weight bytes at the device-to-device copy bandwidth or its
FLOPs at the bf16 GEMM rate, whichever is longer, both measured in the same run (the rate on an 8192-row
gate_up product). Prints us per product and the step's sum (32 layers + the LM head) against its floor, for
each BLAS library asked for (``torch.backends.cuda.preferred_blas_library``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
#: How often each product runs in one decode step.
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def gemm_flops_per_s(weight: torch.Tensor) -> float:
    """bf16 FLOP/s of cuBLAS on 8192 rows by ``weight`` (compute-bound)."""
    a = torch.randn(8192, weight.shape[1], device="cuda").to(torch.bfloat16)
    us = graph_bench(functools.partial(F.linear, a, weight), 30)[0]
    return 2 * 8192 * weight.shape[0] * weight.shape[1] / (us * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 192, 256])
    ap.add_argument("--blas-library", nargs="+", default=["cublas"], choices=["cublas", "cublaslt"])
    ap.add_argument("--rep", type=int, default=10, help="do_bench time budget per product, ms")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {name: (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
    xs = {k: torch.randn(max(args.rows), k, device="cuda").to(torch.bfloat16) for _, k in SHAPES.values()}
    bw = copy_bandwidth()
    rate = gemm_flops_per_s(weights["gate_up"])
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 GEMM rate {rate / 1e12:.0f} TFLOP/s")
    print("library | rows | " + " | ".join(f"{s} us (floor)" for s in SHAPES) + " | step GEMMs ms | floor ms")
    for lib in args.blas_library:
        torch.backends.cuda.preferred_blas_library(lib)
        for m in args.rows:
            cells, step, floor = [], 0.0, 0.0
            for name, (n, k) in SHAPES.items():
                us = graph_bench(functools.partial(F.linear, xs[k][:m], weights[name]), args.rep)[0]
                fl = max(n * k * 2 / bw, 2 * m * n * k / rate) * 1e6
                cells.append(f"{us:.1f} ({fl:.1f})")
                step += PER_STEP[name] * us
                floor += PER_STEP[name] * fl
            print(f"{lib} | {m} | " + " | ".join(cells) + f" | {step / 1e3:.2f} | {floor / 1e3:.2f}", flush=True)


if __name__ == "__main__":
    main()
