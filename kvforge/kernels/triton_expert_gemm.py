"""Triton kernel: the routed experts' products for a few rows per expert, each expert's weight read once.

The rows of a MoE step are grouped by expert (kvforge/models/expert_rows.py): sorted positions
``offs[e - 1] <= p < offs[e]`` belong to expert ``e``. For sorted position ``p`` the kernel computes
``out[p] = a[src[p]] @ weight[e].T`` with ``weight [E, N, K]`` (K contiguous, ``nn.Linear``'s layout per
expert) and ``src`` the row of ``a`` that position takes (``GATHER``: the token's input row; otherwise
``src[p] = p``, the previous product's rows in sorted order), plus the expert's bias ``bias[e]`` where one
is given. This is ``torch._grouped_mm(a[src], weight.transpose(1, 2), offs=offs)`` without the gathered
copy of ``a``. Positions from ``offs[-1]`` on (slots whose expert is held by another rank) are not
written.

In a decode step each expert has a few rows (64 tokens x top-6 over 64 experts: ~6), so the product is
bound by reading the experts' weights. Grid ``(E, cdiv(N, BLOCK_N))``: a program owns ``BLOCK_N`` weight
rows of one expert (the :class:`ExpertGemmTile`; with fewer sorted positions than experts, given each
position's expert, program ``p`` takes the expert whose rows start at position ``p``, if one does:
:func:`programs_by_position`), and for each block of 16 of the expert's rows streams them
over K in ``BLOCK_K`` chunks into ``tl.dot`` (the rows padded to 16, the MMA's smallest dimension; padded rows load zeros and
are not stored). An expert without rows costs its programs one load of ``offs``; an expert with more than
16 rows reads its weight tile once per block of 16 (the repeats may come from L2; the loads ask to be
evicted first, so under a full grid they mostly do not).

Experts that every token runs (``shared_experts``, the last ones of the weight: shared experts folded into
the stack, kvforge/models/shared_expert_fold.py) hold every token's row, so one program per weight tile
would stream its tile once per 16 tokens, one block after the other. Each of their blocks of 16 rows gets
a program of its own instead: grid ``(E - S + S * cdiv(shared_rows, 16), cdiv(N, BLOCK_N))``, the blocks of
one tile neighbours in the launch order, so that they run side by side and share the tile's reads in L2.

Numerics: bf16/fp16 products exact in float32, float32 sums (the order of the float32 additions differs
from other GEMMs), the bias added in float32, one rounding to ``a``'s dtype. The launch is a pure function
of the shapes; no host synchronization, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: Input and weight dtypes the kernel takes (one dtype for both).
DTYPES = (torch.bfloat16, torch.float16)
#: Rows per ``tl.dot`` (its smallest dimension).
ROWS = 16


@dataclass(frozen=True)
class ExpertGemmTile:
    """A program's tile: weight rows, K chunk, warps, pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


#: Whether a step with fewer sorted positions than routed experts launches a program per position
#: (:func:`programs_by_position`; module attribute, assign before CUDA-graph capture).
PROGRAMS_BY_POSITION = True
#: The tile the engine launches: the fastest of a sweep over DeepSeek-V2-Lite's decode products on an H200
#: (``benchmarks/bench_expert_gemm.py --sweep``; docs/BENCHMARKS.md, "Routed experts").
TILE = ExpertGemmTile()

if HAS_TRITON:

    @triton.jit
    def _expert_gemm_kernel(
        a_ptr, w_ptr, out_ptr, offs_ptr, src_ptr, bias_ptr, expert_ptr,
        N, K, stride_am, stride_we, stride_wn, stride_om, stride_be,
        ROUTED, ROUTED_PROGRAMS, SHARED_BLOCKS, POSITIONS,
        GATHER: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
        BY_POSITION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        pid_n = tl.program_id(1)
        # programs [0, ROUTED_PROGRAMS): the routed experts, all of one expert's row blocks in one program;
        # then SHARED_BLOCKS programs per shared expert, one row block each
        shared = pid >= ROUTED_PROGRAMS
        if BY_POSITION:  # program p: the expert whose rows start at sorted position p, if one does
            at = tl.minimum(pid, POSITIONS - 1)
            here = tl.load(expert_ptr + at).to(tl.int32)
            before = tl.load(expert_ptr + tl.maximum(at - 1, 0)).to(tl.int32)
            owns = (pid < POSITIONS) & (here < ROUTED) & ((pid == 0) | (before != here))
            routed_expert = tl.where(owns, here, 0)
        else:  # program e: expert e
            owns = pid >= 0
            routed_expert = pid
        expert = tl.where(shared, ROUTED + (pid - ROUTED_PROGRAMS) // SHARED_BLOCKS, routed_expert)
        block = tl.where(shared, (pid - ROUTED_PROGRAMS) % SHARED_BLOCKS, 0)
        block_step = tl.where(shared, SHARED_BLOCKS, 1)
        end = tl.load(offs_ptr + expert)
        start = tl.load(offs_ptr + tl.maximum(expert - 1, 0))
        start = tl.where(expert > 0, start, 0)
        end = tl.where(shared | owns, end, start)  # a position that starts no expert: no rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N load row N - 1 and are never stored
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :]
        n_mask = offs_n < N
        if HAS_BIAS:  # the expert's bias over this program's weight rows, added in float32
            bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0)
        for m0 in range(start + block * ROWS, end, block_step * ROWS):
            pos = m0 + tl.arange(0, ROWS)
            m_mask = pos < end
            if GATHER:
                src = tl.load(src_ptr + pos, mask=m_mask, other=0).to(tl.int64)
            else:
                src = pos.to(tl.int64)
            a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)  # acc[n, m] = sum_k w[n, k] * a[m, k]
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                if EVEN_K:
                    w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
                    a_mask = m_mask[:, None]
                else:
                    k_mask = (k0 + offs_k) < K
                    w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                    a_mask = m_mask[:, None] & k_mask[None, :]
                a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
                if SILU_MUL:  # a holds the gate; the up half sits K further along the row
                    g = a.to(tl.float32)
                    u = tl.load(a_ptrs + K + k0, mask=a_mask, other=0.0).to(tl.float32)
                    act = (g / (1.0 + tl.exp(-g))).to(w.dtype).to(tl.float32)  # F.silu rounds to the dtype
                    a = (act * u).to(w.dtype)
                acc = tl.dot(w, tl.trans(a), acc)
            if HAS_BIAS:
                acc += bias.to(tl.float32)[:, None]
            out_ptrs = out_ptr + pos.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def programs_by_position(positions: int, routed_experts: int) -> bool:
    """Whether the launch gives a program to each sorted position (the expert whose rows start there, if
    one does) rather than to each routed expert: where :data:`PROGRAMS_BY_POSITION` is on and the step has
    fewer positions than the weight has routed experts. A decode step of one token over 256 experts (top
    8) then launches 9 programs a weight tile, not 256 of which 248 find no rows."""
    return PROGRAMS_BY_POSITION and positions < routed_experts


