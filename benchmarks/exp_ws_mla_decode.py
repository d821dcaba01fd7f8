"""Benchmark of the warp-specialized fp8 MLA decode (``kvforge/kernels/gluon_mla_decode_ws.py``) beside the
wgmma kernel's fp8 path and ``regs_ring2`` (``benchmarks/exp_regs_mla_decode.py``), each checked against the
tl.dot kernel first.

    PYTHONUNBUFFERED=1 python3 benchmarks/exp_ws_mla_decode.py [--out DIR] [--shapes HxBxCTX,...] \
        [--cfgs 'stages=4;lazy=0;nh=16']
    ncu ... python3 benchmarks/exp_ws_mla_decode.py --profile 16x32x16384 [--cfgs nh=16]

``cfg`` keys: ``stages`` (ring depth), ``lazy`` (0: rescale every tile), ``nh`` (heads per program, 8 or 16;
the launcher's choice unless set), ``producer_regs``, ``consumer_regs``, ``fp8_query`` (the fp8 score
product; checked against 2^-4 instead of 2^-6). The engine calls the kernel through
``gluon_mla_decode.mla_decode_wgmma`` where :func:`gluon_mla_decode_ws.routes` allows; here it is called
directly, at any shape.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvforge.kernels import gluon_mla_decode_ws as ws  # noqa: E402
from kvforge.kernels.triton_paged_attention import _num_sms  # noqa: E402


def mla_decode_ws(q_latent, q_rope, cache, meta, scale, softmax_scale, cfg=None):
    """The kernel at its default split count (``cfg["nh"]`` heads per program, the launcher's unless set)."""
    cfg = dict(cfg or {})
    fp8_query = bool(cfg.pop("fp8_query", False))
    splits = ws.num_splits_for(meta.num_seqs, q_latent.shape[1], meta.max_seq_len, _num_sms(q_latent.device),
                               cfg.get("nh"))  # fmt: skip
    return ws.mla_decode_ws(q_latent, q_rope, cache, meta, scale, softmax_scale, num_splits=splits,
                            out=torch.empty_like(q_latent), cfg=cfg, fp8_query=fp8_query)  # fmt: skip


def main() -> None:
    from bench_mla_decode import SOFTMAX_SCALE, make_case
    from exp_regs_mla_decode import VARIANTS, compare_fp8_variants

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16x1x65536,16x8x65536,16x32x65536,16x128x65536,8x32x65536,8x128x65536,"
                                        "16x32x4096,16x3x1000")
    ap.add_argument("--cfgs", default="", help="extra ws configs, e.g. 'stages=4;stages=3,consumer_regs=240'")
    ap.add_argument("--profile", default=None, help="HEADSxBATCHxCTX: only run the ws kernel 3 times (for ncu)")
    a = ap.parse_args()
    if a.profile:
        heads, batch, ctx = (int(v) for v in a.profile.split("x"))
        cache, meta, ql, qr = make_case(batch, ctx, heads, torch.float8_e4m3fn)
        cfg = {k: int(v) for k, v in (kv.split("=") for kv in a.cfgs.split(",") if kv)}
        for _ in range(3):
            mla_decode_ws(ql, qr, cache, meta, torch.tensor([0.75], device="cuda"), SOFTMAX_SCALE, cfg=cfg)
        torch.cuda.synchronize()
        return
    variants = {"ws": functools.partial(mla_decode_ws)}
    for spec in filter(None, a.cfgs.split(";")):
        cfg = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        variants["ws_" + spec.replace(",", "_").replace("=", "")] = functools.partial(mla_decode_ws, cfg=cfg)
    variants["regs_ring2"] = VARIANTS["regs_ring2"]
    compare_fp8_variants(variants, a.shapes, a.out, "exp_ws_mla_decode.json")


if __name__ == "__main__":
    main()
