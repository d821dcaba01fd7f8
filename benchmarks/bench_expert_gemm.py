"""Routed experts of a decode step: ``torch._grouped_mm`` against the Triton expert kernel.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_expert_gemm.py [--shape v2-lite|kimi-linear|qwen3-next]
        [--tokens 1 8 64 128 256] [--sweep] [--out DIR]

Shapes (``--shape``): DeepSeek-V2-Lite's routed experts (the default: 64 experts, hidden 2048, expert
intermediate 1408, top-6), Kimi-Linear-48B-A3B's (256, 2304, 1024, top-8) or Qwen3-Next-80B-A3B's (512,
2048, 512, top-10), bf16: the ``gate_up`` product ``[rows, H] x [E, 2I, H]`` over the tokens' gathered rows
and the ``down`` product ``[rows, I] x [E, H, I]`` over rows already in expert order. Tokens route to
uniformly random distinct experts (seed 0), so a batch of T tokens touches the experts a uniform router
would. Where a batch has fewer rows than experts the engine's launch gives a program to each sorted
position (``triton_expert_gemm.programs_by_position``); the launch with a program per expert is then timed
beside it ("per expert").

``torch._grouped_mm`` multiplies rows gathered beforehand (the engine's gather copy is not timed); the kernel
gathers inside. Each product is captured once in a CUDA graph (as the engine's decode steps are) and its replay timed with
triton.testing.do_bench, which clears L2 before each timed call. Reported per product and batch: median
[min-max] us of both, the bytes of the experts that have rows (the weights a step must read) over the time
as a share of the device-to-device copy bandwidth measured in the same run (read + write), and the speed-up.
Before timing, both results are compared with a float32 product of the same rows (the kernel must be within
one bf16 rounding plus float32 summation error; else the run stops).

``--sweep`` also times the kernel over a set of tiles (weight rows 16/32/64 x K chunk 128/256 x 4/8 warps x
3/5 stages) at each batch and prints the six fastest per product and batch beside the engine's tile
(``triton_expert_gemm.TILE``), which is the fastest of this sweep at 8 and 64 tokens on an H200. Each tile
is checked against the float32 product first. A few minutes on one H200 (compiles).

After the products, the bookkeeping around them (kvforge/models/expert_rows.py, kvforge/models/
router_topk.py) is timed on both paths, each captured in a CUDA graph: grouping the rows by expert and
summing them back per token (hidden 2048, bf16), and the softmax router's top-k, PyTorch against the
Triton kernels, after checking the two paths agree.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

from kvforge.kernels import triton_expert_rows  # noqa: E402
from kvforge.kernels.triton_expert_gemm import TILE, ExpertGemmTile, expert_gemm, programs_by_position  # noqa: E402
from kvforge.models import expert_rows, router_topk  # noqa: E402
from kvforge.models.expert_rows import group_by_expert  # noqa: E402

SHAPES = {  # experts, hidden, expert intermediate, top-k
    "v2-lite": (64, 2048, 1408, 6),
    "kimi-linear": (256, 2304, 1024, 8),
    "qwen3-next": (512, 2048, 512, 10),
}


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 128, 256])
    ap.add_argument("--sweep", action="store_true", help="also time the kernel over a set of tiles")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    experts_n, hidden, inter, top_k = SHAPES[args.shape]
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"# {dev} torch {torch.__version__} triton {triton.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"# {args.shape}: {experts_n} experts, hidden {hidden}, expert intermediate {inter}, top-{top_k}")
    gate_up = (torch.randn(experts_n, 2 * inter, hidden, device="cuda") * 0.02).to(torch.bfloat16)
    down = (torch.randn(experts_n, hidden, inter, device="cuda") * 0.02).to(torch.bfloat16)
    rows_out, sweep_rows = [], []
    for t in args.tokens:
        ids = torch.stack([torch.randperm(experts_n, device="cuda")[:top_k] for _ in range(t)])
        rows = group_by_expert(ids.reshape(-1), experts_n, top_k)
        touched = int((torch.bincount(ids.reshape(-1), minlength=experts_n) > 0).sum())
        x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)
        h = torch.randn(t * top_k, inter, device="cuda").to(torch.bfloat16)
        gathered = x[rows.tokens]
        cases = {
            "gate_up": (gate_up, functools.partial(torch._grouped_mm, gathered, gate_up.transpose(1, 2), offs=rows.offs),
                        functools.partial(expert_gemm, x, gate_up, rows.offs, rows.tokens), gathered),
            "down": (down, functools.partial(torch._grouped_mm, h, down.transpose(1, 2), offs=rows.offs),
                     functools.partial(expert_gemm, h, down, rows.offs), h),
        }
        by_position = programs_by_position(t * top_k, experts_n)
        for name, (w, grouped, per_expert, a_rows) in cases.items():
            kernel = functools.partial(per_expert, expert=rows.expert)  # the engine's launch
            check(kernel(), a_rows, w, rows.expert, w.shape[2], f"kernel {name} T={t}")
            nbytes = touched * w[0].numel() * w.element_size()
            r = dict(product=name, tokens=t, touched_experts=touched, bytes=nbytes, by_position=by_position,
                     grouped_mm=graph_bench(grouped), kernel=graph_bench(kernel))
            impls = ["grouped_mm", "kernel"]
            if by_position:
                check(per_expert(), a_rows, w, rows.expert, w.shape[2], f"kernel per expert {name} T={t}")
                r["kernel_per_expert"] = graph_bench(per_expert)
                impls.append("kernel_per_expert")
            for impl in impls:
                r[impl + "_pct_copy"] = 100 * nbytes / (r[impl][0] * 1e-6) / copy_bw
            r["speedup"] = r["grouped_mm"][0] / r["kernel"][0]
            rows_out.append(r)
            if args.sweep:
                sweep_rows += sweep(name, t, w, kernel, a_rows, rows.expert, nbytes, copy_bw)
    print(f"\n{'product':>8} {'T':>4} {'experts':>7} | {'grouped_mm us':>22} {'%cp':>4} | {'kernel us':>22} {'%cp':>4}"
          f" | {'x':>5} | {'kernel per expert us':>22} {'%cp':>4}")
    for r in rows_out:
        def f(v):
            return f"{v[0]:7.1f} [{v[1]:.1f}-{v[2]:.1f}]"
        apart = (f" | {f(r['kernel_per_expert']):>22} {r['kernel_per_expert_pct_copy']:4.0f}"
                 if "kernel_per_expert" in r else "")
        print(f"{r['product']:>8} {r['tokens']:>4} {r['touched_experts']:>7} | {f(r['grouped_mm']):>22}"
              f" {r['grouped_mm_pct_copy']:4.0f} | {f(r['kernel']):>22} {r['kernel_pct_copy']:4.0f} | {r['speedup']:5.2f}"
              f"{apart}")
    for name, t in sorted({(r["product"], r["tokens"]) for r in sweep_rows}, key=lambda x: (x[1], x[0])):
        best = sorted((r for r in sweep_rows if (r["product"], r["tokens"]) == (name, t)), key=lambda r: r["us"][0])
        print(f"\nsweep {name} T={t}: the engine's tile {tile_str(TILE)}")
        for r in best[:6]:
            print(f"  {r['tile']:>22} {r['us'][0]:7.1f} [{r['us'][1]:.1f}-{r['us'][2]:.1f}] us {r['pct_copy']:4.0f}%cp")
    bookkeeping = time_bookkeeping()
    info = dict(device=dev, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, copy_bw_TBps=copy_bw / 1e12, cmd=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_expert_gemm.json"), "w") as fh:
        json.dump(dict(info=info, rows=rows_out, sweep=sweep_rows, bookkeeping=bookkeeping), fh, indent=1)


def tile_str(t: ExpertGemmTile) -> str:
    return f"n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"


def sweep(name, t, w, kernel, a_rows, experts, nbytes, copy_bw) -> list[dict]:
    """The kernel at each tile of the sweep (checked first), as rows for the JSON."""
    out = []
    for bn, bk, nw, ns in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5)):
        tile = ExpertGemmTile(bn, bk, nw, ns)
        fn = functools.partial(kernel, tile=tile)
        check(fn(), a_rows, w, experts, w.shape[2], f"kernel {name} T={t} {tile_str(tile)}")
        us = graph_bench(fn, rep=30)
        out.append(dict(product=name, tokens=t, tile=tile_str(tile), us=us,
                        pct_copy=100 * nbytes / (us[0] * 1e-6) / copy_bw))
    return out


def time_bookkeeping() -> list[dict]:
    """Grouping, summing and the router's top-k, PyTorch against the Triton kernels (CUDA graphs); the
    grouping also by each of the Triton sorts (the one-program sort up to its ``MAX_ROWS``, the counting
    sort up to ``COUNTING_MAX_ROWS``), whichever the engine's rule picks. Steps of more rows than
    ``expert_rows.TRITON_ROWS_MAX`` time the Triton side with that limit raised."""
    print(f"\n{'tokens x top-k, experts':>24} | {'PyTorch us (group, sum, top-k)':>32} | {'Triton us':>24} | "
          f"{'group: one program / counting':>30}")
    out = []
    row_limit = expert_rows.TRITON_ROWS_MAX
    for t, k, e, hidden in ((1, 6, 64, 2048), (64, 6, 64, 2048), (256, 6, 64, 2048), (64, 4, 32, 2048),
                            (64, 10, 512, 2048), (256, 8, 256, 2048), (256, 11, 513, 2048), (256, 9, 257, 2304),
                            (512, 11, 513, 2048), (1024, 8, 256, 2048), (2048, 6, 64, 2048)):
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).reshape(-1)
        weights = torch.rand(t, k, device="cuda")
        y = torch.randn(t * k, hidden, device="cuda").to(torch.bfloat16)
        logits = torch.randn(t, e, device="cuda")
        got = {}
        with torch.no_grad():
            for on in (False, True):
                expert_rows.TRITON_ROWS = router_topk.TRITON_ROUTER = on
                expert_rows.TRITON_ROWS_MAX = max(row_limit, t * k) if on else row_limit
                rows = group_by_expert(ids, e, k)
                summed = expert_rows.weighted_sum_per_token(y, rows, weights)
                top = router_topk.softmax_topk(logits, k, False)
                got[on] = (rows, summed, top, [
                    graph_bench(functools.partial(group_by_expert, ids, e, k))[0],
                    graph_bench(functools.partial(expert_rows.weighted_sum_per_token, y, rows, weights))[0],
                    graph_bench(functools.partial(router_topk.softmax_topk, logits, k, False))[0]])
            sorts = {}
            for counting, most in ((False, triton_expert_rows.MAX_ROWS), (True, triton_expert_rows.COUNTING_MAX_ROWS)):
                if t * k <= most:
                    fn = functools.partial(triton_expert_rows.group_rows, ids, e, k, counting=counting)
                    if not torch.equal(fn()[0], got[False][0].order):
                        raise AssertionError(f"T={t} k={k} E={e}: the {'counting' if counting else 'one-program'} "
                                             "sort orders differently")
                    sorts[counting] = graph_bench(fn)[0]
        expert_rows.TRITON_ROWS = router_topk.TRITON_ROUTER = True
        expert_rows.TRITON_ROWS_MAX = row_limit
        (ra, sa, ta, us_a), (rb, sb, tb, us_b) = got[False], got[True]
        if not (torch.equal(ra.order, rb.order) and torch.equal(ra.offs, rb.offs) and torch.equal(ta[1], tb[1])):
            raise AssertionError(f"T={t} k={k} E={e}: the two paths group or choose differently")
        if not (sa.float() - sb.float()).abs().max() <= 2**-7 * sa.float().abs().max():
            raise AssertionError(f"T={t} k={k} E={e}: the sums differ by more than one bf16 rounding")
        by_sort = " / ".join(f"{sorts[c]:.1f}" if c in sorts else "-" for c in (False, True))
        print(f"{f'{t} x {k}, {e}':>24} | {', '.join(f'{v:.1f}' for v in us_a):>32} | "
              f"{', '.join(f'{v:.1f}' for v in us_b):>24} | {by_sort:>30}")
        out.append(dict(tokens=t, top_k=k, experts=e, hidden=hidden, torch_us=us_a, triton_us=us_b,
                        one_program_us=sorts.get(False), counting_us=sorts.get(True)))
    return out


if __name__ == "__main__":
    main()
