"""Split-K for the decode products at 64-256 rows: does slicing K fill the SMs better than cuBLAS alone?

    PYTHONUNBUFFERED=1 python benchmarks/bench_split_k_gemm.py [--rows 64 128 256] [--shapes qkv o ...]

Products ``x [rows, K] @ weight[N, K].T`` in bf16: Llama-3.1-8B's (qkv 6144 x 4096, o 4096 x 4096, gate_up
28672 x 4096, down 4096 x 14336, LM head 128256 x 4096) and DeepSeek-V2-Lite's dense ones (the fused query
and latent input projection 3648 x 2048, o 2048 x 2048, the shared experts' gate_up 5632 x 2048 and down
2048 x 2816). Three ways, each timed as a CUDA-graph replay with L2 cleared (``gpu_timing.graph_bench``):

* ``cublas``: ``F.linear``;
* ``cublas split``: K cut into S slices as one strided-batched cuBLAS product with float32 output
  (``torch.bmm(..., out_dtype=torch.float32)`` over a strided view of the weight), then the small-M
  kernel's split sum (kvforge/kernels/triton_small_m_linear.py) adds the slices in order and rounds once;
  the fastest S of 1, 2, 3, 4, 6, 8 whose slices are whole 64-wide chunks;
* ``tma split``: a Triton ``tl.dot`` kernel fed by TMA descriptors, the weight rows on the MMA's M and the
  rows of ``x`` (padded to a power of two) on its N, each program one K slice writing float32 partials
  summed by the same kernel (a direct store at S = 1); the fastest of 64-128 weight rows, 64-128 of K, 4
  or 6 stages, 4 or 8 warps and S = 1, 2, 4, 8.

Every result is first checked against a float32 product (max error under 1% of the largest output).
Prints us per product: the floor (weight bytes at the copy bandwidth measured in the same run), then each
way's best and its setting. About a minute on one H200 (compiles included).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kvforge.kernels.triton_small_m_linear import REDUCE_BLOCK, _sum_splits_kernel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "ds_q_latent": (3648, 2048), "ds_o": (2048, 2048),
          "ds_shared_gate_up": (5632, 2048), "ds_shared_down": (2048, 2816)}
BLAS_SPLITS = (2, 3, 4, 6, 8)
#: (weight rows, warps), K chunk, stages, K slices of the TMA kernel's sweep.
TMA_TILES = ((64, 4), (128, 4), (128, 8))
TMA_BLOCK_K = (64, 128)
TMA_STAGES = (4, 6)
TMA_SPLITS = (1, 2, 4, 8)
SMEM_LIMIT = 220_000


def sum_slices(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s, m, n = part.shape
    _sum_splits_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](part, out, out, m, n, out.stride(0), SPLIT_K=s,
                                                         HAS_BIAS=False, BLOCK=REDUCE_BLOCK, num_warps=4)
    return out


def blas_split(x: torch.Tensor, w: torch.Tensor, s: int, part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    ks = k // s
    torch.bmm(x.view(m, s, ks).transpose(0, 1), w.as_strided((s, ks, w.shape[0]), (ks, 1, k)),
              out_dtype=torch.float32, out=part)
    return sum_slices(part, out)


@triton.jit
def _tma_kernel(x_desc, w_desc, out_ptr, part_ptr, M, N, stride_om, k_per_split,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                PARTIALS: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_start + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        acc = tl.dot(w_desc.load([n0, k0]), x_desc.load([0, k0]).T, acc)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if PARTIALS:
        tl.store(part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_split(x, w, block_n, block_k, stages, warps, s, part, out, x_desc, w_desc):
    m, k = x.shape
    n = w.shape[0]
    _tma_kernel[(triton.cdiv(n, block_n), s)](x_desc, w_desc, out, part, m, n, out.stride(0), k // s,
                                              BLOCK_M=x_desc.block_shape[0], BLOCK_N=block_n, BLOCK_K=block_k,
                                              NUM_STAGES=stages, PARTIALS=s > 1, num_warps=warps)
    if s > 1:
        sum_slices(part, out)
    return out


def timed_if_correct(fn, ref: torch.Tensor, rep: int) -> float | None:
    """us of ``fn``'s graph replay, or None if it fails or misses the float32 product by 1% of its max."""
    try:
        err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
        if not err < 1e-2:
            print(f"  wrong result: error {err:.3g}", flush=True)
            return None
        return graph_bench(fn, rep)[0]
    except Exception as e:  # a configuration the compiler or cuBLAS refuses
        print(f"  failed: {repr(e)[:160]}", flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print("product | rows | floor us | cublas | cublas split (S) | tma split (rows, K chunk, stages, warps, S)")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ w.float().T
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            cublas = timed_if_correct(functools.partial(F.linear, x, w), ref, 10)
            if cublas is None:
                print(f"{name} | {m} | cuBLAS failed, row skipped", flush=True)
                continue
            blas = (cublas, 1)
            for s in BLAS_SPLITS:
                if k % s or (k // s) % 64:
                    continue
                part = torch.empty(s, m, n, dtype=torch.float32, device="cuda")
                t = timed_if_correct(functools.partial(blas_split, x, w, s, part, out), ref, 10)
                if t is not None and t < blas[0]:
                    blas = (t, s)
            block_m = max(16, triton.next_power_of_2(m))
            tma = (float("inf"), None)
            for (block_n, warps), block_k, stages, s in itertools.product(TMA_TILES, TMA_BLOCK_K, TMA_STAGES,
                                                                         TMA_SPLITS):
                if k % s or (k // s) % block_k or stages * (block_n + block_m) * block_k * 2 > SMEM_LIMIT:
                    continue
                part = torch.empty(s, m, n, dtype=torch.float32, device="cuda")
                fn = functools.partial(tma_split, x, w, block_n, block_k, stages, warps, s, part, out,
                                       TensorDescriptor.from_tensor(x, [block_m, block_k]),
                                       TensorDescriptor.from_tensor(w, [block_n, block_k]))
                t = timed_if_correct(fn, ref, 5)
                if t is not None and t < tma[0]:
                    tma = (t, (block_n, block_k, stages, warps, s))
            print(f"{name} | {m} | {n * k * 2 / bw * 1e6:.1f} | {cublas:.1f} | {blas[0]:.1f} ({blas[1]}) | "
                  f"{tma[0]:.1f} {tma[1]}", flush=True)


if __name__ == "__main__":
    main()
