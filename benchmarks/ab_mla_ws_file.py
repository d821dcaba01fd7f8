"""A/B of the warp-specialized fp8 MLA decode kernel: the tree's ``kvforge/kernels/gluon_mla_decode_ws.py``
against another version of that file, in one process on one cache per shape (the variants interleaved).

    git show REV:kvforge/kernels/gluon_mla_decode_ws.py > /tmp/ws_before.py
    PYTHONUNBUFFERED=1 python benchmarks/ab_mla_ws_file.py --old-file /tmp/ws_before.py [--heads 16,8]
        [--shapes 8x4096,32x16384] [--rounds 3] [--out DIR]

Both versions run at the engine's split count (``routing.mla.ws_splits``), with the model-dtype query (the
default: two e4m3 terms at 16 heads a program, fp16 registers at 8) and with the opt-in e4m3 query. Timing as
``bench_mla_decode.py`` (CUDA-graph replay under ``do_bench``, L2 cleared); median [min-max] us over the
rounds, the share of the copy bandwidth measured in the same run, and each output's relative L2 distance to a
float32 reference with the exact query (``bench_mla_query_terms.reference``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_mla_decode import SOFTMAX_SCALE, bench, bytes_read, copy_bandwidth, make_case, save_rows  # noqa: E402
from bench_mla_query_terms import reference, rel_l2  # noqa: E402

from kvforge.attention.routing import mla as mla_routing  # noqa: E402
from kvforge.kernels import gluon_mla_decode_ws as tree  # noqa: E402


def load_file(path: str):
    spec = importlib.util.spec_from_file_location("gluon_mla_decode_ws_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-file", required=True)
    ap.add_argument("--heads", default="16,8")
    ap.add_argument("--shapes", default="8x4096,32x4096,128x4096,32x16384,8x65536,128x16384,32x65536")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    versions = {"old": load_file(args.old_file), "tree": tree}
    copy_bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()}), {sms} SMs", flush=True)
    scale = torch.tensor([1.0], device="cuda")
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        for shape in args.shapes.split(","):
            batch, ctx = (int(x) for x in shape.split("x"))
            cache, meta, ql, qr = make_case(batch, ctx, heads, torch.float8_e4m3fn)
            want = reference(ql, qr, cache, meta, 1.0)
            splits = mla_routing.ws_splits(batch, heads, ctx, sms)
            calls = {}
            for name, module in versions.items():
                for query in ("model", "e4m3"):
                    calls[f"{name} {query}"] = functools.partial(
                        module.mla_decode_ws, ql, qr, cache, meta, scale, SOFTMAX_SCALE, num_splits=splits,
                        out=torch.empty_like(ql), fp8_query=query == "e4m3")
            errs = {k: rel_l2(call(), want) for k, call in calls.items()}
            times = {k: [] for k in calls}
            for _ in range(args.rounds):
                for k, call in calls.items():
                    times[k].append(bench(call, rep=40)[0])
            nbytes = bytes_read(batch, ctx, heads, 1)
            row = dict(heads=heads, batch=batch, ctx=ctx, tokens_per_cta=-(-ctx // splits))
            line = f"{heads:>3} {batch:>4}x{ctx:<6} tok/CTA {row['tokens_per_cta']:>6} |"
            for k, ts in times.items():
                med = statistics.median(ts)
                row[k] = dict(us=med, min=min(ts), max=max(ts), pct_copy=100 * nbytes / (med * 1e-6) / copy_bw,
                              rel_l2=errs[k])
                line += f" {k} {med:.1f} [{min(ts):.1f}-{max(ts):.1f}] ({row[k]['pct_copy']:.0f}%) {errs[k]:.1e} |"
            for query in ("model", "e4m3"):
                line += f" old/tree {query} {row[f'old {query}']['us'] / row[f'tree {query}']['us']:.3f}"
            print(line, flush=True)
            rows.append(row)
            del cache, want
            torch.cuda.empty_cache()
    if args.out:
        save_rows(args.out, "ab_mla_ws_file.json", copy_bw, rows)


if __name__ == "__main__":
    main()
