"""Triton kernels: a MoE step's routed rows grouped by expert, and their weighted sum back per token.

The same two operations as the PyTorch code of kvforge/models/expert_rows.py (the reference), each in one
launch where PyTorch takes about ten (a cast, a radix sort of several passes, a count, a cumulative sum,
gathers) and five (an un-permuting copy, casts, a batched product).

:func:`group_rows`: one program reads the ``R`` flat expert ids and sorts the keys ``id * R_PAD + row``
(``tl.sort``, in registers): the sorted keys give each position's row and expert at once, in the stable
order (by expert, then by row) that ``torch.argsort(..., stable=True)`` gives. The expert counts are a
``tl.histogram`` of the ids and their cumulative sum is ``offs``. It also writes ``inverse``, the sorted
position of every flat row, which the sum below reads. Rows held elsewhere carry the id ``num_experts``
and sort last; padding lanes (``row >= R``) sort after them and are never stored. Keys are int32:
``(num_experts + 1) * R_PAD < 2**31`` is checked by the wrapper.

Past :data:`ONE_PROGRAM_MAX_ROWS` rows one program's sort is the slow part (a bitonic network over every
lane in one SM), and :func:`group_rows` counts instead, in two launches over chunks of
:data:`CHUNK_ROWS` rows: ``_count_chunks_kernel`` writes each chunk's expert histogram; in
``_place_rows_kernel`` each chunk's program sums those histograms (every chunk's, for the experts' starts;
the chunks before its own, for where its rows go inside each expert's range), sorts its own chunk by
(expert, row) and stores every row at ``start[e] + rows of e in earlier chunks + its rank among its chunk's
rows of e``: the same stable order, as one counting sort.

:func:`combine_rows`: program ``(t, n-block)`` adds ``weights[t, j] * y[inverse[t * k + j]]`` over the
token's ``k`` slots in float32, in slot order, and rounds once to ``y``'s dtype. A slot that is not held
(``held[t, j]`` false) loads nothing from ``y`` (its row was never computed and may hold anything). The
reference's batched float32 product may add in another order, so the two agree to float32 summation error
before the one rounding, not bit for bit.

No host synchronization and only ``torch.empty``: both can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: The most rows :func:`group_rows` sorts in its one program.
MAX_ROWS = 4096
#: The fewest lanes it sorts (the rows padded up to a power of two, at least this): every width is its own
#: compiled kernel, a few seconds of compile each on first use or at CUDA-graph capture (measured 1.9-5.3 s
#: for sm_90 on a 2-core CPU), so decode batches of 1 to 256 tokens share 5 widths rather than 9.
MIN_SORT_WIDTH = 128
#: The most rows the one-program sort takes; more are grouped by the two-launch counting sort.
ONE_PROGRAM_MAX_ROWS = 512
#: Rows a program of the counting sort sorts and places.
CHUNK_ROWS = 256
#: The most rows the counting sort takes: each placing program sums every chunk's histogram.
COUNTING_MAX_ROWS = 16384
#: Hidden features per program of :func:`combine_rows`.
COMBINE_BLOCK = 1024

if HAS_TRITON:

    @triton.jit(do_not_specialize=["R"])
    def _group_rows_kernel(
        ids_ptr, order_ptr, expert_ptr, tokens_ptr, inverse_ptr, offs_ptr,
        R, NUM_EXPERTS, TOP_K, R_PAD: tl.constexpr, E_PAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.arange(0, R_PAD)
        in_range = row < R
        ids = tl.load(ids_ptr + row, mask=in_range, other=NUM_EXPERTS).to(tl.int32)
        keys = tl.sort(ids * R_PAD + row)  # padding lanes: id NUM_EXPERTS and row >= R, so last of all
        pos = tl.arange(0, R_PAD)
        src = keys % R_PAD
        tl.store(order_ptr + pos, src.to(tl.int64), mask=in_range)
        tl.store(expert_ptr + pos, (keys // R_PAD).to(expert_ptr.dtype.element_ty), mask=in_range)
        tl.store(tokens_ptr + pos, (src // TOP_K).to(tl.int64), mask=in_range)
        tl.store(inverse_ptr + src, pos.to(tl.int64), mask=in_range)
        counts = tl.histogram(ids, E_PAD, mask=in_range)
        ends = tl.cumsum(counts, 0)
        e = tl.arange(0, E_PAD)
        tl.store(offs_ptr + e, ends.to(tl.int32), mask=e < NUM_EXPERTS)

    @triton.jit(do_not_specialize=["R"])
    def _count_chunks_kernel(ids_ptr, counts_ptr, R, NUM_EXPERTS, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
        c = tl.program_id(0)
        row = c * CHUNK + tl.arange(0, CHUNK)
        in_range = row < R
        ids = tl.load(ids_ptr + row, mask=in_range, other=NUM_EXPERTS).to(tl.int32)
        tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD, mask=in_range))

    @triton.jit(do_not_specialize=["R", "NUM_CHUNKS"])
    def _place_rows_kernel(
        ids_ptr, counts_ptr, order_ptr, expert_ptr, tokens_ptr, inverse_ptr, offs_ptr,
        R, NUM_EXPERTS, TOP_K, NUM_CHUNKS, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        total = tl.zeros([E_PAD], dtype=tl.int32)
        earlier = tl.zeros([E_PAD], dtype=tl.int32)  # rows of each expert in the chunks before this one
        cc = 0
        while cc < NUM_CHUNKS:  # a run-time bound: one compiled kernel for every chunk count
            n = tl.load(counts_ptr + cc * E_PAD + e)
            total += n
            earlier += tl.where(cc < c, n, 0)
            cc += 1
        ends = tl.cumsum(total, 0)
        if c == 0:
            tl.store(offs_ptr + e, ends, mask=e < NUM_EXPERTS)
        lane = tl.arange(0, CHUNK)
        in_range = c * CHUNK + lane < R
        ids = tl.load(ids_ptr + c * CHUNK + lane, mask=in_range, other=NUM_EXPERTS).to(tl.int32)
        mine = tl.histogram(ids, E_PAD, mask=in_range)
        # sorted lane p of expert x goes to ends[x] - total[x] + earlier[x] + (p - first lane of x here)
        shift = ends - total + earlier - (tl.cumsum(mine, 0) - mine)
        keys = tl.sort(ids * CHUNK + lane)  # padding lanes (id NUM_EXPERTS, the last lanes) sort last
        sorted_ids = keys // CHUNK
        src = c * CHUNK + keys % CHUNK
        pos = tl.gather(shift, sorted_ids, 0) + lane
        valid = src < R
        tl.store(order_ptr + pos, src.to(tl.int64), mask=valid)
        tl.store(expert_ptr + pos, sorted_ids.to(expert_ptr.dtype.element_ty), mask=valid)
        tl.store(tokens_ptr + pos, (src // TOP_K).to(tl.int64), mask=valid)
        tl.store(inverse_ptr + src, pos.to(tl.int64), mask=valid)

    @triton.jit
    def _combine_rows_kernel(
        y_ptr, inverse_ptr, w_ptr, held_ptr, add_ptr, out_ptr, N, stride_y, stride_w, stride_add, stride_out,
        TOP_K: tl.constexpr, HAS_HELD: tl.constexpr, HAS_ADDEND: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        n_mask = n < N
        if HAS_ADDEND:
            acc = tl.load(add_ptr + t * stride_add + n, mask=n_mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = tl.load(inverse_ptr + t * TOP_K + j)
            w = tl.load(w_ptr + t * stride_w + j).to(tl.float32)
            if HAS_HELD:
                held = tl.load(held_ptr + t * TOP_K + j) != 0
                row = tl.load(y_ptr + p * stride_y + n, mask=n_mask & held, other=0.0)
                w = tl.where(held, w, 0.0)
            else:
                row = tl.load(y_ptr + p * stride_y + n, mask=n_mask, other=0.0)
            acc += w * row.to(tl.float32)
        tl.store(out_ptr + t * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def _sort_width(rows: int, counting: bool) -> int:
    """Lanes one program sorts: a chunk for the counting sort, else every row padded to a power of two (at
    least :data:`MIN_SORT_WIDTH`). Sort keys reach ``(num_experts + 1) * width``."""
    return CHUNK_ROWS if counting else max(MIN_SORT_WIDTH, 1 << (rows - 1).bit_length())


def sorts(rows: int, num_experts: int) -> bool:
    """Whether :func:`group_rows` (by its own choice of sort) takes ``rows`` rows over ``num_experts``
    experts: at most :data:`COUNTING_MAX_ROWS`, and sort keys within int32."""
    if not 0 < rows <= COUNTING_MAX_ROWS:
        return False
    return (num_experts + 1) * _sort_width(rows, rows > ONE_PROGRAM_MAX_ROWS) < 2**31


def group_rows(flat_ids: torch.Tensor, num_experts: int, top_k: int, *, counting: bool | None = None):
    """``(order, offs, expert, tokens, inverse)`` of the ``R`` rows of ``flat_ids`` (see the module
    docstring): int64 ``order``, ``tokens`` and ``inverse`` ``[R]``, int32 ``offs [num_experts]``,
    ``expert [R]`` in ``flat_ids``' dtype. ``counting``: the counting sort (True) or the one-program sort
    (False); None takes the counting sort past :data:`ONE_PROGRAM_MAX_ROWS` rows."""
    if not HAS_TRITON:
        raise RuntimeError("group_rows needs triton")
    if flat_ids.dim() != 1 or flat_ids.is_floating_point():
        raise ValueError(f"flat_ids must be a 1-d integer tensor, got {flat_ids.dtype} {tuple(flat_ids.shape)}")
    r = flat_ids.shape[0]
    if counting is None:
        counting = r > ONE_PROGRAM_MAX_ROWS
    most = COUNTING_MAX_ROWS if counting else MAX_ROWS
    if not 0 < r <= most:
        how = "the counting sort" if counting else "one program"
        raise ValueError(f"group_rows sorts 1 to {most} rows with {how}, got {r}")
    width = _sort_width(r, counting)
    if (num_experts + 1) * width >= 2**31:
        raise ValueError(f"{num_experts} experts x {width} rows overflow the int32 sort keys")
    dev = flat_ids.device
    order = torch.empty(r, dtype=torch.int64, device=dev)
    expert = torch.empty(r, dtype=flat_ids.dtype, device=dev)
    tokens = torch.empty(r, dtype=torch.int64, device=dev)
    inverse = torch.empty(r, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts + 1)
    if counting:
        chunks = triton.cdiv(r, CHUNK_ROWS)
        counts = torch.empty((chunks, e_pad), dtype=torch.int32, device=dev)
        _count_chunks_kernel[(chunks,)](flat_ids, counts, r, num_experts, CHUNK=CHUNK_ROWS, E_PAD=e_pad, num_warps=4)
        _place_rows_kernel[(chunks,)](
            flat_ids, counts, order, expert, tokens, inverse, offs, r, num_experts, top_k, chunks,
            CHUNK=CHUNK_ROWS, E_PAD=e_pad, num_warps=4,
        )  # fmt: skip
        return order, offs, expert, tokens, inverse
    _group_rows_kernel[(1,)](
        flat_ids, order, expert, tokens, inverse, offs, r, num_experts, top_k,
        R_PAD=width, E_PAD=e_pad, num_warps=8 if width >= 1024 else 4,
    )  # fmt: skip
    return order, offs, expert, tokens, inverse


def combine_rows(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
                 held: torch.Tensor | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = addend[t] + sum_j weights[t, j] * y[inverse[t * k + j]]`` over held slots, summed in float32
    and rounded once, ``[T, N]`` in ``y``'s dtype (``y [T * k, N]`` with a contiguous last dim, ``weights
    [T, k]``, ``held`` bool ``[T, k]`` or None, ``addend [T, N]`` contiguous along N or None)."""
    if not HAS_TRITON:
        raise RuntimeError("combine_rows needs triton")
    t, k = weights.shape
    if y.dim() != 2 or y.shape[0] != t * k or y.stride(1) != 1:
        raise ValueError(f"y must be [T * k, N] = [{t * k}, N] contiguous along N, got {tuple(y.shape)}")
    if inverse.shape != (t * k,):
        raise ValueError(f"inverse must be [{t * k}], got {tuple(inverse.shape)}")
    n = y.shape[1]
    out = torch.empty((t, n), dtype=y.dtype, device=y.device)
    if t == 0 or n == 0:
        return out
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    if held is not None:
        held = held.reshape(t * k).contiguous()
    if addend is not None and (addend.shape != (t, n) or addend.stride(1) != 1):
        raise ValueError(f"addend must be [T, N] = [{t}, {n}] contiguous along N, got {tuple(addend.shape)}")
    block = min(COMBINE_BLOCK, triton.next_power_of_2(n))
    _combine_rows_kernel[(t, triton.cdiv(n, block))](
        y, inverse, weights, held if held is not None else inverse, addend if addend is not None else y, out, n,
        y.stride(0), weights.stride(0), addend.stride(0) if addend is not None else 0, out.stride(0),
        TOP_K=k, HAS_HELD=held is not None, HAS_ADDEND=addend is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