def expert_gemm(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, src: torch.Tensor | None = None,
                num_rows: int | None = None, tile: ExpertGemmTile = TILE,
                bias: torch.Tensor | None = None, silu_mul: bool = False, shared_experts: int = 0,
                shared_rows: int = 0, expert: torch.Tensor | None = None) -> torch.Tensor:
    """``out [num_rows, N]``: ``out[p] = a[src[p]] @ weight[e].T (+ bias[e])`` for each sorted position ``p``
    of expert ``e`` (``offs`` int32 ``[E]``, the end of each expert's positions; ``src`` None: ``src[p] =
    p``). ``num_rows``: the positions (default ``len(src)``, or ``a``'s rows without ``src``); ``tile``: the
    launch's tile (benchmarks sweep it); ``bias``: ``[E, N]``, contiguous along N, added in float32 before
    the one rounding; ``silu_mul``: ``a`` is ``[rows, 2K]`` of ``[gate | up]`` rows and the product takes
    ``silu(gate) * up`` (exactly the values of kvforge/kernels/triton_silu_mul.py's kernel).
    ``shared_experts``: the last experts of ``weight`` hold at most ``shared_rows`` positions each (every
    token's; the module docstring says how their rows are split over programs). ``expert``: the expert id
    of each sorted position (``[num_rows]``, ascending; ids of experts held elsewhere sort last), which
    lets a step with fewer positions than routed experts launch a program per position
    (:func:`programs_by_position`); None: a program per expert."""
    if not HAS_TRITON:
        raise RuntimeError("expert_gemm needs triton")
    width = 2 * weight.shape[-1] if silu_mul else weight.shape[-1]
    if a.dim() != 2 or weight.dim() != 3 or a.shape[1] != width:
        what = "[rows, 2K] of [gate | up]" if silu_mul else "[rows, K]"
        raise ValueError(f"expert_gemm wants a {what} and weight [E, N, K], got {tuple(a.shape)} and "
                         f"{tuple(weight.shape)}")
    if a.dtype != weight.dtype or a.dtype not in DTYPES:
        raise ValueError(f"expert_gemm takes bfloat16 or float16 of one dtype, got {a.dtype} and {weight.dtype}")
    if a.stride(1) != 1 or weight.stride(2) != 1:
        raise ValueError("expert_gemm needs a and weight contiguous along K")
    if offs.shape != (weight.shape[0],):
        raise ValueError(f"offs must be [E] = [{weight.shape[0]}], got {tuple(offs.shape)}")
    e, n, k = weight.shape
    if bias is not None and (bias.shape != (e, n) or bias.stride(1) != 1):
        raise ValueError(f"bias must be [E, N] = [{e}, {n}] contiguous along N, got {tuple(bias.shape)}")
    rows = num_rows if num_rows is not None else (src.shape[0] if src is not None else a.shape[0])
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    if not 0 <= shared_experts <= e or shared_rows < 0:
        raise ValueError(f"shared_experts {shared_experts} of {e} experts, shared_rows {shared_rows}: need "
                         f"0 <= shared_experts <= E and shared_rows >= 0")
    if expert is not None and expert.shape != (rows,):
        raise ValueError(f"expert must hold one id per position, [{rows}], got {tuple(expert.shape)}")
    block_k = max(16, min(tile.block_k, triton.next_power_of_2(k)))
    shared_blocks = max(1, triton.cdiv(shared_rows, ROWS)) if shared_experts else 1
    routed = e - shared_experts
    by_position = expert is not None and programs_by_position(rows, routed)
    routed_programs = rows if by_position else routed
    _expert_gemm_kernel[(routed_programs + shared_experts * shared_blocks, triton.cdiv(n, tile.block_n))](
        a, weight, out, offs, src if src is not None else offs, bias if bias is not None else offs,
        expert if by_position else offs, n, k, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0, routed, routed_programs, shared_blocks, rows,
        GATHER=src is not None, ROWS=ROWS, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        NUM_STAGES=tile.num_stages, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BY_POSITION=by_position,
        num_warps=tile.num_warps,
    )  # fmt: skip
    return out
