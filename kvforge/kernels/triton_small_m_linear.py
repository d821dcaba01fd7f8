"""Triton kernel: ``y = x @ weight.T (+ bias)`` for a few rows of ``x``, streaming the weight once.

With ``M`` <= 16 rows (the tokens of a decode step) a linear layer is bound by reading its weight
``[N, K]`` (``nn.Linear``'s layout, K contiguous): every weight element feeds at most 16 products. The
kernel reads each weight element exactly once and multiplies it with all ``M`` rows while it is in
registers.

Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: a program owns ``BLOCK_N`` weight rows (output columns) and one
slice of K, and walks the slice in ``BLOCK_K`` chunks. Each chunk loads one ``[BLOCK_N, BLOCK_K]`` weight
tile (``evict_first``: it is never read again) and the ``[rows, BLOCK_K]`` chunk of ``x`` (``evict_last``:
every program re-reads it from L2). Two ways to multiply (``SmallMLinearConfig.use_dot``):

* broadcast (one or two rows): one row of ``x`` accumulates ``tile * x_chunk`` elementwise in a
  ``[BLOCK_N, BLOCK_K]`` float32 register tile and reduces it across threads once, after the loop; two
  rows do the same in a ``[BLOCK_N, 2, BLOCK_K]`` tile (up to ``BROADCAST_MAX_ROWS``, padded to a power
  of two), its K chunk sized so the tile holds ``BROADCAST_ACC_ELEMENTS``.
* ``tl.dot`` (more rows): ``tile @ x_chunk.T`` on tensor cores into a ``[BLOCK_N, 16]`` float32 accumulator,
  the rows of ``x`` padded to 16 (``tl.dot`` needs every dimension >= 16; padded rows load as zeros).

Weight rows past ``N`` are clamped to row ``N - 1`` for the loads (no mask along the streamed rows) and
never stored. With ``SPLIT_K`` = 1 the program adds the bias and stores ``y`` in ``x``'s dtype; with more
splits each writes float32 partials ``[SPLIT_K, M, N]`` and a second kernel adds them in split order, adds
the bias and casts (deterministic: no atomics).

One row can also be computed inside the programs from what the layer before left (``PROLOGUE``), saving
that layer's own launch: :func:`rms_norm_linear` multiplies ``RMSNorm(x + residual)`` and
:func:`silu_mul_linear` multiplies ``SiLU(gate) * up`` of a ``[gate | up]`` row. SiLU-and-mul is rounded
to the model dtype where the separate kernel rounds it. The norm is folded into the product: each
program multiplies the weight by ``norm_weight * s`` (``s = x + residual``, rounded once as torch's add;
the programs of the first row block write ``s`` out) while it sums ``s^2`` over K beside the products,
and scales its sums by ``rsqrt(mean(s^2) + eps)`` at the end (K is never split). So the normed row is
never rounded to the model dtype: the result differs from the separate norm kernel's by that rounding
(at most one unit in the last place of each element of the normed row, through the product).

Numerics: products and sums in float32 (bf16 and fp16 products are exact in float32; only the order of
the float32 additions differs from other GEMMs), the bias added in float32, one rounding to ``x``'s dtype.

The launch configuration is a pure function of ``(M, N, K, SM count)`` (:func:`small_m_linear_config`):
no autotuning, so a CUDA graph captures the launch the eager path makes. Allocations are ``torch.empty``
(the output, and the partials when split); no host synchronization: safe inside CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kvforge.attention.routing.platform import DEFAULT_NUM_SMS
from kvforge.attention.routing.split_k import SplitRule
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: The most rows of ``x`` one launch takes.
MAX_ROWS = 16
#: Up to this many rows the broadcast multiply may serve; more rows run ``tl.dot`` (rows padded to 16), and so
#: do products with at least ``num_sms // 2`` row blocks of ``DOT_BLOCK_N`` from ``WIDE_DOT_FROM_ROWS`` rows.
BROADCAST_MAX_ROWS = 2
WIDE_DOT_FROM_ROWS = 2
#: ``tl.dot`` needs every dimension >= 16: the rows of ``x`` are padded to this on the dot path.
DOT_ROWS = 16
#: Weight dtypes the kernel reads (``x`` has the same dtype).
DTYPES = (torch.bfloat16, torch.float16)

#: Broadcast path: K chunk per iteration (elements) and the range of weight rows per program (one row takes
#: the widest block that still gives ``MIN_PROGRAMS_PER_SM`` programs per SM).
BROADCAST_BLOCK_K = 512
#: Broadcast path with several rows: float32 accumulator elements per program (weight rows x rows of ``x``
#: x K chunk), which sets the K chunk (64 registers a thread at 4 warps), in blocks of
#: ``BROADCAST_ROWS_BLOCK_N`` weight rows; one row takes ``BROADCAST_BLOCK_K``.
BROADCAST_ACC_ELEMENTS = 8192
BROADCAST_BLOCK_N = (4, 16)
BROADCAST_ROWS_BLOCK_N = 8
BROADCAST_NUM_WARPS = 4
#: tl.dot path: weight rows per program (the MMA's M), warps; the K chunk and pipeline stages by the number
#: of row blocks: ``DOT_BLOCK_K`` in ``DOT_NUM_STAGES`` stages up to one block a SM, ``DOT_MANY_BLOCK_K`` in
#: ``DOT_MANY_NUM_STAGES`` beyond. Where the row blocks give fewer than ``num_sms // 2`` programs, K is split
#: into ``num_sms // programs`` slices (one wave). Measured on
#: Llama-3.1-8B's products at 2, 4 and 8 rows on an H100 and an H200 (docs/BENCHMARKS.md, "Two to eight
#: rows"): the rule chosen from the launches both cards run faster than cuBLAS.
DOT_BLOCK_N = 64
DOT_BLOCK_K = 256
DOT_NUM_STAGES = 3
DOT_MANY_BLOCK_K = 128
DOT_MANY_NUM_STAGES = 4
DOT_NUM_WARPS = 4
#: Pipeline stages of the broadcast path's K loop.
BROADCAST_NUM_STAGES = 3
#: One row under the RMSNorm prologue (K chunk, stages): the chunk's own loads of the stream, residual and
#: norm weight beside the weight tile favour a narrower chunk in a deeper pipeline.
RMS_NORM_PROLOGUE_BLOCK_K, RMS_NORM_PROLOGUE_NUM_STAGES = 256, 4
#: Programs per SM the broadcast path's row blocks aim for (narrower blocks until they do).
MIN_PROGRAMS_PER_SM = 2
#: Broadcast path: K is split where the row blocks give fewer programs than ``waves`` x SMs, into slices of at
#: least ``min_tokens`` elements of K, at most ``max_splits`` of them (SplitRule's ceil rule).
SPLIT_K_RULE = SplitRule(waves=1, min_tokens=1024, max_splits=8, round_up=True)
#: Columns per program of the split-K reduction.
REDUCE_BLOCK = 1024
#: What the kernel computes the one row of its input from (``PROLOGUE``): the row itself; ``RMSNorm(x +
#: residual)`` (or ``RMSNorm(x)``); ``SiLU(gate) * up`` of a ``[gate | up]`` row.
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class SmallMLinearConfig:
    """One launch: weight rows and K chunk per program, K slices, warps, pipeline stages, and whether the
    rows multiply on tensor cores (``use_dot``) or by broadcast."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool

    def rows_block(self, m: int) -> int:
        """The padded row count the kernel is compiled for."""
        return DOT_ROWS if self.use_dot else next_power_of_2(m)

    def k_per_split(self, k: int) -> int:
        """Elements of K per split: a multiple of ``block_k`` (the last split may be shorter)."""
        chunks = -(-k // self.block_k)
        return -(-chunks // self.split_k) * self.block_k

    def check(self, m: int) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"the tl.dot path needs block_n and block_k >= 16, got {self.block_n}, {self.block_k}")
        if not self.use_dot and self.block_k < 8:
            raise ValueError(f"the broadcast path needs block_k >= 8 (one 16-byte vector), got {self.block_k}")
        if m > MAX_ROWS:
            raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {m}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache  # a pure function of a few shapes a model repeats every step
def small_m_linear_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                          prologue: int = PROLOGUE_NONE) -> SmallMLinearConfig:  # fmt: skip
    """The launch for ``x [m, k] @ weight[n, k].T`` on a GPU with ``num_sms`` SMs, the input computed by
    ``prologue`` (one row).

    Broadcast path (one row; up to ``BROADCAST_MAX_ROWS`` rows of a product with fewer than ``num_sms // 2``
    blocks of ``DOT_BLOCK_N`` weight rows, or below ``WIDE_DOT_FROM_ROWS`` rows): one row takes the widest ``block_n`` in
    ``BROADCAST_BLOCK_N`` that still gives ``MIN_PROGRAMS_PER_SM`` programs per SM and a ``BROADCAST_BLOCK_K``
    chunk (``RMS_NORM_PROLOGUE_BLOCK_K`` under the RMSNorm prologue); several rows take
    ``BROADCAST_ROWS_BLOCK_N`` and the K chunk that fills ``BROADCAST_ACC_ELEMENTS``; K is split
    (``SPLIT_K_RULE``) only where the row blocks do not fill the SMs once, and never under the RMSNorm
    prologue, whose 1 / rms scales whole sums over K. tl.dot path (the rest): the constants' rule above.
    """
    dot_blocks = -(-n // DOT_BLOCK_N)
    use_dot = m > BROADCAST_MAX_ROWS or (m >= max(2, WIDE_DOT_FROM_ROWS) and dot_blocks >= num_sms // 2)
    if use_dot:
        block_n, num_warps = DOT_BLOCK_N, DOT_NUM_WARPS
        widest, num_stages = ((DOT_MANY_BLOCK_K, DOT_MANY_NUM_STAGES) if dot_blocks > num_sms
                              else (DOT_BLOCK_K, DOT_NUM_STAGES))
        # Small K (tests, tiny models): one chunk covers it, at least an MMA's K wide.
        block_k = max(16, min(widest, next_power_of_2(k)))
        few = dot_blocks < num_sms // 2
        split_k = max(1, min(num_sms // dot_blocks, k // SPLIT_K_RULE.min_tokens)) if few else 1
        return SmallMLinearConfig(block_n, block_k, split_k, num_warps, num_stages, use_dot)
    lo, hi = BROADCAST_BLOCK_N
    num_warps, num_stages = BROADCAST_NUM_WARPS, BROADCAST_NUM_STAGES
    if m == 1:
        target = MIN_PROGRAMS_PER_SM * num_sms
        block_n = hi
        while block_n > lo and -(-n // block_n) < target:
            block_n //= 2
        widest = BROADCAST_BLOCK_K
    else:
        block_n = BROADCAST_ROWS_BLOCK_N
        widest = BROADCAST_ACC_ELEMENTS // (block_n * next_power_of_2(m))
    if prologue == PROLOGUE_RMS_NORM:
        widest, num_stages = RMS_NORM_PROLOGUE_BLOCK_K, RMS_NORM_PROLOGUE_NUM_STAGES
    # Small K (tests, tiny models): one chunk covers it, at least one 16-byte vector wide.
    block_k = max(8, min(widest, next_power_of_2(k)))
    programs = -(-n // block_n)
    split_k = 1 if prologue == PROLOGUE_RMS_NORM else SPLIT_K_RULE.splits(programs, k, num_sms)
    return SmallMLinearConfig(block_n, block_k, split_k, num_warps, num_stages, use_dot)


if HAS_TRITON:
    _RMS_NORM = tl.constexpr(PROLOGUE_RMS_NORM)
    _SILU_MUL = tl.constexpr(PROLOGUE_SILU_MUL)

    @triton.jit
    def _one_row_chunk(
        x_ptr, res_ptr, norm_w_ptr, offs, mask, K,
        EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        """``(h, s)``: elements ``offs`` of the one input row ``h`` with the prologue applied, and (RMSNorm
        prologue) of the stream ``s = x + residual`` (rounded once to the dtype, as torch's add). SiLU-and-mul
        rounds as the separate kernel does (kvforge/kernels/triton_silu_mul.py); the RMSNorm prologue gives
        ``norm_weight * s`` in float32, to be scaled by 1 / rms after the products."""
        in_ty = x_ptr.dtype.element_ty
        if EVEN_K:
            x = tl.load(x_ptr + offs, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
        s = x
        if PROLOGUE == _RMS_NORM:
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
                s = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
            nw = tl.load(norm_w_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            x = nw * s.to(tl.float32)
        elif PROLOGUE == _SILU_MUL:  # x_ptr is the row [gate | up], K wide each
            g = x.to(tl.float32)
            u = tl.load(x_ptr + K + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(in_ty).to(tl.float32)  # F.silu rounds to the model dtype
            x = (act * u).to(in_ty)
        return x, s

    @triton.jit
    def _small_m_linear_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, res_ptr, norm_w_ptr, stream_ptr, eps,
        M, N, K, stride_xm, stride_wn, stride_om, k_per_split, chunks_per_split,
        M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_PARTIALS: tl.constexpr,
        NUM_STAGES: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        # RMSNorm prologue: the products take weight * s unscaled and the row's sum of squares accumulates
        # beside them; 1 / rms scales the sums once at the end (one K slice: the wrapper never splits K).
        squares = tl.zeros([BLOCK_K if PROLOGUE == _RMS_NORM else 1], dtype=tl.float32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N load row N - 1 and are never stored
        offs_m = tl.arange(0, M_PAD)
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        k_start = pid_k * k_per_split
        # acc[n, m] = sum_k w[n, k] * x[m, k]; acc1 (one row of x): the products summed elementwise over the
        # chunks, reduced across threads once after the loop.
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K if (M_PAD == 1 and not USE_DOT) else 1], dtype=tl.float32)
        # More rows by broadcast: the products of every row summed elementwise over the chunks, reduced once.
        acc3 = tl.zeros([BLOCK_N, M_PAD if (M_PAD > 1 and not USE_DOT) else 1,
                         BLOCK_K if (M_PAD > 1 and not USE_DOT) else 1], dtype=tl.float32)
        for i in tl.range(0, chunks_per_split, num_stages=NUM_STAGES):
            k0 = k_start + i * BLOCK_K
            k_mask = (k0 + offs_k) < K  # the slice's own end is a whole number of chunks: only K bounds it
            if EVEN_K:
                w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            if USE_DOT:
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :]
                x_mask = (offs_m < M)[:, None]
                if not EVEN_K:
                    x_mask = x_mask & k_mask[None, :]
                x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last")
                acc = tl.dot(w, tl.trans(x), acc)
            elif M_PAD == 1:
                x0, stream = _one_row_chunk(x_ptr, res_ptr, norm_w_ptr, k0 + offs_k, k_mask, K,
                                            EVEN_K, PROLOGUE, HAS_RESIDUAL)  # fmt: skip
                if PROLOGUE == _RMS_NORM:
                    if HAS_RESIDUAL and pid_n == 0:
                        tl.store(stream_ptr + k0 + offs_k, stream, mask=k_mask)
                    squares += stream.to(tl.float32) * stream.to(tl.float32)
                acc1 += w.to(tl.float32) * x0.to(tl.float32)[None, :]
            else:
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :]
                x_mask = (offs_m < M)[:, None]
                if not EVEN_K:
                    x_mask = x_mask & k_mask[None, :]
                x = tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_last")  # [M_PAD, BLOCK_K]
                acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        if M_PAD == 1 and not USE_DOT:
            acc = tl.sum(acc1, axis=1)[:, None]
            if PROLOGUE == _RMS_NORM:
                acc *= tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
        elif not USE_DOT:
            acc = tl.sum(acc3, axis=2)
        n_mask = offs_n < N
        mask = n_mask[:, None] & (offs_m < M)[None, :]
        if WRITE_PARTIALS:
            part_ptrs = part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
            tl.store(part_ptrs, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_splits_kernel(
        part_ptr, bias_ptr, out_ptr, M, N, stride_om,
        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        m = tl.program_id(1)
        offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        n_mask = offs_n < N
        y = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # split order: the same sum on every run
            y += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"small_m_linear wants x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but weight {tuple(weight.shape)} takes {weight.shape[1]}")
    if weight.dtype not in DTYPES or x.dtype != weight.dtype:
        raise ValueError(f"small_m_linear takes bfloat16 or float16 x and weight of one dtype, got {x.dtype} "
                         f"and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("small_m_linear needs x and weight contiguous along K (the nn.Linear layout)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector, got {tuple(bias.shape)}")


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: SmallMLinearConfig | None = None, num_sms: int = DEFAULT_NUM_SMS,
) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``M <= MAX_ROWS``: ``[M, N]`` in ``x``'s dtype.

    ``config`` overrides :func:`small_m_linear_config` (benchmarks sweep it); ``num_sms`` is the SM count
    that function plans for (the caller knows its device).
    """
    _check(x, weight, bias)
    return _launch(x, weight, bias, config, num_sms, PROLOGUE_NONE, x.shape[1])


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, config: SmallMLinearConfig | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(F.linear(h, weight, bias), s)`` for one row: ``s = x + residual`` (``x`` without a residual) and
    ``h = RMSNorm(s)`` with ``norm_weight`` and ``eps``, folded into the product (module docstring: ``h`` is
    not rounded to the dtype); ``s`` is a new tensor (``x`` itself without a residual). One launch where the
    separate kernels take two. ``config`` must take the broadcast path (one row); its K is never split."""
    _check(x, weight, bias)
    if x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"rms_norm_linear takes one contiguous row, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):  # fmt: skip
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"norm weight must be a contiguous [{x.shape[1]}] vector of x's dtype, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    stream = torch.empty_like(x) if residual is not None else x
    out = _launch(x, weight, bias, config, num_sms, PROLOGUE_RMS_NORM, x.shape[1],
                  residual=residual, norm_weight=norm_weight, eps=eps, stream=stream)  # fmt: skip
    return out, stream


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: SmallMLinearConfig | None = None, num_sms: int = DEFAULT_NUM_SMS,
) -> torch.Tensor:  # fmt: skip
    """``F.linear(F.silu(gate) * up, weight, bias)`` for one row ``gate_up = [gate | up]`` (``[1, 2K]``),
    the product's input computed inside its programs, rounded as the separate kernel rounds it
    (kvforge/kernels/triton_silu_mul.py)."""
    if gate_up.dim() != 2 or gate_up.shape[0] != 1 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul_linear takes one contiguous row [gate | up], got {tuple(gate_up.shape)}")
    k = gate_up.shape[1] // 2
    _check(gate_up[:, :k], weight, bias)
    return _launch(gate_up, weight, bias, config, num_sms, PROLOGUE_SILU_MUL, k)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SmallMLinearConfig | None,
    num_sms: int, prologue: int, k: int, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, stream: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    if not HAS_TRITON:
        raise RuntimeError("small_m_linear needs triton")
    m = x.shape[0]
    n = weight.shape[0]
    cfg = config or small_m_linear_config(m, n, k, num_sms, prologue)
    if prologue == PROLOGUE_RMS_NORM and cfg.split_k != 1:
        cfg = dataclasses.replace(cfg, split_k=1)  # 1 / rms scales whole sums over K
    cfg.check(m)
    if prologue != PROLOGUE_NONE and cfg.use_dot:
        raise ValueError("a prologue runs on the broadcast path only (one row); the config asks for tl.dot")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    k_per_split = cfg.k_per_split(k)
    split_k = -(-k // k_per_split)  # no empty split
    chunks = -(-k // cfg.block_k)
    chunks_per_split = k_per_split // cfg.block_k
    # Every chunk of every split lies inside K: the loads need no K mask.
    even_k = k % cfg.block_k == 0 and chunks % chunks_per_split == 0
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _small_m_linear_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, bias_arg, out, partials,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        stream if stream is not None else x, float(eps),
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split, chunks_per_split,
        M_PAD=cfg.rows_block(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot, EVEN_K=even_k, HAS_BIAS=bias is not None,
        WRITE_PARTIALS=split_k > 1, NUM_STAGES=cfg.num_stages,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            partials, bias_arg, out, m, n, out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4,
        )  # fmt: skip
    return out
