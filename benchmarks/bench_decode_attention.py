"""Decode attention benchmark: kvforge Triton paged attention vs torch SDPA.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_attention.py [--out DIR] [--quick] [--graph] [--prefill]
    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_attention.py --prefill-only

``--prefill``/``--prefill-only``: the steps of ``PREFILL_STEPS`` (1 x 4096 and 1 x 8192 new tokens, 4096
after 4096 cached, 31 decode rows beside a 4096-token chunk) through the backend's routed path (chunks of
at least the SDPA threshold through torch's scaled_dot_product_attention, kvforge/attention/
paged_prefill_sdpa.py) and through the tl.dot kernel alone, bf16 and fp8 e4m3 caches: the two outputs
are checked to agree (relative L2 < 2e-2) before timing; us, TFLOP/s of the causal attention, and the
names of the attention kernels torch launched.

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
from kvforge.attention.paged_prefill_sdpa import routed_paged_attention  # noqa: E402
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


#: Prefill steps timed by --prefill: (name, [(cached tokens, new tokens) per sequence]).
PREFILL_STEPS = (
    ("1x4096 new", [(0, 4096)]),
    ("1x8192 new", [(0, 8192)]),
    ("4096 new after 4096", [(4096, 4096)]),
    ("31 decode (ctx 4096) + 4096 new", [(4096, 1)] * 31 + [(0, 4096)]),
)


def make_step(seqs, dtype, gen_seed=0):
    """A paged cache holding each sequence's whole context (random values, shuffled blocks), the step's
    query and metadata with the host copies the engine gives (query_start_loc, seq_lens)."""
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    seq_lens = [c + n for c, n in seqs]
    per = [math.ceil(n / BS) for n in seq_lens]
    nblk = sum(per)
    cache = torch.randn((nblk, 2, HKV, BS, D), device="cuda", generator=g).to(dtype)
    perm = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros((len(seqs), max(per)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(per):
        tables[i, :n] = perm[used:used + n]
        used += n
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device="cuda"),
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        block_size=BS,
        host_query_start_loc=tuple(qsl),
        host_seq_lens=tuple(seq_lens),
    )
    q = torch.randn(qsl[-1], HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, meta


def causal_flops(seqs):
    """QK^T and PV multiply-adds of causal attention, end-aligned: 4 x Hq x D per (query, visible key)."""
    return sum(4 * HQ * D * (n * c + n * (n + 1) // 2) for c, n in seqs)


def sdpa_kernels(fn):
    """Names of the CUDA kernels one call launches whose names say attention (what torch dispatched to)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "cudnn", "attention", "sdpa", "attn")
    return sorted(n for n in names if any(k in n.lower() for k in keys) and "paged_attn" not in n)


def run_prefill(rows_out):
    """Prefill steps: the routed path (long chunks through torch SDPA, the rest on the kernels) beside the
    tl.dot kernel over the whole step, bf16 and fp8 e4m3 caches; outputs checked to agree first."""
    scale = 1.0 / math.sqrt(D)
    ks = torch.full((HKV,), 0.05, device="cuda")
    print("prefill: routed (SDPA for chunks >= the threshold) vs the tl.dot kernel; us (TFLOP/s)", flush=True)
    for name, seqs in PREFILL_STEPS:
        q, cache_bf, meta = make_step(seqs, torch.bfloat16)
        flops = causal_flops(seqs)
        r = {"step": name, "seqs": seqs, "flops": flops}
        for kv_name, cache in (("bf16", cache_bf), ("fp8", (cache_bf.float() / 0.05).to(torch.float8_e4m3fn))):
            routed = functools.partial(routed_paged_attention, q, cache, meta, ks, ks, scale)
            tl_dot = functools.partial(paged_attention, q, cache, meta, ks, ks, scale, kernel="tl_dot")
            a, b = routed().float(), tl_dot().float()
            rel = ((a - b).norm() / b.norm()).item()
            if not rel < 2e-2:
                raise SystemExit(f"{name} {kv_name}: routed and tl.dot outputs differ (rel {rel:.3e})")
            r[kv_name + "_rel"] = rel
            for path, fn in (("routed", routed), ("tl_dot", tl_dot)):
                t = bench(fn)
                r[f"{kv_name}_{path}"] = t
                r[f"{kv_name}_{path}_TFLOPs"] = flops / (t[0] * 1e-6) / 1e12
            if kv_name == "bf16":
                r["sdpa_kernels"] = sdpa_kernels(routed)
            del cache
        rows_out.append(r)
        line = " | ".join(
            f"{kv} routed {r[kv + '_routed'][0]:.0f} ({r[kv + '_routed_TFLOPs']:.0f}) tl.dot {r[kv + '_tl_dot'][0]:.0f}"
            f" ({r[kv + '_tl_dot_TFLOPs']:.0f}) x{r[kv + '_tl_dot'][0] / r[kv + '_routed'][0]:.2f}"
            for kv in ("bf16", "fp8")
        )
        print(f"  {name:>32}: {line}; rel diff bf16 {r['bf16_rel']:.1e} fp8 {r['fp8_rel']:.1e}", flush=True)
        print(f"  {'':>32}  attention kernels: {', '.join(r['sdpa_kernels']) or '-'}", flush=True)
        del q, cache_bf
        torch.cuda.empty_cache()


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
    ap.add_argument("--prefill", action="store_true", help="also time prefill steps: routed (SDPA) vs tl.dot")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill steps")
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
    batches = [] if args.prefill_only else [1, 64] if args.quick else [1, 8, 64, 256]
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
    if args.prefill or args.prefill_only:
        USE_GRAPH = False  # prefill steps run eagerly in the engine
        run_prefill(prefill_rows)
    with open(os.path.join(args.out, "bench_decode_attention.json"), "w") as f:
        json.dump(dict(info=info, rows=rows, prefill=prefill_rows), f, indent=1)
    if not rows:
        return

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
