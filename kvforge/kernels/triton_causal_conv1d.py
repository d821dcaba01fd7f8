"""Triton kernels: the short causal conv1d over per-sequence conv-state slots (decode and prefill).

The convolution and its state are those of :mod:`kvforge.attention.causal_conv1d`: sequence ``i``
has one new token ``x[i] [D]``; its slot ``conv_states[slot_ids[i]] [W - 1, D]`` holds the
previous ``W - 1`` inputs, oldest first. The output is
``act(bias + sum_j weight[:, j] * state[j] + weight[:, W - 1] * x[i])`` and the slot is shifted
in place (row ``j`` <- row ``j + 1``, the last row <- ``x[i]``). ``slot_ids[i] < 0`` is a padding
row (skipped); ``has_initial_state[i]`` False reads zeros instead of the slot.

:func:`conv1d_decode` (one token per sequence): grid ``(N, cdiv(D, BLOCK_D))``; a program owns
one sequence's channel block, so the shift needs no synchronisation (slot ids of a batch are
distinct). No host sync, fixed shapes for fixed ``N``: capturable in a CUDA graph.

:func:`conv1d_prefill` (sequences of any lengths, ``query_start_loc [N + 1]``): one launch computes
the outputs, grid ``(cdiv(T, BLOCK_T), cdiv(D, BLOCK_D))``, each token finding its sequence by a
binary search over ``query_start_loc`` and reading taps before its sequence's first token from the
slot; a second launch (grid ``(N, cdiv(D, BLOCK_D))``) then writes each slot's new state, the last
``W - 1`` inputs of ``cat(state, x)``. Tokens at or past ``query_start_loc[N]`` are not written.

Arithmetic in float32; the output has ``x``'s dtype.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU engine never imports this module's kernels.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

_BLOCK_D = 256
_PREFILL_BLOCK_T = 16
_PREFILL_BLOCK_D = 64


if HAS_TRITON:

    @triton.jit
    def _conv1d_decode_kernel(
        x_ptr, out_ptr, state_ptr, slot_ptr, init_ptr, w_ptr, bias_ptr,
        D, stride_x, stride_o, stride_ss, stride_sr, stride_w,
        WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        HAS_INIT_FLAGS: tl.constexpr,
    ):
        i = tl.program_id(0)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = ds < D
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if slot >= 0:
            keep = 1.0
            if HAS_INIT_FLAGS:
                keep = (tl.load(init_ptr + i) != 0).to(tl.float32)
            x = tl.load(x_ptr + i.to(tl.int64) * stride_x + ds, mask=dmask, other=0.0)
            acc = tl.load(w_ptr + ds * stride_w + (WIDTH - 1), mask=dmask, other=0.0).to(tl.float32) * x.to(tl.float32)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
            row_ptr = state_ptr + slot * stride_ss + ds
            prev = tl.load(row_ptr, mask=dmask, other=0.0).to(tl.float32) * keep
            for j in tl.static_range(WIDTH - 1):
                w = tl.load(w_ptr + ds * stride_w + j, mask=dmask, other=0.0).to(tl.float32)
                acc += w * prev
                if j < WIDTH - 2:  # shift: row j <- row j + 1 (exact: a value of the state's own dtype)
                    nxt = tl.load(row_ptr + (j + 1) * stride_sr, mask=dmask, other=0.0).to(tl.float32) * keep
                    tl.store(row_ptr + j * stride_sr, nxt.to(state_ptr.dtype.element_ty), mask=dmask)
                    prev = nxt
            tl.store(row_ptr + (WIDTH - 2) * stride_sr, x.to(state_ptr.dtype.element_ty), mask=dmask)
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + i.to(tl.int64) * stride_o + ds, acc.to(out_ptr.dtype.element_ty), mask=dmask)


    @triton.jit
    def _conv1d_prefill_kernel(
        x_ptr, out_ptr, state_ptr, slot_ptr, init_ptr, qsl_ptr, w_ptr, bias_ptr,
        D, N, stride_x, stride_o, stride_ss, stride_sr, stride_w,
        WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = ds < D
        total = tl.load(qsl_ptr + N)
        # The sequence of each token: the last i with query_start_loc[i] <= t.
        lo = tl.zeros([BLOCK_T], dtype=tl.int32)
        hi = tl.zeros([BLOCK_T], dtype=tl.int32) + N
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            below = tl.load(qsl_ptr + mid) <= ts
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        bos = tl.load(qsl_ptr + lo)
        slot = tl.load(slot_ptr + lo).to(tl.int64)
        keep = (tl.load(init_ptr + lo) != 0).to(tl.float32)
        tmask = (ts < total) & (slot >= 0)
        m2 = tmask[:, None] & dmask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ds, mask=dmask, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(WIDTH):
            p = ts - (WIDTH - 1 - j)  # the input this tap reads; before bos it is in the slot
            from_x = p >= bos
            xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + ds[None, :], mask=m2 & from_x[:, None],
                         other=0.0).to(tl.float32)
            row = (WIDTH - 1) + (p - bos)
            sv = tl.load(state_ptr + slot[:, None] * stride_ss + row.to(tl.int64)[:, None] * stride_sr + ds[None, :],
                         mask=m2 & ~from_x[:, None], other=0.0).to(tl.float32) * keep[:, None]
            w = tl.load(w_ptr + ds * stride_w + j, mask=dmask, other=0.0).to(tl.float32)
            acc += w[None, :] * (xv + sv)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + ts.to(tl.int64)[:, None] * stride_o + ds[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m2)

    @triton.jit
    def _conv1d_state_kernel(
        x_ptr, state_ptr, slot_ptr, init_ptr, qsl_ptr, D, stride_x, stride_ss, stride_sr,
        WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        i = tl.program_id(0)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if slot >= 0:
            bos = tl.load(qsl_ptr + i)
            eos = tl.load(qsl_ptr + i + 1)
            keep = (tl.load(init_ptr + i) != 0).to(tl.float32)
            rs = tl.arange(0, ROWS)
            p = eos - (WIDTH - 1) + rs  # new row r holds input p: from x, or an older row of the slot
            m2 = (rs < WIDTH - 1)[:, None] & (ds < D)[None, :]
            from_x = (p >= bos)[:, None]
            base = state_ptr + slot * stride_ss + ds[None, :]
            xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + ds[None, :], mask=m2 & from_x, other=0.0)
            old = tl.load(base + (rs + (eos - bos)).to(tl.int64)[:, None] * stride_sr, mask=m2 & ~from_x, other=0.0)
            new = xv.to(tl.float32) + old.to(tl.float32) * keep
            tl.store(base + rs.to(tl.int64)[:, None] * stride_sr, new.to(state_ptr.dtype.element_ty), mask=m2)


def _check_conv(x, conv_states, slot_ids, weight, activation, num_seqs):
    if not HAS_TRITON:
        raise RuntimeError("the conv1d kernels need triton")
    if activation not in ("silu", None):
        raise ValueError(f"causal conv1d activation {activation!r} is not supported; supported: silu, None")
    d = x.shape[1]
    width = weight.shape[1]
    if x.dim() != 2 or weight.shape != (d, width) or width < 2:
        raise ValueError(f"want x [T, D] and weight [D, W >= 2]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (width - 1, d) or conv_states.stride(2) != 1:
        raise ValueError(f"conv_states must be [slots, {width - 1}, {d}] with a contiguous last dim, "
                         f"got {tuple(conv_states.shape)}")
    if slot_ids.shape != (num_seqs,) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("want slot_ids [N] and x, weight with contiguous last dims")
    return d, width


def conv1d_prefill(x: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor, query_start_loc: torch.Tensor,
                   weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = "silu", *,
                   has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """``out [T, D]`` for sequences of any lengths; each slot ends holding its sequence's last ``W - 1`` inputs."""
    n = slot_ids.shape[0]
    d, width = _check_conv(x, conv_states, slot_ids, weight, activation, n)
    if query_start_loc.shape != (n + 1,):
        raise ValueError(f"query_start_loc must be [N + 1] = [{n + 1}], got {tuple(query_start_loc.shape)}")
    out = torch.empty_like(x)
    t = x.shape[0]
    if n == 0 or t == 0:
        return out
    flags = has_initial_state if has_initial_state is not None else torch.ones_like(slot_ids, dtype=torch.bool)
    _conv1d_prefill_kernel[(triton.cdiv(t, _PREFILL_BLOCK_T), triton.cdiv(d, _PREFILL_BLOCK_D))](
        x, out, conv_states, slot_ids, flags, query_start_loc, weight, bias if bias is not None else weight,
        d, n, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1), weight.stride(0),
        WIDTH=width, SEARCH_STEPS=max(1, n.bit_length()), BLOCK_T=_PREFILL_BLOCK_T, BLOCK_D=_PREFILL_BLOCK_D,
        HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4,
    )
    _conv1d_state_kernel[(n, triton.cdiv(d, _BLOCK_D))](
        x, conv_states, slot_ids, flags, query_start_loc, d, x.stride(0), conv_states.stride(0),
        conv_states.stride(1), WIDTH=width, ROWS=triton.next_power_of_2(width - 1), BLOCK_D=_BLOCK_D, num_warps=4,
    )
    return out


def conv1d_decode(x: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, activation: str | None = "silu", *,
                  has_initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """``out [N, D]`` for one token per sequence; ``conv_states [slots, W - 1, D]`` shifted in place."""
    n = x.shape[0]
    d, width = _check_conv(x, conv_states, slot_ids, weight, activation, n)
    out = torch.empty_like(x)
    if n == 0:
        return out
    _conv1d_decode_kernel[(n, triton.cdiv(d, _BLOCK_D))](
        x, out, conv_states, slot_ids, has_initial_state if has_initial_state is not None else slot_ids,
        weight, bias if bias is not None else weight,
        d, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1), weight.stride(0),
        WIDTH=width, BLOCK_D=_BLOCK_D, HAS_BIAS=bias is not None, SILU=activation == "silu",
        HAS_INIT_FLAGS=has_initial_state is not None, num_warps=4,
    )
    return out
