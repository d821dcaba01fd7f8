"""One-row products of a whole Llama-3.1-8B decode step, back to back in one CUDA graph.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_gemv_chain.py [--layers 32] [--sweep] [--read-sweep] [--out DIR]

The chain is what a batch-1 decode step multiplies, in the engine's order and with its prologues: per layer
``RMSNorm(x + residual) @ qkv`` (6144 x 4096), ``attn @ o`` (4096 x 4096; the first 4096 values of the qkv
row stand in for attention's output), ``RMSNorm(x + residual) @ gate_up`` (28672 x 4096),
``(SiLU(gate) * up) @ down`` (4096 x 14336), then ``RMSNorm @ lm_head`` (128256 x 4096). Every layer has
its own weights, so the chain streams 15 GB from HBM like the step does and no weight is in L2 when its
product starts. Nothing but the products runs: the chain's time over its weight bytes is what the step's
GEMMs can reach, and its gap to a single long stream is what the launches' ramp and tail cost.

Reported (median [min-max] us of ``do_bench`` over the graph's replay):

* the read bandwidth of one product over a 2 GiB weight (steady streaming, no ramp to amortize; with
  ``--read-sweep`` for every candidate configuration too) and the device-to-device copy bandwidth (read +
  written), both measured in the same run;
* the chain at the kernel's own launch configurations: its time, TB/s, and fractions of both bandwidths;
* with ``--sweep``, per projection, the chain with that projection's launch replaced by each candidate
  configuration (the others at their defaults), and the chain with every projection at its best.

Before timing, the chain's logits are compared with a float32 replay of the same products (separate
norm, SiLU-and-mul and matmul in float32 from the kernel's own inputs at each product) so a configuration
that computes something else stops the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from gpu_timing import cuda_setup, graph_bench  # noqa: E402

from kvforge.kernels.triton_small_m_linear import (  # noqa: E402
    PROLOGUE_NONE,
    PROLOGUE_RMS_NORM,
    PROLOGUE_SILU_MUL,
    SmallMLinearConfig,
    rms_norm_linear,
    silu_mul_linear,
    small_m_linear,
    small_m_linear_config,
)

HIDDEN, QKV, INTER, VOCAB = 4096, 6144, 14336, 128256
EPS = 1e-5
#: (N, K) of each projection and the prologue that computes its input (the RMSNorm prologue never splits K).
SHAPES = {"qkv": (QKV, HIDDEN, PROLOGUE_RMS_NORM), "o": (HIDDEN, HIDDEN, PROLOGUE_NONE),
          "gate_up": (2 * INTER, HIDDEN, PROLOGUE_RMS_NORM), "down": (HIDDEN, INTER, PROLOGUE_SILU_MUL),
          "lm_head": (VOCAB, HIDDEN, PROLOGUE_RMS_NORM)}
#: Broadcast-path candidates (block_n, block_k, num_warps, num_stages); K splits added where allowed.
CANDIDATES = [(4, 512, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3), (32, 512, 8, 3), (8, 1024, 4, 2), (16, 1024, 8, 2),
              (16, 256, 4, 4), (8, 256, 4, 5), (4, 1024, 4, 3), (16, 512, 8, 4), (32, 256, 4, 3), (2, 1024, 4, 3)]
SPLITS = (1, 2, 4)


def make_weights(layers: int, device) -> dict:
    def w(n, k):
        return (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)

    def norm():
        return (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(torch.bfloat16)

    return {"layers": [dict(ln1=norm(), qkv=w(QKV, HIDDEN), o=w(HIDDEN, HIDDEN), ln2=norm(),
                            gate_up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(layers)],
            "lnf": norm(), "lm_head": w(VOCAB, HIDDEN)}


def run_chain(weights: dict, x: torch.Tensor, configs: dict, record=None) -> torch.Tensor:
    """The step's products; ``record(name, input_row, output)`` sees each product's inputs (for the check)."""
    h, res = x, None
    for layer in weights["layers"]:
        qkv, stream = rms_norm_linear(h, res, layer["ln1"], EPS, layer["qkv"], config=configs.get("qkv"))
        if record:
            record("qkv", (h, res, layer["ln1"]), qkv, layer["qkv"])
        attn = qkv[:, :HIDDEN]
        o = small_m_linear(attn, layer["o"], config=configs.get("o"))
        if record:
            record("o", attn, o, layer["o"])
        gu, stream2 = rms_norm_linear(o, stream, layer["ln2"], EPS, layer["gate_up"], config=configs.get("gate_up"))
        if record:
            record("gate_up", (o, stream, layer["ln2"]), gu, layer["gate_up"])
        d = silu_mul_linear(gu, layer["down"], config=configs.get("down"))
        if record:
            record("down", gu, d, layer["down"])
        h, res = d, stream2
    logits, _ = rms_norm_linear(h, res, weights["lnf"], EPS, weights["lm_head"], config=configs.get("lm_head"))
    if record:
        record("lm_head", (h, res, weights["lnf"]), logits, weights["lm_head"])
    return logits


def reference_input(name: str, inp) -> torch.Tensor:
    """The float32 input row a product multiplies, from the kernel's own inputs (independent of the kernel)."""
    if name in ("qkv", "gate_up", "lm_head"):
        x, res, nw = inp
        s = x if res is None else (x.float() + res.float()).to(x.dtype)
        s = s.float()
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
    if name == "down":
        g, u = inp.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g.to(inp.dtype)).float().to(inp.dtype).float() * u).to(inp.dtype).float()
    return inp.float()


