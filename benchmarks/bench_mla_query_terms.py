"""The warp-specialized fp8 MLA decode's three score products, side by side on one fp8 e4m3 cache:

- ``fp16 registers``: the model-dtype query in fp16, each cache tile converted to fp16 in registers;
- ``two-term e4m3``: the bf16 query held exactly as two e4m3 terms (``hi + lo / 16`` times a power of two
  per head), the score product an fp8 ``wgmma`` of ``2 x heads`` columns straight from shared memory;
- ``e4m3 query``: the plan's opt-in e4m3 query (one term, scale amax / 448).

    PYTHONUNBUFFERED=1 python benchmarks/bench_mla_query_terms.py [--heads 8,16] [--shapes 8x4096,32x16384]
        [--rounds 3] [--out DIR]

Each variant runs at the split count the engine picks for this kernel (``routing.mla.ws_splits``) and, for
comparison, the engine's own route (``triton_mla_decode.mla_decode``: the wgmma kernel where CTAs would get
fewer than ``WS_MIN_TOKENS_PER_CTA`` tokens). Timing: CUDA-graph replay under ``do_bench`` with L2 cleared,
the variants interleaved ``--rounds`` times; median [min-max] us over all rounds, and the share of the
device-to-device copy bandwidth measured in the same run (bytes as in ``bench_mla_decode.py``). Error: the
output's relative L2 distance to a float32 PyTorch reference over the dequantized cache with the exact query.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_mla_decode import SOFTMAX_SCALE, P, R, bench, bytes_read, copy_bandwidth, make_case, save_rows  # noqa: E402

from kvforge.attention.routing import mla as mla_routing  # noqa: E402
from kvforge.kernels import gluon_mla_decode_ws as ws  # noqa: E402
from kvforge.kernels.triton_mla_decode import mla_decode  # noqa: E402

VARIANTS = {
    "fp16 registers": dict(cfg={"two_terms": False}, fp8_query=False),
    "two-term e4m3": dict(cfg={"two_terms": True}, fp8_query=False),
    "e4m3 query": dict(cfg={}, fp8_query=True),
}


def reference(ql, qr, cache, meta, scale):
    """float32 attention over the dequantized rows, the exact (bf16) query; one sequence at a time."""
    out = torch.empty(ql.shape, dtype=torch.float32, device=ql.device)
    for i in range(meta.num_seqs):
        n = int(meta.seq_lens[i])
        rows = cache[meta.block_tables[i].long()].reshape(-1, R + P)[:n].float() * scale
        s = (ql[i].float() @ rows[:, :R].T + qr[i].float() @ rows[:, R:].T) * SOFTMAX_SCALE
        out[i] = torch.softmax(s, -1) @ rows[:, :R]
    return out


def rel_l2(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16,8")
    ap.add_argument("--shapes", default="8x4096,32x4096,128x4096,8x16384,32x16384,128x16384,8x65536,32x65536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()}), {sms} SMs", flush=True)
    rows = []
    scale = torch.tensor([1.0], device="cuda")  # cache values ~N(0, 1): scores of a few units
    for heads in (int(h) for h in args.heads.split(",")):
        for shape in args.shapes.split(","):
            batch, ctx = (int(x) for x in shape.split("x"))
            cache, meta, ql, qr = make_case(batch, ctx, heads, torch.float8_e4m3fn)
            want = reference(ql, qr, cache, meta, float(scale))
            splits = mla_routing.ws_splits(batch, heads, ctx, sms)
            calls = {}
            for name, v in VARIANTS.items():
                out = torch.empty_like(ql)
                calls[name] = functools.partial(
                    ws.mla_decode_ws,
                    ql,
                    qr,
                    cache,
                    meta,
                    scale,
                    SOFTMAX_SCALE,
                    num_splits=splits,
                    out=out,
                    cfg=v["cfg"],
                    fp8_query=v["fp8_query"],
                )
            calls["engine route"] = functools.partial(mla_decode, ql, qr, cache, meta, scale, SOFTMAX_SCALE)
            errs = {name: rel_l2(call(), want) for name, call in calls.items()}
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    med, lo, hi = bench(call, rep=40)
                    times[name] += [med, lo, hi]
            nbytes = bytes_read(batch, ctx, heads, 1)
            row = dict(
                heads=heads, batch=batch, ctx=ctx, splits=splits, tokens_per_cta=math.ceil(ctx / splits)
            )
            line = f"{heads:>3} {batch:>4}x{ctx:<6} tok/CTA {row['tokens_per_cta']:>6} |"
            for name in calls:
                meds = times[name][0::3]
                med = statistics.median(meds)
                row[name] = dict(
                    us=med,
                    min=min(times[name][1::3]),
                    max=max(times[name][2::3]),
                    pct_copy=100 * nbytes / (med * 1e-6) / copy_bw,
                    rel_l2=errs[name],
                )
                line += f" {name} {med:7.1f} ({row[name]['pct_copy']:3.0f}%) {errs[name]:.1e} |"
            print(line, flush=True)
            rows.append(row)
            del cache, want
            torch.cuda.empty_cache()
    if args.out:
        save_rows(args.out, "mla_query_terms.json", copy_bw, rows)


if __name__ == "__main__":
    main()
