"""How the precision of the chunked delta rule's matrix products moves its states and outputs, on the CPU.

    python benchmarks/delta_rule_product_precision.py [--lengths 1024 4096 16384] [--heads 4]

The chunked form of kvforge/kernels/triton_gated_delta_rule.py, written again here in PyTorch over chunks
of 16 (its per-chunk system, then the state pass: ``U - W S``, the outputs ``(q exp(G)) S + (q k^T) U`` and
the state at the chunk's end), with every matrix product's operands rounded as the GPU's matrix units would
take them and float32 accumulation:

* ``float32``: no rounding (the kernel's tf32x3 products keep about 22 significant bits of each operand);
* ``tf32``: each operand rounded to nearest at 11 significant bits, ties away from zero (one tf32 product, as
  the kernel's "tf32-nearest" form takes them); ``tf32 cut``: the bits past them dropped instead (rounded
  toward zero);
* ``bf16``: each operand rounded to 8 significant bits (products on operands in the model dtype, as
  flash-linear-attention's chunked kernels multiply the state chain).

Each is compared with the rule token by token in float64 from the same bf16 inputs (relative L2 of the
final states and of all outputs). Two yardsticks beside them: ``bf16 inputs``, how far that float64 rule
itself moves when ``q``, ``k`` and ``v`` are rounded to bf16 (the model's own rounding of its projections:
the rule on the unrounded float64 values against the rounded ones), and ``bf16 outputs``, the rounding of the
outputs a bf16 model stores (its states are kept in float32). Gates: ``fast`` log decays uniform in [-1, 0] (the kernel bench's);
``slow`` in [-0.01, 0] and ``still`` in [-0.0001, 0] (heads that remember hundreds to tens of thousands of
tokens, where rounding errors decay slowly).
"""

from __future__ import annotations

import argparse

import torch

CHUNK = 16
MODES = ("float32", "tf32", "tf32 cut", "bf16")
GATES = {"fast": 1.0, "slow": 0.01, "still": 0.0001}


def rounded(x: torch.Tensor, mode: str) -> torch.Tensor:
    """``x`` (float32) with its significand rounded as ``mode``'s operands hold it: to nearest even for bf16, to
    nearest with ties away from zero for tf32 (as the kernel's "tf32-nearest" form rounds), dropped for tf32
    cut."""
    if mode == "float32":
        return x
    if mode == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    bits = x.contiguous().view(torch.int32)
    drop = 13  # float32 keeps 23 fraction bits, tf32 10
    if mode == "tf32":
        bits = bits + (1 << (drop - 1))  # half the dropped bits' range: ties away from zero
    return (bits & ~((1 << drop) - 1)).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    return torch.matmul(rounded(a, mode), rounded(b, mode))


def inputs(tokens: int, heads: int, dim: int, gate_scale: float, seed: int):
    """q, k (L2-normalised, q scaled), v, g, beta as float64 tensors: once from q, k and v rounded to bf16 (the
    model's inputs, normalised after the rounding), once from the same draws unrounded."""
    gen = torch.Generator().manual_seed(seed)
    raw_q, raw_k, raw_v = (torch.randn(heads, tokens, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -gate_scale * torch.rand(heads, tokens, generator=gen, dtype=torch.float64)
    beta = torch.rand(heads, tokens, generator=gen, dtype=torch.float64)

    def prepared(round_bf16: bool):
        q, k, v = ((x.to(torch.bfloat16).to(torch.float64) if round_bf16 else x) for x in (raw_q, raw_k, raw_v))
        return q / q.norm(dim=-1, keepdim=True) * dim**-0.5, k / k.norm(dim=-1, keepdim=True), v, g, beta

    return prepared(True), prepared(False)


def token_by_token(q, k, v, g, beta):
    """The rule's definition in float64: outputs [H, T, V] and the final state [H, K, V]."""
    heads, tokens, dim = q.shape
    s = torch.zeros(heads, dim, v.shape[-1], dtype=torch.float64)
    out = torch.empty_like(v)
    for t in range(tokens):
        s = s * g[:, t].exp()[:, None, None]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hk,hkv->hv", k[:, t], s))
        s = s + k[:, t, :, None] * u[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], s)
    return out, s


def chunked(q, k, v, g, beta, mode: str):
    """The kernel's chunked form with ``mode``'s products, in float32."""
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    heads, tokens, dim = q.shape
    s = torch.zeros(heads, dim, v.shape[-1])
    out = torch.empty_like(v)
    rows = torch.arange(CHUNK)
    for c0 in range(0, tokens, CHUNK):
        span = slice(c0, min(c0 + CHUNK, tokens))
        n = span.stop - span.start
        qc, kc, vc, gc, bc = q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span]
        lower = (rows[:n, None] >= rows[None, :n]).float()
        strict = (rows[:n, None] > rows[None, :n]).float()
        cum = gc.cumsum(-1)  # [H, n]: the decay from the chunk's start through each row
        decay = torch.exp((cum[:, :, None] - cum[:, None, :]) * lower) * lower  # rows j <= r
        a = bc[:, :, None] * product(kc, kc.transpose(1, 2), mode) * decay * strict
        inv = torch.linalg.solve_triangular(torch.eye(n) + a, torch.eye(n).expand(heads, n, n), upper=False,
                                            unitriangular=True)
        w = product(inv, bc[:, :, None] * cum.exp()[:, :, None] * kc, mode)
        u0 = product(inv, bc[:, :, None] * vc, mode)
        aqk = product(qc, kc.transpose(1, 2), mode) * decay
        u = u0 - product(w, s, mode)
        out[:, span] = product(qc * cum.exp()[:, :, None], s, mode) + product(aqk, u, mode)
        k_end = kc * torch.exp(cum[:, -1:] - cum)[:, :, None]
        s = cum[:, -1].exp()[:, None, None] * s + product(k_end.transpose(1, 2), u, mode)
    return out, s


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    print(f"relative L2 against float64 token by token ({args.heads} heads, K = V = {args.dim}; "
          "states / outputs)")
    columns = (*MODES, "bf16 inputs", "bf16 outputs")
    print(f"{'gates':6s} {'tokens':>7s}  " + "  ".join(f"{m:>19s}" for m in columns), flush=True)
    for name, scale in GATES.items():
        for tokens in args.lengths:
            rounded_inputs, raw_inputs = inputs(tokens, args.heads, args.dim, scale, seed=tokens)
            want_out, want_state = token_by_token(*rounded_inputs)
            cells = []
            for mode in MODES:
                out, state = chunked(*rounded_inputs, mode)
                cells.append(f"{relative(state, want_state):.1e} / {relative(out, want_out):.1e}")
            raw_out, raw_state = token_by_token(*raw_inputs)
            cells.append(f"{relative(want_state, raw_state):.1e} / {relative(want_out, raw_out):.1e}")
            cells.append(f"{'-':>7s} / {relative(want_out.to(torch.bfloat16), want_out):.1e}")
            print(f"{name:6s} {tokens:7d}  " + "  ".join(f"{c:>19s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
