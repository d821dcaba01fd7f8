"""Routed experts of a decode step: ``torch._grouped_mm`` against the Triton expert kernel.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_expert_gemm.py [--tokens 1 8 64 256] [--out DIR]

Shapes: DeepSeek-V2-Lite's routed experts (64 experts, hidden 2048, expert intermediate 1408, top-6), bf16:
the ``gate_up`` product ``[rows, 2048] x [64, 2816, 2048]`` over the tokens' gathered rows and the ``down``
product ``[rows, 1408] x [64, 2048, 1408]`` over rows already in expert order. Tokens route to uniformly
random distinct experts (seed 0), so a batch of T tokens touches the experts a uniform router would.

``torch._grouped_mm`` multiplies rows gathered beforehand (the engine's gather copy is not timed); the kernel
gathers inside. Each product is captured once in a CUDA graph (as the engine's decode steps are) and its replay timed with
triton.testing.do_bench, which clears L2 before each timed call. Reported per product and batch: median
[min-max] us of both, the bytes of the experts that have rows (the weights a step must read) over the time
as a share of the device-to-device copy bandwidth measured in the same run (read + write), and the speed-up.
Before timing, both results are compared with a float32 product of the same rows (the kernel must be within
one bf16 rounding plus float32 summation error; else the run stops).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

from kvforge.kernels.triton_expert_gemm import expert_gemm  # noqa: E402
from kvforge.models.expert_rows import group_by_expert  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 64, 2048, 1408, 6


def check(y, a_rows, weight, experts, k, what):
    """Within one bf16 rounding plus float32 summation error of the float32 product (else raise)."""
    w = weight[experts].float()
    ref = torch.einsum("rk,rnk->rn", a_rows.float(), w)
    s = torch.einsum("rk,rnk->rn", a_rows.float().abs(), w.abs())
    g = 4 * (k + 1) * 2.0**-24
    worst = ((y.float() - ref).abs() / (2.0**-7 * (ref.abs() + g * s) + g * s)).max().item()
    if not worst <= 1.0:
        raise AssertionError(f"{what}: error {worst:.2f} x the bound")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"# {dev} torch {torch.__version__} triton {triton.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") * 0.02).to(torch.bfloat16)
    rows_out = []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(t)])
        rows = group_by_expert(ids.reshape(-1), EXPERTS, TOP_K)
        touched = int((torch.bincount(ids.reshape(-1), minlength=EXPERTS) > 0).sum())
        x = torch.randn(t, HIDDEN, device="cuda").to(torch.bfloat16)
        h = torch.randn(t * TOP_K, INTER, device="cuda").to(torch.bfloat16)
        gathered = x[rows.tokens]
        cases = {
            "gate_up": (gate_up, functools.partial(torch._grouped_mm, gathered, gate_up.transpose(1, 2), offs=rows.offs),
                        functools.partial(expert_gemm, x, gate_up, rows.offs, rows.tokens), gathered),
            "down": (down, functools.partial(torch._grouped_mm, h, down.transpose(1, 2), offs=rows.offs),
                     functools.partial(expert_gemm, h, down, rows.offs), h),
        }
        for name, (w, grouped, kernel, a_rows) in cases.items():
            check(kernel(), a_rows, w, rows.expert, w.shape[2], f"kernel {name} T={t}")
            nbytes = touched * w[0].numel() * w.element_size()
            r = dict(product=name, tokens=t, touched_experts=touched, bytes=nbytes,
                     grouped_mm=graph_bench(grouped), kernel=graph_bench(kernel))
            for impl in ("grouped_mm", "kernel"):
                r[impl + "_pct_copy"] = 100 * nbytes / (r[impl][0] * 1e-6) / copy_bw
            r["speedup"] = r["grouped_mm"][0] / r["kernel"][0]
            rows_out.append(r)
    print(f"\n{'product':>8} {'T':>4} {'experts':>7} | {'grouped_mm us':>22} {'%cp':>4} | {'kernel us':>22} {'%cp':>4}"
          f" | {'x':>5}")
    for r in rows_out:
        def f(v):
            return f"{v[0]:7.1f} [{v[1]:.1f}-{v[2]:.1f}]"
        print(f"{r['product']:>8} {r['tokens']:>4} {r['touched_experts']:>7} | {f(r['grouped_mm']):>22}"
              f" {r['grouped_mm_pct_copy']:4.0f} | {f(r['kernel']):>22} {r['kernel_pct_copy']:4.0f} | {r['speedup']:5.2f}")
    info = dict(device=dev, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, copy_bw_TBps=copy_bw / 1e12, cmd=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_expert_gemm.json"), "w") as fh:
        json.dump(dict(info=info, rows=rows_out), fh, indent=1)


if __name__ == "__main__":
    main()
