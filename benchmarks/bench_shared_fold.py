"""One MoE block with its shared experts apart against folded into the routed experts' stack.

    PYTHONUNBUFFERED=1 python benchmarks/bench_shared_fold.py [--model deepseek-v2-lite]
        [--tokens 1 8 32 64 128 256] [--prefill-tokens 2048 8192] [--out DIR]

A ``MoE`` block of the preset's shapes (DeepSeek-V2-Lite: 64 routed experts of 1408 rows, top-6, two shared
experts; bf16, random weights, hidden states ~N(0, 1)) is timed as the engine runs it: at decode sizes
(``--tokens``) its forward captured in a CUDA graph, at prompt sizes (``--prefill-tokens``) eagerly, each
with ``triton.testing.do_bench`` (L2 cleared before every call). Then ``fold_shared_experts()`` and the
same again. Before timing, the folded output is compared with the unfolded one (relative max error at
most 2^-6: both round the products to bf16, in different places). Prints us, median [min-max], and the
folded / apart ratio per size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import graph_bench  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvforge.models.deepseek import DeepseekArgs, MoE  # noqa: E402
from kvforge.spec.presets import PRESETS  # noqa: E402


def eager_bench(fn, rep: int = 50) -> tuple[float, float, float]:
    med, lo, hi = do_bench(fn, warmup=5, rep=rep, quantiles=[0.5, 0.0, 1.0])
    return med * 1e3, lo * 1e3, hi * 1e3


def time_block(moe: MoE, xs: dict[int, torch.Tensor], graphed: set[int]) -> tuple[dict, dict]:
    times, outs = {}, {}
    with torch.no_grad():
        for t, x in xs.items():
            outs[t] = moe(x).float()
            times[t] = (graph_bench if t in graphed else eager_bench)(lambda x=x: moe(x))
    return times, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    a = DeepseekArgs(PRESETS[args.model])
    moe = MoE(a, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    xs = {t: torch.randn(t, a.hidden_size, device="cuda", dtype=torch.bfloat16)
          for t in [*args.tokens, *args.prefill_tokens]}
    graphed = set(args.tokens)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; {args.model} "
          f"MoE block, {a.n_routed_experts} experts x {a.moe_intermediate_size}, top-{a.top_k}, "
          f"{a.n_shared_experts} shared; {datetime.datetime.now(datetime.UTC):%Y-%m-%d}")
    apart, ref = time_block(moe, xs, graphed)
    assert moe.fold_shared_experts()
    folded, got = time_block(moe, xs, graphed)
    rows = []
    print("| tokens | shared apart us | folded us | folded / apart |\n|---:|---:|---:|---:|")
    for t in xs:
        err = ((got[t] - ref[t]).abs().max() / ref[t].abs().max()).item()
        if not err <= 2.0**-6:
            raise AssertionError(f"{t} tokens: folded output differs by {err:.3g} of the largest value")
        (am, alo, ahi), (fm, flo, fhi) = apart[t], folded[t]
        mode = "graph" if t in graphed else "eager"
        print(f"| {t} ({mode}) | {am:.1f} [{alo:.1f}-{ahi:.1f}] | {fm:.1f} [{flo:.1f}-{fhi:.1f}] | {fm / am:.3f} |")
        rows.append(dict(tokens=t, mode=mode, apart_us=apart[t], folded_us=folded[t], max_rel_err=err))
    with open(os.path.join(args.out, "shared_fold.json"), "w") as f:
        json.dump(dict(model=args.model, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
