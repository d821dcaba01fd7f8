"""Decode attention benchmark: kvforge Triton paged attention vs torch SDPA.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_decode_attention.py [--out DIR] [--quick] [--sweep]

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


GLUON_SWEEP = [
    dict(gluon_variant="cta", gluon_tile_n=64, gluon_stages=2, gluon_warps=4),
    dict(gluon_variant="warp", gluon_v_mode=0, gluon_wt=16, gluon_stages=3, gluon_warps=4),
] + [
    dict(gluon_variant="warp", gluon_wt=wt, gluon_stages=ns, gluon_warps=nw, gluon_maxnreg=mr)
    for wt in (16, 32)
    for ns in (2, 3, 4)
    for nw in (4, 8)
    for mr in (None, 128 if nw == 8 else 168)
    if (2 * ns + 2) * nw * wt * D <= 200 * 1024
]
GLUON_SWEEP_SHAPES = {(1, 8192), (8, 8192), (64, 8192), (256, 8192), (8, 32768), (64, 1024)}


def run_gluon_sweep(q, cache_f8, meta, ks, scale, batch, ctx, rows, splits_options):
    """Time every Gluon fp8 tile/stage/warp choice on one shape (appends to ``rows``)."""
    for cfg in GLUON_SWEEP:
        for sp in splits_options:
            try:
                t = bench(
                    functools.partial(
                        paged_attention, q, cache_f8, meta, ks, ks, scale, num_splits=sp, _config=cfg
                    ),
                    rep=40,
                )
            except Exception as e:  # resource limits
                t = (float("nan"),) * 3
                print("gluon sweep fail", cfg, sp, type(e).__name__, str(e)[:100])
            rows.append(dict(batch=batch, ctx=ctx, kv="fp8_gluon", splits=sp, **cfg, us=t[0]))
    best = min(
        (r for r in rows if r["batch"] == batch and r["ctx"] == ctx and r["kv"] == "fp8_gluon"),
        key=lambda r: r["us"] if r["us"] == r["us"] else 1e18,
    )
    print(f"gluon sweep best b{batch} c{ctx}: {best}", flush=True)


SWEEP_CONFIGS = [
    dict(tile_n=tn, num_warps=nw, num_stages=ns) for tn in (64, 128, 256) for nw in (4, 8) for ns in (2, 3)
]


VARIANTS = {
    "pipe_t128w4s3": dict(tile_n=128, num_warps=4, num_stages=3),
    "pipe_t64w4s2": dict(tile_n=64, num_warps=4, num_stages=2),
    # V pages stored dim-major ([D, block] per KV head): V arrives K-major for the P.V dot
    "vt_t128w4s3": dict(tile_n=128, num_warps=4, num_stages=3, v_dim_major=True),
    "vt_t128w4s2": dict(tile_n=128, num_warps=4, num_stages=2, v_dim_major=True),
    "vt_t64w4s3": dict(tile_n=64, num_warps=4, num_stages=3, v_dim_major=True),
    "vt_t128w8s3": dict(tile_n=128, num_warps=8, num_stages=3, v_dim_major=True),
    "vt_t256w8s2": dict(tile_n=256, num_warps=8, num_stages=2, v_dim_major=True),
    "vt_asm_t128w4s3": dict(tile_n=128, num_warps=4, num_stages=3, v_dim_major=True, cvt_mode=2),
}


def dim_major_v(cache):
    """A copy of ``cache`` whose V pages are stored [D, block] (tokens contiguous) per KV head."""
    out = cache.clone()
    nb, _, hkv, bs, d = cache.shape
    out[:, 1] = cache[:, 1].transpose(-1, -2).contiguous().view(nb, hkv, bs, d)
    return out


def run_variants(out_dir):
    """Kernel-variant shoot-out on the fp8 decode path (docs/KERNELS.md, "Designs measured and not used"), bf16 as the yardstick."""
    from kvforge.kernels import triton_paged_attention as _pa

    scale = 1.0 / math.sqrt(D)
    res = []
    for batch, ctx in ((64, 8192), (256, 8192), (8, 8192), (64, 32768), (1, 32768)):
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        cache_bf, meta = make_paged(batch, ctx, torch.bfloat16)
        ks = torch.ones(HKV, device="cuda")
        t_bf = bench(functools.partial(paged_attention, q, cache_bf, meta, ks, ks, scale), rep=50)[0]
        for kvname, kvdt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            cache = cache_bf.to(kvdt)
            cache_vt = dim_major_v(cache)
            ref = paged_attention(q, cache, meta, ks, ks, scale, _config=dict(fp8_dot="q")).float()
            for name, cfg in VARIANTS.items():
                if kvname == "e5m2" and name not in ("pipe_t128w4s3", "vt_t128w4s3"):
                    continue
                c = cache_vt if cfg.get("v_dim_major") else cache
                try:
                    o = paged_attention(q, c, meta, ks, ks, scale, _config=cfg).float()
                    regs = getattr(_pa._LAST_LAUNCH.get("attn"), "n_regs", None)
                    err = ((o - ref).norm() / ref.norm()).item()
                    t = bench(
                        functools.partial(paged_attention, q, c, meta, ks, ks, scale, _config=cfg), rep=50
                    )
                except Exception as e:
                    print("variant fail", name, type(e).__name__, str(e)[:200])
                    continue
                nbytes = bytes_moved(batch, ctx, 1)
                r = dict(
                    batch=batch,
                    ctx=ctx,
                    kv=kvname,
                    variant=name,
                    us=t[0],
                    min=t[1],
                    max=t[2],
                    err=err,
                    TBps=nbytes / (t[0] * 1e-6) / 1e12,
                    bf16_us=t_bf,
                    speedup_vs_bf16=t_bf / t[0],
                    regs=regs,
                )
                res.append(r)
                print(
                    f"{batch:4d} {ctx:6d} {kvname} {name:18s} {t[0]:8.1f} us {r['TBps']:.2f} TB/s "
                    f"x{t_bf / t[0]:.2f} vs bf16 ({t_bf:.1f}) regs {regs} err {err:.1e}",
                    flush=True,
                )
            del cache, cache_vt
        del cache_bf
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump(res, f, indent=1)


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
    ap.add_argument("--sweep", action="store_true", help="also sweep tile/warps/stages/splits on key shapes")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--variants", action="store_true", help="only the fp8 kernel-variant shoot-out")
    ap.add_argument("--profile-one", action="store_true", help="only run 64x8192 decode (for ncu)")
    ap.add_argument("--prefill", action="store_true", help="also time one 8k causal prefill")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    ap.add_argument("--gluon-sweep", action="store_true", help="also sweep the Gluon fp8 kernel's tiles")
    args = ap.parse_args()
    global USE_GRAPH
    USE_GRAPH = args.graph
    if args.variants:
        run_variants(args.out)
        return
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
    sweep_rows = []
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
            from kvforge.kernels import triton_paged_attention as _pa

            fp8_kernel = _pa._LAST_LAUNCH.get("attn")
            # the fp8 tl.dot kernel (what the Gluon decode kernel replaces), side by side
            triton_only = dict(gluon=False)
            out_f8t = paged_attention(q, cache_f8, meta, ks, ks, scale, _config=triton_only)
            res["fp8_triton"] = bench(
                functools.partial(paged_attention, q, cache_f8, meta, ks, ks, scale, _config=triton_only)
            )
            res["fp8_gluon_vs_triton_rel"] = (
                (out_f8.float() - out_f8t.float()).norm() / out_f8t.float().norm()
            ).item()
            if args.gluon_sweep and (batch, ctx) in GLUON_SWEEP_SHAPES:
                run_gluon_sweep(
                    q, cache_f8, meta, ks, scale, batch, ctx, sweep_rows, [None, 2 if batch > 8 else 8]
                )
            # fp8 vs bf16 outputs on the same data (fp8 rounding of K/V only)
            kk = fp8_kernel
            if kk is not None:
                res["fp8_kernel"] = dict(
                    name=getattr(kk, "name", None),
                    regs=getattr(kk, "n_regs", None),
                    spills=getattr(kk, "n_spills", None),
                    smem=getattr(getattr(kk, "metadata", None), "shared", None),
                )
            res["fp8_vs_bf16_rel"] = ((out_f8.float() - out_bf.float()).norm() / out_bf.float().norm()).item()
            res["nan"] = bool(torch.isnan(out_bf).any() or torch.isnan(out_f8).any())
            if args.sweep and (batch, ctx) in {(8, 8192), (64, 8192), (1, 32768)}:
                for name, cache in (("bf16", cache_bf), ("fp8", cache_f8)):
                    for cfg in SWEEP_CONFIGS:
                        for sp in [None, 4, 16] if batch <= 8 else [None, 2]:
                            try:
                                t = bench(
                                    functools.partial(
                                        paged_attention,
                                        q,
                                        cache,
                                        meta,
                                        ks,
                                        ks,
                                        scale,
                                        num_splits=sp,
                                        _config=cfg,
                                    ),
                                    rep=40,
                                )
                            except Exception as e:  # resource limits
                                t = (float("nan"),) * 3
                                print("sweep fail", name, cfg, sp, type(e).__name__, str(e)[:100])
                            sweep_rows.append(dict(batch=batch, ctx=ctx, kv=name, splits=sp, **cfg, us=t[0]))
                    best = min(
                        (
                            r
                            for r in sweep_rows
                            if r["batch"] == batch and r["ctx"] == ctx and r["kv"] == name
                        ),
                        key=lambda r: r["us"] if r["us"] == r["us"] else 1e18,
                    )
                    print(f"sweep best b{batch} c{ctx} {name}: {best}  (default {res[name][0]:.1f} us)")
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
        json.dump(dict(info=info, rows=rows, sweep=sweep_rows, prefill=prefill_rows), f, indent=1)

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
