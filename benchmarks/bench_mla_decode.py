"""MLA decode benchmark: kvforge's Triton MLA decode, three regimes, against the copy bandwidth.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_mla_decode.py [--out DIR] [--quick] [--heads 8,16] [--batches ...]

Shapes: DeepSeek latent rows (kv_lora_rank 512 + rope 64 = 576 per token),
block size 64, one new token per sequence; heads per rank 8, 16, 128;
context 4k, 16k, 64k; batch 1, 8, 32, 128 (shapes whose cache would exceed
40 GB are skipped). Regimes: bf16 cache + bf16 query ("bf16"), fp8 e4m3
cache + bf16 query ("fp8", regime a), fp8 e4m3 cache + fp8 query ("fp8q",
regime b), all on the tl.dot kernel; then the same three as the engine routes them (the Gluon
kernels where the routing table sends the call), checked against the tl.dot kernel. Each call is captured in a CUDA graph and timed by
triton.testing.do_bench (L2 cleared before every call); median, min, max.

Bytes counted: every context row (576 x element size), the query
(H x 576 x 2), the block table and the output (H x 512 x 2). Achieved
bandwidth = bytes / median time; "%cp" = that over the device-to-device copy
bandwidth (read + written bytes) measured in the same run. Also reported:
TFLOP/s of the two products (H x ctx x (576 + 512) x 2 per sequence).
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

from triton.testing import do_bench  # noqa: E402

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.kernels.gluon_support import gluon_runs_on  # noqa: E402
from kvforge.kernels.triton_mla_decode import mla_decode  # noqa: E402

R, P, BS = 512, 64, 64
SOFTMAX_SCALE = 1.0 / math.sqrt(192)


def bench(fn, rep=60, graph=True):
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    med, lo, hi = do_bench(fn, warmup=10, rep=rep, quantiles=[0.5, 0.0, 1.0])
    return med * 1e3, lo * 1e3, hi * 1e3


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy (read + write bytes) with a copy kernel; not graph-captured (a captured memcpy
    node may run on a copy engine, which is slower)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    med, _, _ = bench(functools.partial(y.copy_, x), rep=200, graph=False)
    del x, y
    return 2 * nbytes / (med * 1e-6)


def make_case(batch, ctx, heads, cache_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb_seq = -(-ctx // BS)
    nblk = batch * nb_seq
    cache = torch.empty((nblk, BS, R + P), dtype=cache_dtype, device="cuda")
    chunk = max(1, (1 << 28) // (BS * (R + P)))
    for s in range(0, nblk, chunk):
        e = min(nblk, s + chunk)
        cache[s:e] = (torch.randn((e - s, BS, R + P), device="cuda", generator=g)).to(cache_dtype)
    bt = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32).view(batch, nb_seq)
    meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                             torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), bt,
                             torch.full((batch,), -1, dtype=torch.int64, device="cuda"), 1, ctx, BS)
    ql = torch.randn((batch, heads, R), device="cuda", generator=g).to(torch.bfloat16)
    qr = torch.randn((batch, heads, P), device="cuda", generator=g).to(torch.bfloat16)
    return cache, meta, ql, qr


def save_rows(out_dir, filename, copy_bw, rows):
    """``rows`` with the copy bandwidth and the GPU's name as ``out_dir/filename`` (JSON)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, filename), "w") as fh:
        json.dump(dict(copy_tbps=copy_bw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), fh, indent=1)


