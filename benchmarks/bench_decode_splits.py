"""Paged decode attention of a few sequences at each split count: the kernel the routing table picks, with
``num_splits`` pinned as a CUDA graph pins it, timed over CUDA-graph replays (the split merge included).

    python benchmarks/bench_decode_splits.py --batch 1 --contexts 128 512 1152 2048 8192 --splits 1 4 8 16 32 64

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head size 128, block size 16); every context's
metadata says ``max_seq_len`` 2048 or the context, whichever is larger (the graph bucket's routing). Prints
microseconds per call, bf16 then fp8 e4m3 KV; a ``!`` marks a result more than 2e-3 from the one-split
output.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton

from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels.triton_paged_attention import paged_attention

Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def _batch(batch: int, ctx: int, kv_dtype: torch.dtype):
    blocks = -(-ctx // BLOCK)
    cache = (torch.randn(batch * blocks + 4, 2, KV_HEADS, BLOCK, HEAD, device="cuda") * 0.5).to(kv_dtype)
    tables = torch.randperm(batch * blocks + 4, device="cuda")[: batch * blocks].to(torch.int32).view(batch, blocks)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), block_tables=tables.contiguous(),
        slot_mapping=tables[:, -1].to(torch.int64) * BLOCK + (ctx - 1) % BLOCK, max_query_len=1,
        max_seq_len=max(ctx, 2048), block_size=BLOCK)
    return cache, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1152, 2048, 8192])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    a = p.parse_args()
    torch.manual_seed(0)
    ones = torch.ones(KV_HEADS, device="cuda")
    for name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        for ctx in a.contexts:
            cache, meta = _batch(a.batch, ctx, kv_dtype)
            q = torch.randn(a.batch, Q_HEADS, HEAD, device="cuda", dtype=torch.bfloat16)
            one = paged_attention(q, cache, meta, ones, ones, HEAD**-0.5, num_splits=1).float()
            row = []
            for s in a.splits:
                call = functools.partial(paged_attention, q, cache, meta, ones, ones, HEAD**-0.5, num_splits=s)
                err = (call().float() - one).abs().max().item()
                us = triton.testing.do_bench_cudagraph(call, rep=200) * 1000
                row.append(f"s{s} {us:5.1f}" + ("!" if err > 2e-3 else ""))
            print(f"{name} {a.batch} x {ctx}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
