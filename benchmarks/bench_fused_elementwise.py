"""GPU time of one decode step's elementwise chain, unfused PyTorch vs the fused Triton kernels.

    python benchmarks/bench_fused_elementwise.py [--tokens 256] [--layers 32] [--iters 50] [--reps 5]

Shapes: Llama-3.1-8B (hidden 4096, 32 q / 8 kv heads of 128, intermediate
14336, llama3 rope), bf16. Per layer, the elementwise work around the GEMMs
and attention:

* unfused (the model before the kernels): ``x = x + mlp_out``, RMSNorm,
  rope on q and k (strided views of the qkv output), ``x = x + o_out``,
  RMSNorm, ``silu(gate) * up``;
* fused: ``fused_add_rms_norm``, ``rope_qk``, ``fused_add_rms_norm``,
  ``silu_and_mul``.

The GEMM/attention outputs are fixed random buffers. ``--layers`` copies of the
chain are captured in one CUDA graph (as the engine captures decode); the time
is the median over ``--reps`` of (CUDA-event time of ``--iters`` replays /
``--iters``). Both chains' outputs are checked against each other first.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from kvforge.kernels.triton_rms_norm import fused_add_rms_norm
    from kvforge.kernels.triton_rope import rope_qk
    from kvforge.kernels.triton_silu_mul import silu_and_mul
    from kvforge.models.layers import RMSNorm, RotaryEmbedding

    dev, dt, t = "cuda", torch.bfloat16, args.tokens
    hidden, hq, hk, d, inter = 4096, 32, 8, 128, 14336
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dt)

    norm1 = RMSNorm(hidden, 1e-5, dtype=dt, device=dev)
    norm2 = RMSNorm(hidden, 1e-5, dtype=dt, device=dev)
    with torch.no_grad():
        norm1.weight.copy_(rnd(hidden, scale=0.1) + 1)
        norm2.weight.copy_(rnd(hidden, scale=0.1) + 1)
    rotary = RotaryEmbedding(d, d, 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
    rotary = rotary.to(dev)
    positions = torch.randint(100, 1024, (t,), device=dev, generator=g)
    cos, sin = rotary.cos_sin(positions, dt)
    x0, mlp_out, o_out = rnd(t, hidden, scale=4.0), rnd(t, hidden), rnd(t, hidden)
    qkv = rnd(t, (hq + 2 * hk) * d)
    gate_up = rnd(t, 2 * inter, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)

    def unfused():
        x = x0 + mlp_out
        h1 = norm1._norm(x)
        qr, kr = rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)
        x = x + o_out
        h2 = norm2._norm(x)
        gate, up = gate_up.split(inter, dim=-1)
        return h1, qr, kr, h2, F.silu(gate) * up

    def fused():
        h1, x = fused_add_rms_norm(mlp_out, x0, norm1.weight, norm1.eps)
        qr, kr = rope_qk(q, k, cos, sin, d)
        h2, x = fused_add_rms_norm(o_out, x, norm2.weight, norm2.eps)
        return h1, qr, kr, h2, silu_and_mul(gate_up)

    with torch.inference_mode():
        for name, a, b in zip(("norm1", "q", "k", "norm2", "silu*mul"), unfused(), fused()):
            diff = (a.float() - b.float()).abs().max().item()
            exact = (a == b).float().mean().item()
            print(f"check {name:8s} max|diff| {diff:.3g}  bit-identical {exact * 100:.2f}%")
        results = {}
        for name, fn in (("unfused", unfused), ("fused", fused)):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.layers):
                    fn()
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / args.iters)
            results[name] = statistics.median(times)
            print(f"{name:8s} {results[name]:.3f} ms per {args.layers} layers "
                  f"({results[name] * 1000 / args.layers:.1f} us/layer) [min {min(times):.3f} max {max(times):.3f}]")
    print(f"speedup {results['unfused'] / results['fused']:.2f}x, saved "
          f"{results['unfused'] - results['fused']:.3f} ms per step at T={t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