def bytes_read(batch, ctx, heads, elem):
    rows = batch * ctx * (R + P) * elem
    table = batch * (-(-ctx // BS)) * 4
    q = batch * heads * (R + P) * 2
    out = batch * heads * R * 2
    return rows + table + q + out


REGIMES = {"bf16": (torch.bfloat16, None), "fp8": (torch.float8_e4m3fn, None),
           "fp8q": (torch.float8_e4m3fn, "fp8_e4m3")}
# The engine's call (routed by kvforge/attention/routing/mla.py: the Gluon kernels on sm_90 with the tested
# Triton), checked against the tl.dot kernel in the same run. "fp8q_routed": the plan's e4m3 query (up to 16
# heads; the warp-specialized kernel's fp8 score product where it takes the call), checked against 2^-4
# instead of 2^-6.
ROUTED_REGIMES = {"bf16_routed": (torch.bfloat16, None), "fp8_routed": (torch.float8_e4m3fn, None),
                  "fp8q_routed": (torch.float8_e4m3fn, "fp8_e4m3")}


def run_shape(batch, ctx, heads, copy_bw):
    row = dict(batch=batch, ctx=ctx, heads=heads)
    scale = torch.tensor([1.0], device="cuda")
    for name, (cdt, qd) in REGIMES.items():
        cache, meta, ql, qr = make_case(batch, ctx, heads, cdt)
        call = functools.partial(mla_decode, ql, qr, cache, meta, scale, SOFTMAX_SCALE, query_dtype=qd,
                                 tl_dot_only=True)  # the tl.dot kernel
        med, lo, hi = bench(call)
        nbytes = bytes_read(batch, ctx, heads, cache.element_size())
        flops = 2 * batch * heads * ctx * (R + P + R)
        row[name] = dict(us=med, min=lo, max=hi, tbps=nbytes / (med * 1e-6) / 1e12,
                         pct_copy=100 * nbytes / (med * 1e-6) / copy_bw, tflops=flops / (med * 1e-6) / 1e12)
        del cache, call
    for name, (cdt, qd) in ROUTED_REGIMES.items():
        cache, meta, ql, qr = make_case(batch, ctx, heads, cdt)
        if not gluon_runs_on(ql) or (qd and heads > 16):  # the Gluon gate is closed, or the query is not declared
            print(f"skip {name}: the Gluon gate is closed here or the e4m3 query is not declared", flush=True)
            continue
        want = mla_decode(ql, qr, cache, meta, scale, SOFTMAX_SCALE, tl_dot_only=True).float()
        call = functools.partial(mla_decode, ql, qr, cache, meta, scale, SOFTMAX_SCALE, query_dtype=qd)
        got = call().float()
        rel = ((got - want).abs().max() / want.abs().max()).item()
        bound = 2.0 ** -4 if qd else 2.0 ** -6
        assert rel <= bound, f"{name} differs from the tl.dot kernel: {rel:.2e}"
        med, lo, hi = bench(call)
        nbytes = bytes_read(batch, ctx, heads, cache.element_size())
        row[name] = dict(us=med, min=lo, max=hi, tbps=nbytes / (med * 1e-6) / 1e12,
                         pct_copy=100 * nbytes / (med * 1e-6) / copy_bw, max_rel_vs_tl_dot=rel)
        del cache
    row["fp8_vs_bf16"] = row["bf16"]["us"] / row["fp8"]["us"]
    row["fp8q_vs_fp8"] = row["fp8"]["us"] / row["fp8q"]["us"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--heads", default=None, help="comma-separated heads per rank (default 8,16,128)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,128)")
    ap.add_argument("--ctxs", default=None, help="comma-separated contexts (default 4096,16384,65536)")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    result = dict(date=datetime.datetime.now(datetime.UTC).isoformat(), gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, host=platform.node(), copy_tbps=copy_bw / 1e12, rows=[])

    def ints(text, default):
        return tuple(int(x) for x in text.split(",")) if text else default

    heads_list = ints(args.heads, (16, 128) if args.quick else (8, 16, 128))
    ctxs = ints(args.ctxs, (4096, 65536) if args.quick else (4096, 16384, 65536))
    batches = ints(args.batches, (1, 32) if args.quick else (1, 8, 32, 128))
    print(f"{'H':>4} {'batch':>5} {'ctx':>6} | {'bf16 us':>9} {'%cp':>4} | {'fp8 us':>9} {'%cp':>4} | "
          f"{'fp8q us':>9} {'%cp':>4} {'fp8q TF/s':>9} | bf16/fp8 fp8/fp8q")
    for heads in heads_list:
        for batch in batches:
            for ctx in ctxs:
                if batch * ctx * (R + P) * 2 > 40e9:
                    continue
                row = run_shape(batch, ctx, heads, copy_bw)
                result["rows"].append(row)
                b, f, q = row["bf16"], row["fp8"], row["fp8q"]
                tl = "".join(f" | {k} {row[k]['us']:.1f} ({row[k]['pct_copy']:.0f}%)"
                             for k in ROUTED_REGIMES if k in row)
                print(f"{heads:>4} {batch:>5} {ctx:>6} | {b['us']:>9.1f} {b['pct_copy']:>4.0f} | {f['us']:>9.1f} "
                      f"{f['pct_copy']:>4.0f} | {q['us']:>9.1f} {q['pct_copy']:>4.0f} {q['tflops']:>9.0f} | "
                      f"{row['fp8_vs_bf16']:>8.2f} {row['fp8q_vs_fp8']:>8.2f}{tl}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mla_decode.json"), "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
