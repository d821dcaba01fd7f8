"""The warp-specialized fp8 MLA decode's time as a fixed cost a call plus a cost a tile: 32 sequences at a pinned
split count (128 CTAs at 16 and 8 heads) over contexts of 8 to 256 tiles a CTA, a line fitted per variant.

    PYTHONUNBUFFERED=1 python benchmarks/fit_mla_ws_fixed_cost.py [--splits 4] [--out DIR]

Variants: the model-dtype query as two e4m3 terms ("two") and in fp16 registers ("regs"), the e4m3 query
("e4m3"); each timed with L2 cleared by writing (as ``do_bench`` does: the dirty lines are written back inside
the timed kernel), by reading (clean lines), and not cleared, and once more by reading without the split merge.
CUDA-graph replays, median of 40. Prints each fit's fixed cost (us), cost a tile (us) and the share of the copy
bandwidth the cost a tile reads at (128 CTAs of 64-token tiles).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_mla_decode import SOFTMAX_SCALE, P, R, copy_bandwidth, make_case, save_rows  # noqa: E402

from kvforge.kernels import gluon_mla_decode_ws as ws  # noqa: E402

VARIANTS = {"two": dict(cfg={"two_terms": True}), "regs": dict(cfg={"two_terms": False}),
            "e4m3": dict(fp8_query=True)}
CLEAR = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if torch.cuda.is_available() else None


def timed(fn, clear: str, rep: int = 40) -> float:
    """Median us of ``fn`` replayed from a CUDA graph, L2 cleared by ``clear`` ("write", "read", "none")."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for i in range(rep + 5):
        if clear == "write":
            CLEAR.zero_()
        elif clear == "read":
            CLEAR.view(torch.int32).amax()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    scale = torch.tensor([1.0], device="cuda")
    rows = []
    merge = ws.merge_split_partials
    for heads in (16, 8):
        for ctx in (2048, 4096, 8192, 16384, 32768, 65536):
            cache, meta, ql, qr = make_case(32, ctx, heads, torch.float8_e4m3fn)
            row = dict(heads=heads, ctx=ctx, tiles_per_cta=ctx // args.splits // 64)
            for name, kw in VARIANTS.items():
                call = functools.partial(ws.mla_decode_ws, ql, qr, cache, meta, scale, SOFTMAX_SCALE,
                                         num_splits=args.splits, out=torch.empty_like(ql), **kw)
                for clear in ("write", "read", "none"):
                    row[f"{name} {clear}"] = timed(call, clear)
                ws.merge_split_partials = lambda *a, **k: None
                try:
                    row[f"{name} read, no merge"] = timed(call, "read")
                finally:
                    ws.merge_split_partials = merge
            rows.append(row)
            print(row, flush=True)
            del cache
            torch.cuda.empty_cache()
    tile_bytes = 64 * (R + P)
    for heads in (16, 8):
        fit_rows = [r for r in rows if r["heads"] == heads]
        tiles = np.array([r["tiles_per_cta"] for r in fit_rows], dtype=float)
        for key in [k for k in fit_rows[0] if " " in k]:
            per_tile, fixed = np.polyfit(tiles, [r[key] for r in fit_rows], 1)
            share = 100 * tile_bytes * 32 * args.splits / (per_tile * 1e-6) / copy_bw
            print(f"{heads:>3} heads {key:<20} fixed {fixed:6.1f} us, a tile {per_tile:.3f} us ({share:.0f}% of copy)")
    if args.out:
        save_rows(args.out, "fit_mla_ws_fixed_cost.json", copy_bw, rows)


if __name__ == "__main__":
    main()
