"""Decode attention benchmark: kvforge Triton paged attention vs torch SDPA.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_attention.py [--out DIR] [--quick] [--graph] [--prefill]

Shapes: 32 query heads / 8 KV heads, head dim 128, block size 16, one new
token per sequence; batch 1, 8, 64, 256 x context 1k, 8k, 32k; KV cache bf16
and fp8 e4m3 (kvforge), and torch SDPA (enable_gqa) over a contiguous bf16
[batch, Hkv, ctx, D] cache on the same shapes.

Reported per shape: median time (and min/max) from triton.testing.do_bench
(which clears L2 before every timed call), bytes actually read (K+V of every
context token, the query, the block table) plus the output written, the
achieved bandwidth, that bandwidth as a fraction of the device-to-device copy
bandwidth measured in the same run (copy bytes = read + written), the SDPA
time, and fp8 vs bf16 speedup. Block tables are random permutations.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.kernels.triton_paged_attention import paged_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


USE_GRAPH = False


def bench(fn, rep=100):
    if USE_GRAPH:
        # capture one call in a CUDA graph (as the engine's decode does) so the
        # host launch cost of the Python wrapper is not part of the GPU time
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    med, lo, hi = do_bench(fn, warmup=25, rep=rep, quantiles=[0.5, 0.0, 1.0])
    return med * 1e3, lo * 1e3, hi * 1e3  # microseconds


def copy_bandwidth(nbytes=4 << 30):
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    med, lo, hi = bench(functools.partial(y.copy_, x), rep=200)
    del x, y
    return 2 * nbytes / (med * 1e-6), med


def make_paged(batch, ctx, dtype, gen_seed=0):
    nblk_seq = math.ceil(ctx / BS)
    nblk = batch * nblk_seq
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    cache = torch.empty((nblk, 2, HKV, BS, D), dtype=dtype, device="cuda")
    chunk = max(1, (1 << 28) // (2 * HKV * BS * D))
    for s in range(0, nblk, chunk):
        e = min(nblk, s + chunk)
        cache[s:e] = torch.randn((e - s, 2, HKV, BS, D), device="cuda", generator=g).to(dtype)
    perm = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32)
    bt = perm.view(batch, nblk_seq)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        block_tables=bt,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        max_query_len=1,
        max_seq_len=ctx,
        block_size=BS,
    )
    return cache, meta


def bytes_moved(batch, ctx, kv_elem):
    kv = batch * ctx * HKV * D * 2 * kv_elem
    q_o = 2 * batch * HQ * D * 2
    bt = batch * math.ceil(ctx / BS) * 4
    return kv + q_o + bt


def run_prefill(rows_out):
    """One prefill shape for reference: 1 x 8192 new tokens, causal, vs SDPA (flash)."""
    T = 8192
    scale = 1.0 / math.sqrt(D)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache_bf, meta = make_paged(1, T, torch.bfloat16)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device="cuda"),
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        slot_mapping=torch.zeros(T, dtype=torch.int64, device="cuda"),
        max_query_len=T,
        max_seq_len=T,
        block_size=BS,
    )
    ks = torch.ones(HKV, device="cuda")
    flops = 2 * 2 * HQ * D * T * T / 2
    r = {"prefill_T": T}
    for name, cache in (("bf16", cache_bf), ("fp8", cache_bf.to(torch.float8_e4m3fn))):
        paged_attention(q, cache, meta, ks, ks, scale)
        t = bench(functools.partial(paged_attention, q, cache, meta, ks, ks, scale))
        r[name] = t
        r[name + "_TFLOPs"] = flops / (t[0] * 1e-6) / 1e12
    qs = q.transpose(0, 1).unsqueeze(0)
    k = torch.randn(1, HKV, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = bench(functools.partial(sdpa, qs, k, v, is_causal=True, enable_gqa=True))
    r["sdpa"] = t
    r["sdpa_TFLOPs"] = flops / (t[0] * 1e-6) / 1e12
    rows_out.append(r)
    print(
        f"prefill 1x{T} causal: bf16 {r['bf16'][0]:.0f} us ({r['bf16_TFLOPs']:.0f} TFLOP/s), fp8"
        f" {r['fp8'][0]:.0f} us ({r['fp8_TFLOPs']:.0f}), sdpa {t[0]:.0f} us ({r['sdpa_TFLOPs']:.0f})",
        flush=True,
    )


def profile_one():
    """For ncu: 64 x 8192 fp8 e4m3 and bf16 decode, three calls each."""
    scale = 1.0 / math.sqrt(D)
    q = torch.randn(64, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache_bf, meta = make_paged(64, 8192, torch.bfloat16)
    ks = torch.ones(HKV, device="cuda")
    cache_f8 = cache_bf.to(torch.float8_e4m3fn)
    for cache in (cache_f8, cache_bf):
        for _ in range(3):
            paged_attention(q, cache, meta, ks, ks, scale)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="only batch 1/64 x ctx 8k")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--profile-one", action="store_true", help="only run 64x8192 decode (for ncu)")
    ap.add_argument("--prefill", action="store_true", help="also time one 8k causal prefill")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    args = ap.parse_args()
    global USE_GRAPH
    USE_GRAPH = args.graph
    if args.profile_one:
        profile_one()
        return
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    use_graph, USE_GRAPH = USE_GRAPH, False
    copy_bw, copy_us = copy_bandwidth()
    USE_GRAPH = use_graph
    info = dict(
        device=dev,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        copy_bw_TBps=copy_bw / 1e12,
        cmd=" ".join(sys.argv),
        graph=args.graph,
    )
    print(f"# {dev} torch {torch.__version__} triton {triton.__version__}")
    print(f"# copy bandwidth (read+write) {copy_bw / 1e12:.3f} TB/s ({copy_us:.0f} us for 2x4 GiB)")
    batches = [1, 64] if args.quick else [1, 8, 64, 256]
    ctxs = [8192] if args.quick else [1024, 8192, 32768]
    scale = 1.0 / math.sqrt(D)
    rows = []
    for batch in batches:
        for ctx in ctxs:
            q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
            res = {"batch": batch, "ctx": ctx}
            cache_bf, meta = make_paged(batch, ctx, torch.bfloat16)
            ks = torch.ones(HKV, device="cuda")
            out_bf = paged_attention(q, cache_bf, meta, ks, ks, scale)
            res["bf16"] = bench(functools.partial(paged_attention, q, cache_bf, meta, ks, ks, scale))
            cache_f8 = cache_bf.to(torch.float8_e4m3fn)
            out_f8 = paged_attention(q, cache_f8, meta, ks, ks, scale)
            res["fp8"] = bench(functools.partial(paged_attention, q, cache_f8, meta, ks, ks, scale))
            # the fp8 tl.dot kernel (what the Gluon decode kernels replace where they route), side by side
            out_f8t = paged_attention(q, cache_f8, meta, ks, ks, scale, kernel="tl_dot")
            res["fp8_triton"] = bench(
                functools.partial(paged_attention, q, cache_f8, meta, ks, ks, scale, kernel="tl_dot")
            )
            res["fp8_gluon_vs_triton_rel"] = (
                (out_f8.float() - out_f8t.float()).norm() / out_f8t.float().norm()
            ).item()
            # fp8 vs bf16 outputs on the same data (fp8 rounding of K/V only)
            res["fp8_vs_bf16_rel"] = ((out_f8.float() - out_bf.float()).norm() / out_bf.float().norm()).item()
            res["nan"] = bool(torch.isnan(out_bf).any() or torch.isnan(out_f8).any())
            del cache_f8
            # SDPA over a contiguous bf16 cache with the same values
            if not args.no_sdpa:
                del cache_bf
                k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
                q4 = q.view(batch, HQ, 1, D)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                sdpa(q4, k, v, enable_gqa=True)
                res["sdpa"] = bench(functools.partial(sdpa, q4, k, v, enable_gqa=True))
                del k, v
            else:
                del cache_bf
            torch.cuda.empty_cache()
            for name, el in (("bf16", 2), ("fp8", 1)):
                b = bytes_moved(batch, ctx, el)
                res[name + "_bytes"] = b
                res[name + "_TBps"] = b / (res[name][0] * 1e-6) / 1e12
                res[name + "_pct_copy"] = 100 * b / (res[name][0] * 1e-6) / copy_bw
            if "sdpa" in res:
                res["sdpa_TBps"] = bytes_moved(batch, ctx, 2) / (res["sdpa"][0] * 1e-6) / 1e12
            rows.append(res)
            print(json.dumps(res), flush=True)

    prefill_rows = []
    if args.prefill:
        run_prefill(prefill_rows)
    with open(os.path.join(args.out, "bench_decode_attention.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, prefill=prefill_rows), f, indent=1)

    print()
    print(
        f"device {dev}; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write); times in us (median [min-max])"
    )
    hdr = (
        f"{'batch':>5} {'ctx':>6} | {'bf16 us':>22} {'TB/s':>5} {'%cp':>4} | {'fp8 us':>22} {'TB/s':>5}"
        f" {'%cp':>4} | {'fp8 tl.dot us':>13} | {'sdpa us':>8} {'TB/s':>5} | {'fp8/bf16':>8} {'sdpa/fp8':>8}"
    )
    print(hdr)
    for r in rows:

        def f(t):
            return f"{t[0]:8.1f} [{t[1]:.0f}-{t[2]:.0f}]"

        sd = r.get("sdpa", (float("nan"),) * 3)
        print(
            f"{r['batch']:>5} {r['ctx']:>6} | {f(r['bf16']):>22} {r['bf16_TBps']:5.2f} {r['bf16_pct_copy']:4.0f} |"
            f" {f(r['fp8']):>22} {r['fp8_TBps']:5.2f} {r['fp8_pct_copy']:4.0f} | {r['fp8_triton'][0]:13.1f} |"
            f" {sd[0]:8.1f}"
            f" {r.get('sdpa_TBps', float('nan')):5.2f} | {r['bf16'][0] / r['fp8'][0]:8.2f}"
            f" {sd[0] / r['fp8'][0]:8.2f}"
        )


if __name__ == "__main__":
    main()