def check_chain(weights: dict, x: torch.Tensor, configs: dict) -> float:
    """The worst error of any product against its float32 reference, relative to the output's scale."""
    worst = [0.0]

    def record(name, inp, out, w):
        ref = reference_input(name, inp) @ w.float().T
        scale = ref.abs().max().item() + 1e-6
        worst[0] = max(worst[0], (out.float() - ref).abs().max().item() / scale)

    run_chain(weights, x, configs, record)
    return worst[0]


def read_bandwidth(device, rep_ms: int, sweep: bool = False) -> tuple[float, dict]:
    """Bytes per second one product streams from a 2 GiB weight (the kernel's steady read rate), and with
    ``sweep`` the same for each candidate configuration."""
    w = torch.randn(262144, HIDDEN, device=device).to(torch.bfloat16)
    x = torch.randn(1, HIDDEN, device=device).to(torch.bfloat16)
    t = graph_bench(lambda: small_m_linear(x, w), rep_ms)
    rates = {}
    for bn, bk, warps, stages in CANDIDATES if sweep else []:
        c = SmallMLinearConfig(bn, bk, 1, warps, stages, False)
        rates[cfg_str(c)] = w.numel() * 2 / (graph_bench(lambda c=c: small_m_linear(x, w, config=c), rep_ms)[0] * 1e-6)
        print(f"  long product {cfg_str(c):<24} {rates[cfg_str(c)] / 1e12:.3f} TB/s", flush=True)
    return w.numel() * 2 / (t[0] * 1e-6), rates


def cfg_str(c: SmallMLinearConfig) -> str:
    return f"n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def candidates(name: str) -> list[SmallMLinearConfig]:
    n, k, prologue = SHAPES[name]
    no_split = prologue == PROLOGUE_RMS_NORM
    out = []
    for bn, bk, w, st in CANDIDATES:
        for s in SPLITS:
            if s > 1 and (no_split or k // s < bk):
                continue
            out.append(SmallMLinearConfig(bn, bk, s, w, st, False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sweep", action="store_true", help="time candidate configurations per projection in the chain")
    ap.add_argument("--read-sweep", action="store_true", help="time the candidates on the 2 GiB product")
    ap.add_argument("--rep", type=int, default=200, help="do_bench time budget per chain, ms")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="projections to sweep")
    args = ap.parse_args()
    t0 = time.time()
    dev, num_sms, copy_bw = cuda_setup()
    read_bw, read_sweep = read_bandwidth(dev, args.rep, args.read_sweep)
    weights = make_weights(args.layers, dev)
    nbytes = sum(w.numel() * 2 for layer in weights["layers"] for key, w in layer.items() if not key.startswith("ln"))
    nbytes += weights["lm_head"].numel() * 2
    x = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    defaults = {name: small_m_linear_config(1, n, k, num_sms, p) for name, (n, k, p) in SHAPES.items()}
    info = dict(device=torch.cuda.get_device_name(), num_sms=num_sms, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), cmd=" ".join(sys.argv),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                copy_bw_TBps=copy_bw / 1e12, read_bw_TBps=read_bw / 1e12, layers=args.layers, weight_bytes=nbytes,
                read_sweep_TBps={k: v / 1e12 for k, v in read_sweep.items()},
                defaults={k: cfg_str(v) for k, v in defaults.items()})
    print(f"# {info['device']} ({num_sms} SMs); copy {copy_bw / 1e12:.3f} TB/s, one-row product over 2 GiB "
          f"{read_bw / 1e12:.3f} TB/s; chain {args.layers} layers, {nbytes / 1e9:.2f} GB of weights")

    def measure(configs: dict) -> dict:
        err = check_chain(weights, x, configs)
        if not err < 2.0**-6:
            raise AssertionError(f"chain error {err:.3g} of the output scale with {configs}")
        t = graph_bench(lambda: run_chain(weights, x, configs), args.rep)
        return dict(us=t, err=err, TBps=nbytes / (t[0] * 1e-6) / 1e12, of_copy=nbytes / (t[0] * 1e-6) / copy_bw,
                    of_read=nbytes / (t[0] * 1e-6) / read_bw)

    base = measure({})
    print(f"default chain: {base['us'][0]:.1f} us [{base['us'][1]:.1f}-{base['us'][2]:.1f}], {base['TBps']:.3f} TB/s,"
          f" {100 * base['of_copy']:.1f}% of copy, {100 * base['of_read']:.1f}% of the long product; "
          f"floor at copy {nbytes / copy_bw * 1e6:.1f} us")
    result = dict(info=info, default=base, sweep=[], best=None)
    if args.sweep:
        best = {}
        for name in args.shapes:
            for c in candidates(name):
                try:
                    r = measure({name: c})
                except Exception as e:  # a configuration the compiler or the GPU refuses: recorded, skipped
                    result["sweep"].append(dict(shape=name, config=cfg_str(c), error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                delta = r["us"][0] - base["us"][0]
                result["sweep"].append(dict(shape=name, config=cfg_str(c), cfg=dataclasses.asdict(c), us=r["us"],
                                            delta_us=delta))
                print(f"  {name:>8} {cfg_str(c):<24} chain {r['us'][0]:8.1f} us  ({delta:+7.1f})", flush=True)
                if delta < best.get(name, (0.0, None))[0]:
                    best[name] = (delta, c)
        chosen = {name: c for name, (_, c) in best.items()}
        if chosen:
            r = measure(chosen)
            result["best"] = dict(configs={k: cfg_str(v) for k, v in chosen.items()}, **r)
            print(f"best per projection {result['best']['configs']}: {r['us'][0]:.1f} us, {r['TBps']:.3f} TB/s, "
                  f"{100 * r['of_copy']:.1f}% of copy")
        base2 = measure({})
        result["default_again"] = base2
        print(f"default again: {base2['us'][0]:.1f} us")
    with open(os.path.join(args.out, "bench_gemv_chain.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
