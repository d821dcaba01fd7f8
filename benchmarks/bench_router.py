"""A MoE router's float32 logits and choice for a few tokens: one launch, two steps, and PyTorch.

    python benchmarks/bench_router.py [--rule softmax|v3|kimi] [--tokens 1 2 3 4] [--experts 64]
        [--hidden 2048] [--top-k 6] [--shared 2] [--layers 26] [--groups 8] [--topk-group 4]

``--rule``: ``softmax`` (DeepSeek-V2's greedy gate), ``v3`` (sigmoid scores, a correction bias, ``--groups``
groups scored by their top two, ``--topk-group`` kept, renormalised, scaled) or ``kimi`` (the v3 rule in one
group). Each side routes ``--layers`` routers one after another (each its own weight, as the MoE layers of a
decode step do) inside one CUDA graph; ``triton.testing.do_bench`` times the replays (median us a router).
"one launch" is ``router_topk.route`` with the fused logits (kvforge/kernels/triton_router_logits_topk.py);
"two steps" the same with ``FUSED_ROUTER_LOGITS`` off (``F.linear(x.float(), weight)`` and the choice
kernel); "PyTorch" with the kernels off (the product and the reference's ops). Prints a table and checks
that every side chooses the same experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from kvforge.models import router_topk  # noqa: E402
from kvforge.models.router_topk import RouterRule  # noqa: E402

SIDES = {"one launch": (True, True), "two steps": (True, False), "PyTorch": (False, False)}


def make_rule(args) -> RouterRule:
    if args.rule == "softmax":
        return RouterRule(args.top_k, False, 1.0, args.shared)
    groups = args.groups if args.rule == "v3" else 1
    return RouterRule(args.top_k, True, 2.5, args.shared, sigmoid=True, n_group=groups,
                      topk_group=min(args.topk_group, groups), group_score="top2_sum", renorm_eps=1e-20)


def time_side(side: str, xs, weights, biases, counters, rule: RouterRule) -> tuple[float, list]:
    router_topk.TRITON_ROUTER, router_topk.FUSED_ROUTER_LOGITS = SIDES[side]

    def step():
        return [router_topk.route(x, w, rule, b, c) for x, w, b, c in zip(xs, weights, biases, counters)]

    out = step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    ms = triton.testing.do_bench(graph.replay, rep=200)
    return ms * 1e3 / len(xs), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=["softmax", "v3", "kimi"], default="softmax")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--shared", type=int, default=2)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--topk-group", type=int, default=4)
    args = ap.parse_args(argv)
    rule = make_rule(args)
    torch.manual_seed(0)
    names = list(SIDES)
    print(f"rule: {rule}")
    print("| tokens | " + " | ".join(f"{n}, us a router" for n in names) + " | PyTorch / one launch |")
    print("|---:|" + "---:|" * (len(names) + 1))
    with torch.no_grad():
        weights = [torch.randn(args.experts, args.hidden, device="cuda") * args.hidden ** -0.5
                   for _ in range(args.layers)]
        biases = [torch.randn(args.experts, device="cuda") * 0.1 if args.rule != "softmax" else None
                  for _ in range(args.layers)]
        counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(args.layers)]
        for t in args.tokens:
            xs = [torch.randn(t, args.hidden, device="cuda").to(torch.bfloat16) for _ in range(args.layers)]
            times, outs = {}, {}
            for n in names:
                times[n], outs[n] = time_side(n, xs, weights, biases, counters, rule)
            same = all(torch.equal(a[1], b[1]) for n in names[1:] for a, b in zip(outs[names[0]], outs[n]))
            print(f"| {t} | " + " | ".join(f"{times[n]:.2f}" for n in names)
                  + f" | {times['PyTorch'] / times['one launch']:.2f} |" + ("" if same else " (choices differ)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
