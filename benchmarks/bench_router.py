"""A MoE router's float32 logits and softmax top-k for a few tokens: one launch against the two-step path.

    python benchmarks/bench_router.py [--tokens 1 2 3 4] [--experts 64] [--hidden 2048] [--top-k 6]
        [--shared 2] [--layers 26]

Each side routes ``--layers`` routers one after another (each its own weight, as the MoE layers of a decode
step do) inside one CUDA graph; ``triton.testing.do_bench`` times the replays (median us a router). "one
launch" is ``router_softmax_topk`` with the fused logits (kvforge/kernels/triton_router_logits_topk.py);
"two steps" is the same call with ``FUSED_ROUTER_LOGITS`` off (``F.linear(x.float(), weight)`` and the top-k
kernel). Prints a table and checks that both choose the same experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from kvforge.models import router_topk  # noqa: E402


def time_side(fused: bool, xs, weights, counters, k: int, shared: int) -> tuple[float, list]:
    router_topk.FUSED_ROUTER_LOGITS = fused

    def step():
        return [router_topk.router_softmax_topk(x, w, k, False, 1.0, shared, c)
                for x, w, c in zip(xs, weights, counters)]

    out = step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    ms = triton.testing.do_bench(graph.replay, rep=200)
    return ms * 1e3 / len(xs), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--shared", type=int, default=2)
    ap.add_argument("--layers", type=int, default=26)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("| tokens | one launch, us a router | two steps, us a router | two steps / one launch |")
    print("|---:|---:|---:|---:|")
    with torch.no_grad():
        weights = [torch.randn(args.experts, args.hidden, device="cuda") * args.hidden ** -0.5
                   for _ in range(args.layers)]
        counters = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(args.layers)]
        for t in args.tokens:
            xs = [torch.randn(t, args.hidden, device="cuda").to(torch.bfloat16) for _ in range(args.layers)]
            one, out_one = time_side(True, xs, weights, counters, args.top_k, args.shared)
            two, out_two = time_side(False, xs, weights, counters, args.top_k, args.shared)
            same = all(torch.equal(a[1], b[1]) for a, b in zip(out_one, out_two))
            print(f"| {t} | {one:.2f} | {two:.2f} | {two / one:.2f} |" + ("" if same else " (choices differ)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
