"""Small-M linear layers: cuBLAS (``F.linear``) vs the small-M Triton kernel on Llama-3.1-8B's projections.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_small_m_linear.py [--out DIR] [--sweep] [--m 1 2 4 8 16]

Shapes (N, K), bf16 weights ``[N, K]``: qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down
(4096, 14336), lm_head (128256, 4096); rows M = 1, 2, 4, 8, 16 (the tokens of a decode step).

Every call is captured once in a CUDA graph (as the engine's decode steps are) and its replay timed with
triton.testing.do_bench, which clears L2 before each timed call, so the weight streams from HBM every time.
Reported per shape and M: median time (min-max) in us, weight bytes / time in TB/s and as a share of the
device-to-device copy bandwidth measured in the same run (copy bytes = read + written), the kernel's
speed-up over cuBLAS, and the launch configuration. Before timing, both results are compared with a float32
product: the kernel must be within one bf16 rounding plus float32 summation error of it (else the run
stops); cuBLAS's error is recorded (its split-K may reduce in bf16).
Then, per M, a Llama-3.1-8B decode step's GEMM time (32 layers x (qkv + o + gate_up + down) + lm_head) for
cuBLAS alone, the kernel alone, and the better of the two per shape.

``--sweep`` also times a set of launch configurations per shape and M (row block, K chunk, warps, stages,
tl.dot or broadcast, K splits) and prints the fastest per shape and M, and per path the configuration with
the least total time over the shapes, which is what ``small_m_linear_config``'s constants encode.
Runtime on one H200: about a minute without ``--sweep``, three to five minutes with it (compiles).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

from kvforge.kernels.triton_small_m_linear import (  # noqa: E402
    SmallMLinearConfig,
    small_m_linear,
    small_m_linear_config,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
#: How often each shape runs in one Llama-3.1-8B decode step.
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
ROWS = (1, 2, 4, 8, 16)

#: Sweep candidates: (block_n, block_k, num_warps, num_stages) per path; K splits are added per shape.
BROADCAST_CANDIDATES = [(4, 512, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 4),
                        (16, 512, 8, 3), (32, 256, 8, 3), (8, 1024, 8, 2), (16, 512, 4, 1)]
DOT_CANDIDATES = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4),
                  (64, 256, 4, 3), (128, 128, 8, 4)]
BROADCAST_MAX_SWEEP_ROWS = 8
SPLITS = (1, 2, 4)


def error_ratio(y, ref32, scale32, k):
    """The largest error of ``y`` against the float32 product as a multiple of one bf16 ulp plus float32
    summation error (``4 (K + 1) 2^-24 sum |x w|``): at most 1 for the kernel (tests/test_small_m_linear.py)."""
    g = 4 * (k + 1) * 2.0**-24
    bound = 2.0**-7 * (ref32.abs() + g * scale32) + g * scale32
    return ((y.float() - ref32).abs() / bound).max().item()


def check(y, ref32, scale32, k, what):
    worst = error_ratio(y, ref32, scale32, k)
    if not worst <= 1.0:
        raise AssertionError(f"{what}: error {worst:.2f} x the bound")
    return worst


def cfg_str(c: SmallMLinearConfig) -> str:
    path = "dot" if c.use_dot else "bc"
    return f"{path} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[SmallMLinearConfig]:
    out = []
    paths = [(True, DOT_CANDIDATES)] + ([(False, BROADCAST_CANDIDATES)] if m <= BROADCAST_MAX_SWEEP_ROWS else [])
    for use_dot, cands in paths:
        for bn, bk, w, st in cands:
            for s in SPLITS:
                programs = -(-n // bn)
                if s > 1 and (programs >= 2 * num_sms or k // s < bk):
                    continue  # enough programs already, or slices shorter than a chunk
                out.append(SmallMLinearConfig(bn, bk, s, w, st, use_dot))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", type=int, nargs="+", default=list(ROWS), help="row counts (default 1 2 4 8 16)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time a set of launch configurations")
    ap.add_argument("--rep", type=int, default=50, help="do_bench time budget per measurement, ms")
    args = ap.parse_args()
    torch.manual_seed(0)
    t_start = time.time()
    dev = torch.cuda.get_device_name()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    info = dict(device=dev, num_sms=num_sms, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                copy_bw_TBps=copy_bw / 1e12, cmd=" ".join(sys.argv))
    print(f"# {dev} ({num_sms} SMs) torch {torch.__version__} triton {triton.__version__}")
    print(f"# copy bandwidth (read+write) {copy_bw / 1e12:.3f} TB/s")
    rows, sweep_rows = [], []
    for name in args.shapes:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        wbytes = w.numel() * w.element_size()
        for m in args.m:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref32 = x.float() @ w.float().T
            scale32 = x.float().abs() @ w.float().abs().T
            cfg = small_m_linear_config(m, n, k, num_sms)
            r = dict(shape=name, n=n, k=k, m=m, weight_bytes=wbytes, config=cfg_str(cfg))
            r["cublas_err"] = error_ratio(F.linear(x, w), ref32, scale32, k)  # recorded, never refused
            r["triton_err"] = check(small_m_linear(x, w, num_sms=num_sms), ref32, scale32, k, f"kernel {name} m={m}")
            r["cublas"] = graph_bench(functools.partial(F.linear, x, w), args.rep)
            r["triton"] = graph_bench(functools.partial(small_m_linear, x, w, num_sms=num_sms), args.rep)
            for impl in ("cublas", "triton"):
                r[impl + "_TBps"] = wbytes / (r[impl][0] * 1e-6) / 1e12
                r[impl + "_pct_copy"] = 100 * wbytes / (r[impl][0] * 1e-6) / copy_bw
            r["speedup"] = r["cublas"][0] / r["triton"][0]
            rows.append(r)
            print(f"{name:>8} m={m:<2} cuBLAS {r['cublas'][0]:8.1f} us {r['cublas_TBps']:5.2f} TB/s | kernel"
                  f" {r['triton'][0]:8.1f} us {r['triton_TBps']:5.2f} TB/s | x{r['speedup']:.2f} | {r['config']}",
                  flush=True)
            if args.sweep:
                for c in sweep_configs(m, n, k, num_sms):
                    fn = functools.partial(small_m_linear, x, w, config=c)
                    try:
                        check(fn(), ref32, scale32, k, f"{cfg_str(c)} {name} m={m}")
                        t = graph_bench(fn, max(10, args.rep // 2))
                    except Exception as e:  # a configuration the compiler or the GPU refuses: recorded, skipped
                        sweep_rows.append(dict(shape=name, m=m, config=cfg_str(c), error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    sweep_rows.append(dict(shape=name, m=m, config=cfg_str(c), cfg=c.__dict__, us=t,
                                           TBps=wbytes / (t[0] * 1e-6) / 1e12))
            del x
        del w
        torch.cuda.empty_cache()

    print(f"\ndevice {dev}; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write); times in us (median [min-max])")
    print(f"{'shape':>8} {'M':>3} | {'cuBLAS us':>20} {'TB/s':>5} {'%cp':>4} | {'kernel us':>20} {'TB/s':>5}"
          f" {'%cp':>4} | {'x':>5} | config")
    for r in rows:
        def f(t):
            return f"{t[0]:7.1f} [{t[1]:.0f}-{t[2]:.0f}]"
        print(f"{r['shape']:>8} {r['m']:>3} | {f(r['cublas']):>20} {r['cublas_TBps']:5.2f} {r['cublas_pct_copy']:4.0f} |"
              f" {f(r['triton']):>20} {r['triton_TBps']:5.2f} {r['triton_pct_copy']:4.0f} | {r['speedup']:5.2f} |"
              f" {r['config']}")
    step = {}
    if set(args.shapes) == set(SHAPES):
        print("\nLlama-3.1-8B decode step, GEMMs only (32 layers x 4 projections + lm_head), us:")
        print(f"{'M':>3} {'cuBLAS':>9} {'kernel':>9} {'best/shape':>11}  kernel takes")
        for m in args.m:
            by = {r["shape"]: r for r in rows if r["m"] == m}
            cub = sum(PER_STEP[s] * by[s]["cublas"][0] for s in SHAPES)
            tri = sum(PER_STEP[s] * by[s]["triton"][0] for s in SHAPES)
            best = sum(PER_STEP[s] * min(by[s]["cublas"][0], by[s]["triton"][0]) for s in SHAPES)
            takes = [s for s in SHAPES if by[s]["triton"][0] < by[s]["cublas"][0]]
            step[m] = dict(cublas=cub, triton=tri, best=best, kernel_takes=takes)
            print(f"{m:>3} {cub:9.0f} {tri:9.0f} {best:11.0f}  {', '.join(takes) or '-'}")
    best_rows = []
    if args.sweep:
        print("\nSweep: fastest configuration per shape and M (us, TB/s; default config's us for comparison)")
        for r in rows:
            cands = [s for s in sweep_rows if s["shape"] == r["shape"] and s["m"] == r["m"] and "us" in s]
            if not cands:
                continue
            b = min(cands, key=lambda s: s["us"][0])
            best_rows.append(dict(shape=r["shape"], m=r["m"], best=b, default_us=r["triton"][0], cublas_us=r["cublas"][0]))
            print(f"{r['shape']:>8} m={r['m']:<2} {b['us'][0]:7.1f} {b['TBps']:5.2f}  (default {r['triton'][0]:7.1f},"
                  f" cuBLAS {r['cublas'][0]:7.1f})  {b['config']}")
        print("\nSweep: per M and path, the (row block, K chunk, warps, stages) with the least summed time over the"
              " shapes, each shape at its best split:")
        for m in args.m:
            for use_dot in (False, True):
                totals = {}
                for s in sweep_rows:
                    if s["m"] != m or "us" not in s or s["cfg"]["use_dot"] != use_dot:
                        continue
                    key = (s["cfg"]["block_n"], s["cfg"]["block_k"], s["cfg"]["num_warps"], s["cfg"]["num_stages"])
                    per_shape = totals.setdefault(key, {})
                    per_shape[s["shape"]] = min(per_shape.get(s["shape"], float("inf")), s["us"][0])
                full = {key: sum(PER_STEP[sh] * t for sh, t in v.items()) for key, v in totals.items()
                        if len(v) == len(args.shapes)}
                if full:
                    key = min(full, key=full.get)
                    print(f"  m={m:<2} {'dot' if use_dot else 'broadcast':>9}: n{key[0]} k{key[1]} w{key[2]} st{key[3]}"
                          f"  step GEMMs {full[key]:.0f} us")
        failed = [s for s in sweep_rows if "error" in s]
        if failed:
            print(f"\n{len(failed)} sweep configurations failed; first: {failed[0]}")
    with open(os.path.join(args.out, "bench_small_m_linear.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, step=step, sweep=sweep_rows, sweep_best=best_rows), f, indent=1)
    print(f"\n# {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
