"""Paged decode on ragged batches: the ordered grid (KV heads fastest, sequences longest first) against the
batch-order grid, and split counts on the ordered grid.

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_order.py [--splits 1 2 3 4 6 8] [--rounds 3]

Llama-3.1-8B's attention shape (32 query / 8 KV heads, head size 128), block size 16, shuffled block tables,
one new token per sequence; each batch's context lengths are drawn uniformly from a range (seeded), plus two
uniform batches. Both an fp8 e4m3 cache (the Gluon kernels) and a bf16 cache (the Triton kernel) are timed
through the engine's entry, ``paged_attention``, as CUDA-graph replays with L2 cleared; the sides alternate
``--rounds`` times and each keeps its fastest median (us, and % of the copy bandwidth for the K and V bytes
of every context token). Three sides: the batch-order grid, the ordered grid, and the ordered grid with the
Gluon warp kernel's split-K chunks sized by the longest sequence (``SPLITS_SIZED_BY_LONGEST``, the default;
the Triton kernel has no such chunks, so its last two sides are the same launch). The first two sides'
outputs must be equal bit for bit (asserted); the third's relative L2 distance to the first is printed.
With ``--splits`` it times the ordered grid at each forced split count instead, with each chunking.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_paged_rows import HKV, HQ, D, make_case  # noqa: E402
from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.attention.routing import paged  # noqa: E402
from kvforge.kernels import gluon_fp8_decode as gfd  # noqa: E402
from kvforge.kernels import triton_paged_attention as tpa  # noqa: E402
from kvforge.kernels.gluon_support import routing_device  # noqa: E402


def shapes(seed: int = 1) -> dict[str, list[int]]:
    rng = torch.Generator().manual_seed(seed)

    def uniform(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=rng).tolist()

    out = {f"{n} x U({lo},{hi})": uniform(n, lo, hi) for n, lo, hi in (
        (256, 100, 1100), (256, 100, 2100), (192, 100, 1100), (128, 100, 1100), (96, 100, 1100),
        (64, 100, 1100), (128, 100, 4000), (64, 100, 4000), (32, 100, 8000), (32, 8192, 8448),
        (16, 100, 8000), (12, 1000, 16000), (8, 1000, 16000))}
    out.update({"256 x 1024": [1024] * 256, "64 x 8192": [8192] * 64})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splits", type=int, nargs="*", default=None, help="forced split counts (ordered grid)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    cp = copy_bandwidth()
    dev = routing_device(torch.device("cuda", torch.cuda.current_device()))
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {cp / 1e12:.2f} TB/s")
    # (label, ordered grid, splits sized by the longest sequence, forced split count)
    if a.splits:
        sides = [(f"s={n}", True, False, n) for n in a.splits] + [(f"s={n} longest", True, True, n)
                                                                  for n in a.splits if n > 1]
    else:
        sides = [("batch order", False, False, None), ("ordered", True, False, None),
                 ("ordered, longest chunks", True, True, None)]
    labels = [side[0] for side in sides]
    print("| batch x context | KV | routed kernel/splits | " + " | ".join(f"{s} us (%cp)" for s in labels)
          + ("" if a.splits else " | batch order / ordered | batch order / longest chunks | rel. L2") + " |")
    print("|---|---|---|" + "---:|" * (len(sides) + (0 if a.splits else 3)))
    scale = 1 / math.sqrt(D)
    ones = torch.ones(HKV, device="cuda")
    try:
        for name, lens in shapes().items():
            q, cache, meta = make_case(lens)
            order = torch.from_numpy(AttentionMetadata.longest_first(np.array(lens))).cuda()
            meta = dataclasses.replace(meta, decode_order=order)
            for kv in ("fp8", "bf16"):
                c = cache if kv == "fp8" else cache.to(torch.bfloat16)
                scales = (ones, ones) if kv == "fp8" else (None, None)
                kv_bytes = sum(lens) * HKV * D * 2 * (1 if kv == "fp8" else 2)
                shape = paged.PagedShape(len(lens), HQ, HKV, D, 1, max(lens), "bfloat16",
                                         "fp8_e4m3" if kv == "fp8" else "bfloat16")
                routed = paged.route(shape, dev)
                best, outs = {}, {}
                for _ in range(a.rounds):
                    for label, ordered, longest, splits in sides:
                        tpa.ORDERED_DECODE_GRID, gfd.SPLITS_SIZED_BY_LONGEST = ordered, longest
                        fn = functools.partial(tpa.paged_attention, q, c, meta, *scales, scale, num_splits=splits)
                        outs[label] = fn()
                        best[label] = min(best.get(label, math.inf), graph_bench(fn)[0])
                tpa.ORDERED_DECODE_GRID = gfd.SPLITS_SIZED_BY_LONGEST = True
                cells = " | ".join(f"{best[s]:.1f} ({100 * kv_bytes / (best[s] * 1e-6) / cp:.0f})" for s in labels)
                if not a.splits:
                    assert torch.equal(outs["batch order"], outs["ordered"]), f"{name} {kv}: the grids disagree"
                    ref, new = outs["batch order"].float(), outs["ordered, longest chunks"].float()
                    cells += (f" | {best['batch order'] / best['ordered']:.3f}"
                              f" | {best['batch order'] / best['ordered, longest chunks']:.3f}"
                              f" | {((new - ref).norm() / ref.norm()).item():.1e}")
                print(f"| {name} | {kv} | {routed.kernel}/{routed.splits} | {cells} |", flush=True)
                del c
            del q, cache, meta
            torch.cuda.empty_cache()
    finally:
        tpa.ORDERED_DECODE_GRID = gfd.SPLITS_SIZED_BY_LONGEST = True


if __name__ == "__main__":
    main()
