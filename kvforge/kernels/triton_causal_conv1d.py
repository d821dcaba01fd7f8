"""Triton kernels: the short causal conv1d over per-sequence conv-state slots (decode and prefill).

The convolution and its state are those of :mod:`kvforge.attention.causal_conv1d`: sequence ``i``
has one new token ``x[i] [D]``; its slot ``conv_states[slot_ids[i]] [W - 1, D]`` holds the
previous ``W - 1`` inputs, oldest first. The output is
``act(bias + sum_j weight[:, j] * state[j] + weight[:, W - 1] * x[i])`` and the slot is shifted
in place (row ``j`` <- row ``j + 1``, the last row <- ``x[i]``). ``slot_ids[i] < 0`` is a padding
row (skipped); ``has_initial_state[i]`` False reads zeros instead of the slot.

Both functions take ``x [T, D]`` (``T = N`` for :func:`conv1d_decode`) and return ``out [T, D]``.

:func:`conv1d_decode` (one token per sequence): grid ``(N, cdiv(D, BLOCK_D))``, one launch.

:func:`conv1d_prefill` (sequences of any lengths, ``query_start_loc [N + 1]``): a first launch,
grid ``(cdiv(T, BLOCK_T), cdiv(D, BLOCK_D))``, computes the outputs, each token finding its sequence
by a binary search over ``query_start_loc`` and reading taps before its sequence's first token from
the slot; it reads slots and writes none. A second launch on the same stream, grid
``(N, cdiv(D, BLOCK_D))``, then writes each slot's new state, the last ``W - 1`` inputs of
``cat(state, x)``: for a sequence of ``L`` tokens, new row ``r`` is old row ``r + L`` when
``r + L < W - 1`` (only sequences shorter than ``W - 1`` tokens keep old rows; ``L = 0`` keeps the
slot), else ``x[eos - (W - 1) + r]``. Tokens at or past ``query_start_loc[N]`` are not written.

Why the in-place state updates are race-free (the decode kernel and the prefill state kernel):

* Between programs: program ``(i, c)`` reads and writes only elements ``[slot_ids[i], :, channel
  block c]``; distinct non-padding slot ids (one slot per live sequence, the caller's contract)
  make these element sets disjoint, so no program reads or writes what another one writes.
  Padding rows (slot < 0) and channels past ``D`` load and store nothing.
* Within a program: a new row ``r`` may come from an old row ``r' > r`` that is itself rewritten
  by the same program, possibly by another warp. The program first loads every old value it needs
  into registers, then ``tl.debug_barrier()`` (a CTA barrier, ordering all of the program's global
  loads before any of its stores), then stores. No store can precede a load of the same element,
  whatever the warp schedule or register layout.

``has_initial_state[i]`` False masks the slot's loads off (zeros), so whatever the slot held,
NaN included, never reaches the output or the new state. No host sync and a grid fixed by the
shapes: both functions are capturable in a CUDA graph.

``conv1d_prefill``'s ``store_slot_ids`` (-1: keep the slot) leaves a verifying sequence's slot as it
was; :func:`conv1d_update_states` runs the second launch alone, to replay its accepted rows later.

Arithmetic in float32; the output has ``x``'s dtype.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

_BLOCK_D = 256
_PREFILL_BLOCK_T = 16
_PREFILL_BLOCK_D = 64


if HAS_TRITON:
    from kvforge.kernels.triton_sorted_search import last_start_at_or_below

    @triton.jit
    def _conv1d_decode_kernel(
        x_ptr, out_ptr, state_ptr, slot_ptr, init_ptr, w_ptr, bias_ptr,
        D, stride_x, stride_o, stride_ss, stride_sr, stride_w,
        WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
    ):
        i = tl.program_id(0)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        rs = tl.arange(0, ROWS)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        live = slot >= 0
        reads_state = live
        if HAS_INIT_FLAGS:
            reads_state = live & (tl.load(init_ptr + i) != 0)
        dmask = (ds < D) & live
        m2 = (rs < WIDTH - 1)[:, None] & dmask[None, :]
        base = state_ptr + slot * stride_ss + ds[None, :]
        # Gather: every old value this program needs, into registers (zeros without an initial state).
        x = tl.load(x_ptr + i.to(tl.int64) * stride_x + ds, mask=dmask, other=0.0)
        old = tl.load(base + rs.to(tl.int64)[:, None] * stride_sr, mask=m2 & reads_state, other=0.0)
        shifted = tl.load(base + (rs + 1).to(tl.int64)[:, None] * stride_sr,
                          mask=m2 & (rs < WIDTH - 2)[:, None] & reads_state, other=0.0)
        # All of this program's loads of the slot happen before any of its stores (see the module docstring).
        tl.debug_barrier()
        new = tl.where((rs == WIDTH - 2)[:, None], x[None, :], shifted)  # copies: values of the state's dtype
        tl.store(base + rs.to(tl.int64)[:, None] * stride_sr, new.to(state_ptr.dtype.element_ty), mask=m2)
        taps = tl.load(w_ptr + ds[None, :] * stride_w + rs[:, None], mask=m2, other=0.0).to(tl.float32)
        acc = tl.sum(taps * old.to(tl.float32), axis=0)
        acc += tl.load(w_ptr + ds * stride_w + (WIDTH - 1), mask=dmask, other=0.0).to(tl.float32) * x.to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + i.to(tl.int64) * stride_o + ds, acc.to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit(do_not_specialize=["N", "search_steps"])
    def _conv1d_prefill_kernel(
        x_ptr, out_ptr, state_ptr, slot_ptr, init_ptr, qsl_ptr, w_ptr, bias_ptr,
        D, N, stride_x, stride_o, stride_ss, stride_sr, stride_w, search_steps,
        WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = ds < D
        total = tl.load(qsl_ptr + N)
        # The sequence of each token: the last i with query_start_loc[i] <= t.
        lo = last_start_at_or_below(qsl_ptr, ts, tl.zeros([BLOCK_T], dtype=tl.int32),
                                    tl.zeros([BLOCK_T], dtype=tl.int32) + N, search_steps)
        bos = tl.load(qsl_ptr + lo)
        slot = tl.load(slot_ptr + lo).to(tl.int64)
        has_init = tl.load(init_ptr + lo) != 0
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
                         mask=m2 & (~from_x & has_init)[:, None], other=0.0).to(tl.float32)
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
        rs = tl.arange(0, ROWS)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        bos = tl.load(qsl_ptr + i)
        eos = tl.load(qsl_ptr + i + 1)
        reads_state = tl.load(init_ptr + i) != 0
        p = eos - (WIDTH - 1) + rs  # new row r holds input p: x[p], or old row r + (eos - bos) if p < bos
        m2 = (rs < WIDTH - 1)[:, None] & (ds < D)[None, :] & (slot >= 0)
        from_x = (p >= bos)[:, None]
        base = state_ptr + slot * stride_ss + ds[None, :]
        # Gather: every old value this program needs, into registers (zeros without an initial state).
        xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + ds[None, :], mask=m2 & from_x, other=0.0)
        old = tl.load(base + (rs + (eos - bos)).to(tl.int64)[:, None] * stride_sr,
                      mask=m2 & ~from_x & reads_state, other=0.0)
        # All of this program's loads of the slot happen before any of its stores (see the module docstring).
        tl.debug_barrier()
        new = tl.where(from_x, xv.to(state_ptr.dtype.element_ty), old.to(state_ptr.dtype.element_ty))
        tl.store(base + rs.to(tl.int64)[:, None] * stride_sr, new, mask=m2)


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
                   has_initial_state: torch.Tensor | None = None,
                   store_slot_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``out [T, D]`` for sequences of any lengths; each slot ends holding its sequence's last ``W - 1`` inputs.
    ``store_slot_ids`` (int32 [N], default ``slot_ids``): -1 where a slot keeps its state (a sequence verifying
    speculative proposals), else ``slot_ids[i]``."""
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
        max(1, n.bit_length()), WIDTH=width, BLOCK_T=_PREFILL_BLOCK_T, BLOCK_D=_PREFILL_BLOCK_D,
        HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4,
    )
    if store_slot_ids is not None and store_slot_ids.shape != slot_ids.shape:
        raise ValueError(f"store_slot_ids must be [N] = [{n}], got {tuple(store_slot_ids.shape)}")
    _launch_state_kernel(x, conv_states, slot_ids if store_slot_ids is None else store_slot_ids, flags,
                         query_start_loc, d, width)
    return out


