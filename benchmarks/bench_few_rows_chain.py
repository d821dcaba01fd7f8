"""The products of a Llama-3.1-8B decode step at 2-16 rows, back to back: cuBLAS against the small-M kernel.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_few_rows_chain.py [--rows 2 4 8] [--sweep] [--out DIR]

A decode step of M sequences multiplies M rows by every weight of the model: per layer q/k/v (6144 x 4096),
o (4096 x 4096), gate/up (28672 x 4096) and down (4096 x 14336), then the LM head (128256 x 4096). Every layer
has its own weights (15 GB in all), so nothing is in L2 when a product starts, and the products run back to back
in one CUDA graph as a step's graph runs them (no prologues: those serve one row; the norms and attention
between them are left out, the same for both sides).

Reported per row count (median [min-max] us of ``do_bench`` over the graph's replay, and the fraction of the
device-to-device copy bandwidth measured in the same run the weight bytes reach):

* the chain by cuBLAS (``F.linear``) and by the kernel at its own launch configurations;
* with ``--sweep``, per projection, 32 of its products back to back (one a layer) at each candidate launch
  configuration (broadcast or ``tl.dot``, row block, K chunk, warps, stages, K splits) against cuBLAS's, and the
  whole chain with every projection at its fastest candidate.

Every configuration's product is first compared with a float32 product of the same inputs (within 2^-7 of the
output's largest magnitude: bf16 rounding of the output and float32 sums), so one that computes something else
stops the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import cuda_setup, graph_bench  # noqa: E402

from kvforge.kernels.triton_small_m_linear import (  # noqa: E402
    BROADCAST_MAX_ROWS,
    SmallMLinearConfig,
    small_m_linear,
    small_m_linear_config,
)

HIDDEN, QKV, INTER, VOCAB = 4096, 6144, 14336, 128256
#: (N, K) of each projection, in a layer's order.
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (VOCAB, HIDDEN)}
#: Candidates (block_n, block_k, num_warps, num_stages) per path; K splits are added where K allows.
BROADCAST = [(4, 512, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 4), (16, 128, 4, 4), (4, 256, 4, 4),
             (8, 1024, 8, 2), (16, 512, 8, 3), (4, 1024, 4, 3), (32, 256, 8, 3)]
DOT = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 4), (64, 256, 4, 3),
       (16, 128, 4, 6), (32, 512, 8, 3), (64, 64, 4, 6), (128, 128, 8, 3)]
SPLITS = (1, 2, 4)


def candidates(m: int, n: int, k: int) -> list[SmallMLinearConfig]:
    out = []
    for use_dot, table in ((False, BROADCAST), (True, DOT)):
        if not use_dot and m > BROADCAST_MAX_ROWS:
            continue
        for bn, bk, w, st in table:
            for s in SPLITS:
                if s == 1 or k // s >= 2 * bk:
                    out.append(SmallMLinearConfig(bn, bk, s, w, st, use_dot))
    return out


def cfg_str(c: SmallMLinearConfig | None) -> str:
    if c is None:
        return "cuBLAS"
    return f"{'dot' if c.use_dot else 'bc'} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def product(x, w, cfg):
    """One product: cuBLAS where ``cfg`` is None, else the kernel (``"default"``: its own configuration)."""
    if cfg is None:
        return F.linear(x, w)
    return small_m_linear(x, w, config=None if cfg == "default" else cfg)


def measure_rows(m, args, per_shape, lm_head, chain_bytes, copy_bw, num_sms, dev) -> dict:
    """The chains at ``m`` rows: cuBLAS, the kernel's own configurations and (``--sweep``) the best per projection."""
    xs = {k: (torch.randn(m, k, device=dev)).to(torch.bfloat16) for k in {k for _, k in SHAPES.values()}}

    def check(name, cfg):
        n, k = SHAPES[name]
        w = per_shape[name][0]
        ref = xs[k].float() @ w.float().T
        err = (product(xs[k], w, cfg).float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
        if not err < 2.0**-7:
            raise AssertionError(f"{name} at {m} rows, {cfg_str(cfg) if cfg != 'default' else 'default'}: "
                                 f"error {err:.3g} of the output scale")

    def chain(configs):
        def run():
            for i in range(args.layers):
                for name in ("qkv", "o", "gate_up", "down"):
                    product(xs[SHAPES[name][1]], per_shape[name][i], configs[name])
            product(xs[HIDDEN], lm_head, configs["lm_head"])
        for name in SHAPES:
            check(name, configs[name])
        return graph_bench(run, args.rep)

    def one_shape(name, cfg):
        check(name, cfg)
        k = SHAPES[name][1]
        return graph_bench(lambda: [product(xs[k], w, cfg) for w in per_shape[name]], max(20, args.rep // 4))

    row = {}
    for label, cfg in (("cublas", None), ("kernel", "default")):
        t = chain(dict.fromkeys(SHAPES, cfg))
        row[label] = dict(us=t, of_copy=chain_bytes / (t[0] * 1e-6) / copy_bw)
    defaults = {name: cfg_str(small_m_linear_config(m, n, k, num_sms)) for name, (n, k) in SHAPES.items()}
    row["defaults"] = defaults
    print(f"rows {m}: cuBLAS {row['cublas']['us'][0]:.1f} us ({100 * row['cublas']['of_copy']:.1f}% of copy), "
          f"kernel {row['kernel']['us'][0]:.1f} us ({100 * row['kernel']['of_copy']:.1f}%) {defaults}", flush=True)
    if args.sweep:
        best, sweep = {}, []
        for name in args.shapes:
            n, k = SHAPES[name]
            base = one_shape(name, None)
            sweep.append(dict(shape=name, config="cuBLAS", us=base))
            best[name] = (base[0], None)
            print(f"  {name:>8} {'cuBLAS':<30} {base[0]:9.1f} us", flush=True)
            for c in candidates(m, n, k):
                try:
                    t = one_shape(name, c)
                except Exception as e:  # refused by the compiler or the GPU: recorded, skipped
                    sweep.append(dict(shape=name, config=cfg_str(c), error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                sweep.append(dict(shape=name, config=cfg_str(c), cfg=dataclasses.asdict(c), us=t))
                mark = " *" if t[0] < best[name][0] else ""
                print(f"  {name:>8} {cfg_str(c):<30} {t[0]:9.1f} us ({t[0] / base[0]:.3f} of cuBLAS){mark}",
                      flush=True)
                if t[0] < best[name][0]:
                    best[name] = (t[0], c)
        chosen = {name: best.get(name, (0, None))[1] for name in SHAPES}
        t = chain(chosen)
        row["sweep"] = sweep
        row["best"] = dict(configs={k: cfg_str(v) for k, v in chosen.items()}, us=t,
                           of_copy=chain_bytes / (t[0] * 1e-6) / copy_bw)
        print(f"rows {m}: best per projection {row['best']['configs']}: {t[0]:.1f} us "
              f"({100 * row['best']['of_copy']:.1f}% of copy)", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sweep", action="store_true", help="time candidate configurations per projection")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="projections to sweep")
    ap.add_argument("--rep", type=int, default=100, help="do_bench time budget per chain, ms")
    args = ap.parse_args()
    t0 = time.time()
    dev, num_sms, copy_bw = cuda_setup()

    def weight(n, k):
        return (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)

    layers = [{name: weight(n, k) for name, (n, k) in SHAPES.items() if name != "lm_head"} for _ in range(args.layers)]
    lm_head = weight(*SHAPES["lm_head"])
    per_shape = {name: ([layer[name] for layer in layers] if name != "lm_head" else [lm_head]) for name in SHAPES}
    chain_bytes = sum(w.numel() * 2 for ws in per_shape.values() for w in ws)
    info = dict(device=torch.cuda.get_device_name(), num_sms=num_sms, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), cmd=" ".join(sys.argv),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                copy_bw_TBps=copy_bw / 1e12, layers=args.layers, weight_bytes=chain_bytes)
    print(f"# {info['device']} ({num_sms} SMs); copy {copy_bw / 1e12:.3f} TB/s; {args.layers} layers, "
          f"{chain_bytes / 1e9:.2f} GB of weights; floor {chain_bytes / copy_bw * 1e6:.1f} us")
    result = dict(info=info, rows={})

    for m in args.rows:
        row = measure_rows(m, args, per_shape, lm_head, chain_bytes, copy_bw, num_sms, dev)
        result["rows"][m] = row
        with open(os.path.join(args.out, "bench_few_rows_chain.json"), "w") as f:  # kept after every row count
            json.dump(result, f, indent=1)
    print("\n| rows | cuBLAS us | kernel (own configs) us | best per projection us | % of copy: cuBLAS / kernel / best |")
    for m, row in result["rows"].items():
        b = row.get("best")
        print(f"| {m} | {row['cublas']['us'][0]:.1f} | {row['kernel']['us'][0]:.1f} | "
              f"{b['us'][0]:.1f} | " if b else f"| {m} | {row['cublas']['us'][0]:.1f} | {row['kernel']['us'][0]:.1f} | - | ",
              end="")
        print(f"{100 * row['cublas']['of_copy']:.1f} / {100 * row['kernel']['of_copy']:.1f} / "
              f"{100 * b['of_copy']:.1f} |" if b else
              f"{100 * row['cublas']['of_copy']:.1f} / {100 * row['kernel']['of_copy']:.1f} / - |")
    print(f"# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
