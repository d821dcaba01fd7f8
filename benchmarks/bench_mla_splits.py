"""MLA decode of a few sequences at each split count: the kernel the routing table picks (bf16 and fp8 e4m3
latent caches, the model-dtype query), ``num_splits`` pinned as a CUDA graph pins it, timed over CUDA-graph
replays with L2 cleared (the split merge included).

    python benchmarks/bench_mla_splits.py --heads 16 --batches 1 2 4 8 --contexts 4096 16384 --splits 0 8 16 32 64

DeepSeek's latent rows (512 + 64), block size 64 or ``--block-size``. Split count 0 is the routing rule's own count at the
context. Prints microseconds per call (median of ``do_bench``), bf16 then fp8, and the fp8 / bf16 time at
each count; a ``!`` marks a result further than 2^-6 (relative to the largest output) from the tl.dot
kernel's.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
from triton.testing import do_bench

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import mla as mla_routing
from kvforge.attention.routing.platform import Device
from kvforge.kernels.triton_mla_decode import mla_decode

R, P = 512, 64
SOFTMAX_SCALE = 1.0 / math.sqrt(192)


def _case(batch: int, ctx: int, heads: int, dtype: torch.dtype, block: int):
    blocks = -(-ctx // block)
    cache = torch.randn(batch * blocks, block, R + P, device="cuda").to(dtype)
    tables = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)
    meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                             torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), tables,
                             torch.full((batch,), -1, dtype=torch.int64, device="cuda"), 1, ctx, block)
    ql = torch.randn(batch, heads, R, device="cuda").to(torch.bfloat16)
    qr = torch.randn(batch, heads, P, device="cuda").to(torch.bfloat16)
    return cache, meta, ql, qr


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=100) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--splits", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    p.add_argument("--block-size", type=int, default=64)
    a = p.parse_args()
    torch.manual_seed(0)
    scale = torch.ones(1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch in a.batches:
        for ctx in a.contexts:
            times = {}
            for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                cache, meta, ql, qr = _case(batch, ctx, a.heads, dtype, a.block_size)
                want = mla_decode(ql, qr, cache, meta, scale, SOFTMAX_SCALE, tl_dot_only=True).float()
                shape = mla_routing.MLAShape(batch, a.heads, R, P, ctx, "bfloat16",
                                             "bfloat16" if name == "bf16" else "fp8_e4m3")
                route = mla_routing.decode_candidates(shape, Device(sms, True))[0]
                cells = []
                for s in a.splits:
                    call = functools.partial(mla_decode, ql, qr, cache, meta, scale, SOFTMAX_SCALE,
                                             num_splits=s or None)
                    err = ((call().float() - want).abs().max() / want.abs().max()).item()
                    us = _graph_us(call)
                    times[(name, s)] = us
                    cells.append(f"s{s or route.splits} {us:6.1f}" + ("!" if err > 2.0 ** -6 else ""))
                print(f"{name} {batch} x {ctx}, block {a.block_size} ({route.kernel}): " + " | ".join(cells), flush=True)
                del cache
            ratios = " | ".join(f"s{s} {times[('fp8', s)] / times[('bf16', s)]:.3f}" for s in a.splits)
            print(f"fp8 / bf16 {batch} x {ctx}: {ratios}", flush=True)


if __name__ == "__main__":
    main()
