"""MLA attention of one layer in a prompt step: absorbed (a decode query per token) against sdpa.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_mla_prefill.py [--heads 16] [--lens 512 1024 2048 4096]
        [--tokens 8192] [--kv bf16 fp8] [--out results.json]

Each case is one step of ``--tokens`` prompt tokens: ``tokens // L`` prompts of ``L`` tokens from scratch,
DeepSeek-V2-Lite's per-head widths (latent 512 + rope 64 cached, qk_nope 128, v 128), block size 64,
bf16 model. ``kvforge.attention.triton_mla.mla_attention`` (the backend's layer entry: the per-head
products around the kernels included) is timed eagerly, as prefill steps run, by ``do_bench`` with L2
cleared, under the two prefill modes the engine's ``auto`` chooses between
(:data:`kvforge.attention.routing.mla.ABSORBED_PREFILL_MAX_SEQ_LEN`):

* ``absorbed``: every prompt token a decode query over its causal prefix, through the decode kernels;
* ``sdpa``: the latents expanded in bf16 for torch's fused attention (:mod:`kvforge.attention.mla_prefill_sdpa`).

The two outputs are checked against each other first (relative max error, bound 2^-5 of max|out|: bf16
outputs, fp8 latents read alike by both). Columns: median [min-max] us and sdpa's time over absorbed's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench  # noqa: E402

import kvforge.attention.triton_mla as triton_mla  # noqa: E402
from kvforge.attention.metadata import AttentionMetadata  # noqa: E402

R, P, DN, V, BS = 512, 64, 128, 128, 64
SOFTMAX_SCALE = 1.0 / math.sqrt(DN + P)
KV = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def step(heads: int, length: int, tokens: int, kv: str, gen: torch.Generator):
    """Inputs of one prompt step: ``tokens // length`` prompts from scratch, their latents cached."""
    n = max(1, tokens // length)
    blocks = -(-length // BS)
    perm = torch.randperm(n * blocks, generator=gen)
    tables = perm.view(n, blocks).to(torch.int32)
    scale = 0.05 if kv == "fp8" else 1.0
    rows = torch.randn(n * blocks, BS, R + P, generator=gen) * 0.5
    cache = (rows / scale).to(KV[kv]).cuda()
    t = n * length
    qsl = [i * length for i in range(n + 1)]
    lens = [length] * n
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                             torch.tensor(lens, dtype=torch.int32, device="cuda"), tables.cuda(),
                             torch.full((t,), -1, dtype=torch.int64, device="cuda"), length, length, BS,
                             host_query_start_loc=tuple(qsl), host_seq_lens=tuple(lens))
    q_nope = (torch.randn(t, heads, DN, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    q_rope = (torch.randn(t, heads, P, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    w_uk = (torch.randn(heads, DN, R, generator=gen) / math.sqrt(DN)).to(torch.bfloat16).cuda()
    w_uv = (torch.randn(heads, V, R, generator=gen) / math.sqrt(R)).to(torch.bfloat16).cuda()
    scale_t = torch.tensor([scale], device="cuda") if kv == "fp8" else None
    return (q_nope, q_rope, cache, meta, scale_t, SOFTMAX_SCALE, w_uk, w_uv), n


def routed(args, mode: str):
    """``mla_attention`` under prefill ``mode`` as a callable, called once (the step's plan built, as the first of
    a step's layers builds it)."""

    def run():
        return triton_mla.mla_attention(*args, prefill_mode=mode)

    run()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16])
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=sorted(KV))
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = []
    routes = ("absorbed", "sdpa")
    print(f"{'kv':>4} {'heads':>5} {'L x n':>10} " + " ".join(f"{r:>22}" for r in routes) + "  sdpa/abs  err")
    for kv in a.kv:
        for heads in a.heads:
            for length in a.lens:
                args, n = step(heads, length, a.tokens, kv, gen)
                outs = {r: routed(args, r)().float() for r in routes}
                ref = outs["sdpa"]
                err = max(((outs[r] - ref).abs().max() / ref.abs().max()).item() for r in routes)
                if not err <= 2.0**-5:
                    raise SystemExit(f"routes disagree at {kv} {heads} heads {length} x {n}: {err:.3g}")
                row = {"kv": kv, "heads": heads, "length": length, "prompts": n, "max_rel_err": err}
                for r in routes:
                    fn = routed(args, r)
                    med, lo, hi = do_bench(fn, warmup=5, rep=a.rep, quantiles=[0.5, 0.0, 1.0])
                    row[r] = [med * 1e3, lo * 1e3, hi * 1e3]
                row["sdpa_over_absorbed"] = row["sdpa"][0] / row["absorbed"][0]
                results.append(row)
                cells = " ".join(f"{row[r][0]:8.1f} [{row[r][1]:.0f}-{row[r][2]:.0f}]".rjust(22) for r in routes)
                print(f"{kv:>4} {heads:>5} {f'{length} x {n}':>10} {cells} {row['sdpa_over_absorbed']:9.2f}  {err:.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "tokens": a.tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