def _launch_state_kernel(x, conv_states, slot_ids, flags, query_start_loc, d, width):
    _conv1d_state_kernel[(slot_ids.shape[0], triton.cdiv(d, _BLOCK_D))](
        x, conv_states, slot_ids, flags, query_start_loc, d, x.stride(0), conv_states.stride(0),
        conv_states.stride(1), WIDTH=width, ROWS=triton.next_power_of_2(width - 1), BLOCK_D=_BLOCK_D, num_warps=4,
    )


def conv1d_update_states(x: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor,
                         query_start_loc: torch.Tensor, *, has_initial_state: torch.Tensor | None = None) -> None:
    """Advance each slot's conv state over its sequence's inputs ``x [T, D]`` (``query_start_loc``) without
    computing outputs: slot ``slot_ids[i]`` ends holding the last ``W - 1`` rows of ``cat(state, x_i)``
    (the replay of a verify step's accepted rows). ``has_initial_state`` (bool [N], default all True, made
    here): whether each slot holds its sequence's state (a caller with many layers passes it once)."""
    n, d = slot_ids.shape[0], x.shape[1]
    if conv_states.dim() != 3 or conv_states.shape[2] != d or conv_states.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError(f"want x [T, D] and conv_states [slots, W - 1, D] with contiguous last dims; got "
                         f"{tuple(x.shape)}, {tuple(conv_states.shape)}")
    if query_start_loc.shape != (n + 1,):
        raise ValueError(f"query_start_loc must be [N + 1] = [{n + 1}], got {tuple(query_start_loc.shape)}")
    if n == 0 or x.shape[0] == 0:
        return
    if has_initial_state is None:
        has_initial_state = torch.ones_like(slot_ids, dtype=torch.bool)
    _launch_state_kernel(x, conv_states, slot_ids, has_initial_state, query_start_loc, d, conv_states.shape[1] + 1)


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
        WIDTH=width, ROWS=triton.next_power_of_2(width - 1), BLOCK_D=_BLOCK_D, HAS_BIAS=bias is not None,
        SILU=activation == "silu", HAS_INIT_FLAGS=has_initial_state is not None, num_warps=4,
    )
    return out
