"""One-row products with their input computed in the kernel against the separate kernels.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_small_m_prologues.py [--out DIR]

Shapes: Llama-3.1-8B's projections, bf16, one row. For each: the separate path (the fused add + RMSNorm
kernel then the small-M product; or the SiLU-and-mul kernel then the product), the prologue path
(``rms_norm_linear`` / ``silu_mul_linear``) and the bare product over a ready input (the floor the
prologue can reach). Each captured once in a CUDA graph, its replay timed with ``do_bench`` (L2 cleared
before each timed call); median [min-max] us.
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

from gpu_timing import graph_bench  # noqa: E402

from kvforge.kernels.gluon_support import num_sms  # noqa: E402
from kvforge.kernels.triton_rms_norm import fused_add_rms_norm  # noqa: E402
from kvforge.kernels.triton_silu_mul import silu_and_mul  # noqa: E402
from kvforge.kernels.triton_small_m_linear import rms_norm_linear, silu_mul_linear, small_m_linear  # noqa: E402

HIDDEN, INTER, QKV = 4096, 14336, 6144
EPS = 1e-5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = num_sms(dev)
    bf16 = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(bf16)

    x, r, nw = rnd(1, HIDDEN), rnd(1, HIDDEN), 1 + rnd(HIDDEN, scale=0.1)
    gate_up = rnd(1, 2 * INTER)
    rows = []
    for name, n in (("qkv", QKV), ("gate_up", 2 * INTER)):
        w = rnd(n, HIDDEN, scale=0.02)

        def separate(w=w):
            h, _ = fused_add_rms_norm(x, r, nw, EPS)
            return small_m_linear(h, w, num_sms=sms)

        rows.append(dict(product=name, prologue="add + RMSNorm",
                         separate=graph_bench(separate),
                         prologue_us=graph_bench(functools.partial(rms_norm_linear, x, r, nw, EPS, w, num_sms=sms)),
                         bare=graph_bench(functools.partial(small_m_linear, x, w, num_sms=sms))))  # fmt: skip
    w = rnd(HIDDEN, INTER, scale=0.02)
    h = rnd(1, INTER)
    rows.append(dict(product="down", prologue="SiLU-and-mul",
                     separate=graph_bench(lambda: small_m_linear(silu_and_mul(gate_up), w, num_sms=sms)),
                     prologue_us=graph_bench(functools.partial(silu_mul_linear, gate_up, w, num_sms=sms)),
                     bare=graph_bench(functools.partial(small_m_linear, h, w, num_sms=sms))))  # fmt: skip

    def f(v):
        return f"{v[0]:6.1f} [{v[1]:.1f}-{v[2]:.1f}]"

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"{'product':>8} {'prologue':>14} | {'separate us':>20} | {'prologue us':>20} | {'bare product us':>20}")
    for row in rows:
        print(f"{row['product']:>8} {row['prologue']:>14} | {f(row['separate']):>20} | {f(row['prologue_us']):>20} |"
              f" {f(row['bare']):>20}")
    os.makedirs(args.out, exist_ok=True)
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cmd=" ".join(sys.argv),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))  # fmt: skip
    with open(os.path.join(args.out, "bench_small_m_prologues.json"), "w") as fh:
        json.dump(dict(info=info, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
