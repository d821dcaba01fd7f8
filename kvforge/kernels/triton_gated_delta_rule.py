"""Triton kernels: the gated delta rule over per-sequence state slots (decode, and prefill token by token or in chunks).

The rule, its shapes and its state contract are those of :mod:`kvforge.attention.gated_delta_rule`
(the PyTorch reference these kernels are tested against). Here a flat batch of ``T`` tokens
belongs to ``N`` sequences and every sequence owns one state slot:

* ``q, k [T, Hk, K]``, ``v [T, Hv, V]``, ``beta [T, Hv]``, ``g [T, Hv]`` (one gate per head) or
  ``g [T, Hv, K]`` (one per key channel); last dimension contiguous;
* ``states [num_slots, Hv, K, V]`` (any float dtype; arithmetic in float32), read at
  ``slot_ids[i]`` before sequence ``i``'s tokens and overwritten in place with its state after them;
  ``slot_ids[i] < 0`` marks a padding row: nothing is read or written for it;
* ``has_initial_state [N]`` (optional, bool): False starts sequence ``i`` from a zero state instead
  of reading its slot (a new sequence's slot holds whatever its previous owner left);
* ``store_slot_ids [N]`` (optional, :func:`prefill` only): ``slot_ids[i]`` (store the final state,
  the default) or -1 (store nothing: a sequence verifying speculative proposals keeps the state
  before the step, kvforge/attention/linear_state.py).

Entries (no host sync, output allocated with ``torch.empty``):

* :func:`decode` - one token per sequence (``T == N``), grid ``(N, Hv, cdiv(V, BV))``; fixed
  shapes for fixed ``N``, so it can be captured in a CUDA graph. Each program keeps a
  ``[K, BV]`` block of the state in registers for the token.
* :func:`prefill` - ``query_start_loc [N + 1]`` (int32) gives each sequence's tokens. Every sequence
  runs token by token in one program per (sequence, value head, value block), as decode does, unless
  the call (or the route, kvforge/attention/routing/delta_rule.py) names a chunk size; the sequences
  then run the chunked form in two launches, except those shorter than ``chunked_from`` (the route's
  short rows beside a prompt), which a third launch runs token by token (each launch's programs return at
  once for the other's sequences):

  1. one program per (chunk, value head), all chunks of the step in parallel: the chunk's decays, the
     unit lower-triangular system ``(I + A)`` inverted in registers by forward substitution (row by
     row: as accurate as a triangular solve; the finite product ``(I - A)(I + A^2)(I + A^4)...`` is
     not, its powers of ``A`` grow like binomial coefficients when keys repeat), and per token row
     ``W = (I + A)^-1 (beta exp(gc) k)``, ``U = (I + A)^-1 (beta v)`` and the decayed causal ``q k^T``
     into float32 buffers (``(K + V + chunk) x 4`` bytes a token and value head); ``gc`` is the
     cumulative gate from the chunk's start, and every decay between two rows is the sum of the gates
     between them (not a difference of cumulative sums, which loses small gates after strong ones);
  2. the state pass, one program per (sequence, value head, value block) as token by token, chunk
     after chunk: the new values ``U - W S``, the outputs ``(q exp(gc)) S + (q k^T) (U - W S)`` and
     the state at the chunk's end, and the state after a prefix-cache snapshot's token in the chunk
     holding it. Each chunk's sequence is found by a binary search over its sequence's first chunk
     number, so the launch needs no host sync.

  Its products run at the route's precision for the inputs' dtype (``route.product_precision``): three tf32
  products a product (tf32x3, the default for every dtype), or one tf32 product of operands rounded to nearest
  ("tf32-nearest"); IEEE float32 products would run on the FMA units, and compiled for sm_90 at the largest
  chunks tried they spilled several times more than tf32x3.
  Per-channel gates (KDA) take the same launches, every decay per key channel: the pairs' decays
  ``exp(g[j+1, c] + ... + g[r, c])`` weigh ``k_r k_j`` and ``q_r k_j`` channel by channel
  (:data:`CHUNK_CHANNEL_SLICE` channels at a time, as exact float32 sums rather than a product of
  ``exp(G)`` and ``exp(-G)`` factors, which overflow for strong decays), and the decays from a chunk's start
  and to its end scale each key channel of ``q``, ``k`` and the state.

Sequence ``i``'s loop bounds are loaded from ``query_start_loc``. Offsets are int64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvforge.attention.routing import delta_rule as route
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton
from kvforge.kernels.triton_delta_gates import SOFTPLUS_THRESHOLD

if HAS_TRITON:
    from kvforge.kernels.triton_delta_gates import decay_gate, write_strength
    from kvforge.kernels.triton_sorted_search import last_start_at_or_below

L2_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class RecurrentTile:
    """A recurrent program's value channels (``block_v``, a power of two >= 16, at most the head's) and warps.
    Each program keeps a ``[K, block_v]`` float32 block of its head's state in registers."""

    block_v: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class TileBySequences:
    """A kernel's tile by the sequences of its call: ``large`` from ``large_from_seqs`` sequences, ``small``
    below."""

    small: RecurrentTile
    large: RecurrentTile
    large_from_seqs: int

    def for_batch(self, num_seqs: int) -> RecurrentTile:
        return self.large if num_seqs >= self.large_from_seqs else self.small


#: On an H200 (``benchmarks/bench_gated_delta_rule.py --sweep``, float32 states, K = V = 128) 64 value
#: channels a program read 1.10-1.18x faster than 32 at 64 and 256 sequences, and level at 1-8.
DECODE_TILES = TileBySequences(small=RecurrentTile(32, 4), large=RecurrentTile(64, 4), large_from_seqs=64)
#: The tile of the token-by-token prefill. One warp a program ran the token-by-token
#: kernel alone 1.6x faster than four at 8-16 prompts on an H100, but a Qwen3-Next prefill end to end 8% slower
#: (docs/BENCHMARKS.md, "Gated delta rule prefill").
PREFILL_TILE = RecurrentTile(block_v=32, num_warps=4)
#: The chunk sizes the chunked form runs, with the pipeline stages of its state pass's chunk loop. Compiled
#: for sm_90 with the 16-byte aligned pointers and strides a launch specialises on (tests/test_tl_kernels_sm90_build.py
#: checks every tile against the 232,448 bytes of shared memory a Hopper allows a program): three stages at
#: chunks of 32 with per-channel gates and 64 value channels a program asked 253,952 bytes, so chunks of 32
#: take two. Chunks of 64 are not run: three stages asked 279,040 bytes at 32 channels, and with two they were
#: slower than chunks of 16 everywhere on an H100 (0.6-0.8x) and, with 16-dimensional keys, off by 5e-4
#: (largest error over largest value) where 16 and 32 kept 1e-4.
CHUNK_STATE_STAGES = {16: 3, 32: 2}
#: The chunked form's per-chunk program (its value channels a step of ``U``, and warps), and its state pass's
#: tile by the chunked sequences of the call (docs/BENCHMARKS.md, "Gated delta rule prefill", Tiles). On an
#: H100, against 32 channels and 8 warps for both: Qwen3-Next's layer 1 x 4096 tokens 1,345 against 1,900 us,
#: 2 x 4096 1,956 against 3,705; Kimi-Linear's 2,652 against 2,819 and 3,601 against 5,550. The state pass's 32
#: channels and 4 warps give one sequence 128 programs; 64 channels and 8 warps read two or more faster.
CHUNK_PREP_TILE = RecurrentTile(block_v=128, num_warps=4)
CHUNK_STATE_TILES = TileBySequences(small=RecurrentTile(32, 4), large=RecurrentTile(64, 8), large_from_seqs=2)
#: Key channels a step of the per-channel gates' pairwise decays holds: ``[chunk, chunk, slice]`` floats.
CHUNK_CHANNEL_SLICE = 16


if HAS_TRITON:

    @triton.jit
    def _l2_normalize(x, NORMALIZE: tl.constexpr, axis: tl.constexpr):
        if NORMALIZE:
            x = x * tl.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + 1e-6)
        return x

    @triton.jit
    def _to_tf32_nearest(x):
        """``x`` (float32) rounded to tf32's 10 fraction bits, to nearest with ties away from zero (as
        ``cvt.rna.tf32.f32``): half the 13 dropped bits' range added, then the bits dropped, so the matrix units'
        own tf32 read (which drops them) rounds nothing more. Infinities stay; a finite value at or past the
        halfway point above tf32's largest rounds to infinity; NaN stays NaN (whose payload the addition could
        carry out)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x)

    @triton.jit
    def _product(a, b, PRECISION: tl.constexpr):
        """``a @ b`` in float32 accumulation at ``PRECISION``: Triton's ``input_precision`` ("tf32x3", "tf32",
        "ieee"), or "tf32-nearest": one tf32 product of operands rounded to nearest (:func:`_to_tf32_nearest`)
        rather than cut."""
        if PRECISION == "tf32-nearest":
            c = tl.dot(_to_tf32_nearest(a), _to_tf32_nearest(b), input_precision="tf32")
        else:
            c = tl.dot(a, b, input_precision=PRECISION)
        return c

    @triton.jit
    def _row_factor(x, NORMALIZE: tl.constexpr):
        """Per row of ``x [R, C]`` the factor ``_l2_normalize`` multiplies it by (1 without NORMALIZE)."""
        if NORMALIZE:
            return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)
        return tl.sum(x * 0.0, axis=1) + 1.0

    @triton.jit
    def _load_state(state_ptr, init_ptr, i, slot, h, ks, vs, kmask, vmask, stride_ss, stride_sh, stride_sk,
                    HAS_INIT_FLAGS: tl.constexpr):
        """Sequence ``i``'s ``[BK, BV]`` state block (value channels ``vs`` of head ``h``) from its slot, in
        float32, zeros where ``has_initial_state[i]`` is False (the slot is not read); with the offsets and mask
        of the final store."""
        s_off = slot * stride_ss + h * stride_sh + ks[:, None].to(tl.int64) * stride_sk + vs[None, :]
        smask = kmask[:, None] & vmask[None, :]
        if HAS_INIT_FLAGS:  # a fresh sequence never reads its slot: whatever it holds (even NaN) stays out
            smask_load = smask & (tl.load(init_ptr + i) != 0)
        else:
            smask_load = smask
        s = tl.load(state_ptr + s_off, mask=smask_load, other=0.0).to(tl.float32)
        return s, s_off, smask

    @triton.jit
    def _store_state(state_ptr, s, s_off, smask, slot, store_slot_ptr, i, stride_ss):
        """Store the final state block at ``store_slot_ids[i]`` (the read slot's offsets moved there: it is
        the read slot or -1); nothing where it is -1 (a sequence verifying proposals keeps its state)."""
        store_slot = tl.load(store_slot_ptr + i).to(tl.int64)
        tl.store(state_ptr + s_off + (store_slot - slot) * stride_ss, s.to(state_ptr.dtype.element_ty),
                 mask=smask & (store_slot >= 0))

    @triton.jit
    def _load_qkv(q_ptr, k_ptr, v_ptr, rows, hk, h, kcols, vcols, qk_mask, v_mask,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, scale,
                  NORMALIZE: tl.constexpr, AXIS: tl.constexpr):
        """q (L2-normalised when NORMALIZE, times ``scale``), k (normalised) and v in float32, of the token
        ``rows`` (one int64 token index, or a column of them) at key channels ``kcols`` of key head ``hk``
        and value channels ``vcols`` of value head ``h``; the channels lie along ``AXIS``."""
        q = tl.load(q_ptr + rows * stride_qt + hk * stride_qh + kcols, mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows * stride_kt + hk * stride_kh + kcols, mask=qk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows * stride_vt + h * stride_vh + vcols, mask=v_mask, other=0.0).to(tl.float32)
        return _l2_normalize(q, NORMALIZE, AXIS) * scale, _l2_normalize(k, NORMALIZE, AXIS), v

    @triton.jit(do_not_specialize=["len_below"])
    def _recurrent_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slot_ptr, store_slot_ptr, init_ptr, qsl_ptr,
        dt_bias_ptr, a_log_ptr, snap_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
        stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
        scale, GROUP, DK, DV, len_below,
        BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, NORMALIZE: tl.constexpr,
        DECODE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, STORE_OUT: tl.constexpr, RAW_GATES: tl.constexpr,
        THRESHOLD: tl.constexpr, SNAPSHOTS: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        if DECODE:
            bos = i.to(tl.int64)
            eos = bos + 1
        else:
            bos = tl.load(qsl_ptr + i).to(tl.int64)
            eos = tl.load(qsl_ptr + i + 1).to(tl.int64)
        if (slot >= 0) & (eos - bos < len_below):  # longer sequences: the chunked form's, in the same call
            hk = h // GROUP
            ks = tl.arange(0, BK)
            vs = vb * BV + tl.arange(0, BV)
            kmask = ks < DK
            vmask = vs < DV
            s, s_off, smask = _load_state(state_ptr, init_ptr, i, slot, h, ks, vs, kmask, vmask,
                                          stride_ss, stride_sh, stride_sk, HAS_INIT_FLAGS)
            if SNAPSHOTS:  # SNAPSHOTS (token offset in the sequence, slot) pairs: the state after that token goes
                pairs = tl.arange(0, SNAPSHOTS)  # to that slot; offset -1: none
                snap_at = tl.load(snap_ptr + 2 * SNAPSHOTS * i + 2 * pairs).to(tl.int64) + bos
                snap_slot = tl.load(snap_ptr + 2 * SNAPSHOTS * i + 2 * pairs + 1).to(tl.int64)
            for t64 in range(bos, eos):  # int64 token index
                q, k, v = _load_qkv(q_ptr, k_ptr, v_ptr, t64, hk, h, ks, vs, kmask, vmask, stride_qt, stride_qh,
                                    stride_kt, stride_kh, stride_vt, stride_vh, scale, NORMALIZE, 0)
                beta = tl.load(beta_ptr + t64 * stride_bt + h)
                if RAW_GATES:  # beta_ptr holds b: sigmoid rounded to b's dtype, as the gates kernel stores it
                    beta = write_strength(beta).to(beta_ptr.dtype.element_ty)
                beta = beta.to(tl.float32)
                if PER_CHANNEL:
                    g = tl.load(g_ptr + t64 * stride_gt + h * stride_gh + ks, mask=kmask, other=0.0)
                    if RAW_GATES:  # g_ptr holds f: the decay from it, dt_bias (a channel) and A_log (a head)
                        g = decay_gate(g, tl.load(dt_bias_ptr + h * DK + ks, mask=kmask, other=0.0),
                                       tl.load(a_log_ptr + h), THRESHOLD)
                    s = s * tl.exp(g.to(tl.float32))[:, None]
                else:
                    g = tl.load(g_ptr + t64 * stride_gt + h)
                    if RAW_GATES:
                        g = decay_gate(g, tl.load(dt_bias_ptr + h), tl.load(a_log_ptr + h), THRESHOLD)
                    s = s * tl.exp(g.to(tl.float32))
                u = beta * (v - tl.sum(s * k[:, None], axis=0))
                s = s + k[:, None] * u[None, :]
                if STORE_OUT:
                    o = tl.sum(s * q[:, None], axis=0)
                    tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vs, o.to(out_ptr.dtype.element_ty),
                             mask=vmask)
                if SNAPSHOTS:
                    hit = snap_at == t64
                    if tl.max(hit.to(tl.int32), axis=0) > 0:
                        dest = tl.sum(tl.where(hit, snap_slot, 0), axis=0)
                        tl.store(state_ptr + s_off + (dest - slot) * stride_ss,
                                 s.to(state_ptr.dtype.element_ty), mask=smask)
            _store_state(state_ptr, s, s_off, smask, slot, store_slot_ptr, i, stride_ss)

    @triton.jit
    def _pairwise_channel_decays(q_ptr, k_ptr, g_ptr, r64, rmask, hk, h, q_factor, k_factor, rs,
                                 stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
                                 DK, BT: tl.constexpr, BKS: tl.constexpr):
        """``sum_c k[r, c] k[j, c] decay[r, j, c]`` and ``sum_c q[r, c] k[j, c] decay[r, j, c]`` for every pair
        of the chunk's rows (``decay[r, j, c] = exp(g[j+1, c] + ... + g[r, c])``, each a sum of its own gates;
        pairs with j > r are left to the caller's mask), ``BKS`` key channels at a time from memory, each row
        times its factor (``q_factor``, ``k_factor`` [BT]: normalisation and scale, from the full rows)."""
        a = tl.zeros((BT, BT), dtype=tl.float32)
        aqk = tl.zeros((BT, BT), dtype=tl.float32)
        strict = (rs[:, None] > rs[None, :])[:, :, None]
        lower = (rs[:, None] >= rs[None, :])[:, :, None]
        for c0 in range(0, DK, BKS):
            cs = c0 + tl.arange(0, BKS)
            cmask = rmask[:, None] & (cs < DK)[None, :]
            ks = tl.load(k_ptr + r64[:, None] * stride_kt + hk * stride_kh + cs[None, :], mask=cmask,
                         other=0.0).to(tl.float32) * k_factor[:, None]
            qs = tl.load(q_ptr + r64[:, None] * stride_qt + hk * stride_qh + cs[None, :], mask=cmask,
                         other=0.0).to(tl.float32) * q_factor[:, None]
            gs = tl.load(g_ptr + r64[:, None] * stride_gt + h * stride_gh + cs[None, :], mask=cmask,
                         other=0.0).to(tl.float32)
            # a scan along rows of the [row, pair row, channel] gates, flattened to two dimensions (a scan of a
            # three-dimensional tensor does not lower for sm_90 in Triton 3.6)
            segment = tl.reshape(tl.cumsum(tl.reshape(tl.where(strict, gs[:, None, :], 0.0), (BT, BT * BKS)),
                                           axis=0), (BT, BT, BKS))
            decay = tl.exp(tl.where(lower, segment, float("-inf")))
            a += tl.sum(ks[:, None, :] * ks[None, :, :] * decay, axis=2)
            aqk += tl.sum(qs[:, None, :] * ks[None, :, :] * decay, axis=2)
        return a, aqk

    @triton.jit(do_not_specialize=["N", "search_steps", "len_from"])
    def _chunk_prep_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, qsl_ptr, chunk_ptr, w_ptr, u_ptr, aqk_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
        stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah,
        scale, GROUP, DK, DV, N, search_steps, len_from,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr,
        PER_CHANNEL: tl.constexpr, BKS: tl.constexpr,
    ):
        """One chunk of one value head: the decays, the triangular system's inverse and what the state pass
        needs of the chunk: ``W``, ``U`` and the masked ``q k^T``, per token row. Per-channel gates weigh each
        key channel of a pair of rows by its own decay, ``BKS`` channels at a time."""
        c = tl.program_id(0)
        h = tl.program_id(1)
        # The chunk's sequence: the last i with chunk_start[i] <= c (chunk_start [N + 1], per-sequence chunk counts).
        i = last_start_at_or_below(chunk_ptr, c, tl.full((), 0, tl.int32), tl.full((), 0, tl.int32) + N, search_steps)
        slot = tl.load(slot_ptr + i)
        bos = tl.load(qsl_ptr + i)
        eos = tl.load(qsl_ptr + i + 1)
        if (c < tl.load(chunk_ptr + N)) & (slot >= 0) & (eos - bos >= len_from):
            hk = h // GROUP
            c0 = bos + (c - tl.load(chunk_ptr + i)) * BT
            rs = tl.arange(0, BT)
            ks = tl.arange(0, BK)
            kmask = ks < DK
            rows = c0 + rs
            rmask = rows < eos
            r64 = rows.to(tl.int64)
            qk_mask = rmask[:, None] & kmask[None, :]
            q = tl.load(q_ptr + r64[:, None] * stride_qt + hk * stride_qh + ks[None, :], mask=qk_mask,
                        other=0.0).to(tl.float32)
            k = tl.load(k_ptr + r64[:, None] * stride_kt + hk * stride_kh + ks[None, :], mask=qk_mask,
                        other=0.0).to(tl.float32)
            q_factor = _row_factor(q, NORMALIZE) * scale
            k_factor = _row_factor(k, NORMALIZE)
            q = q * q_factor[:, None]
            k = k * k_factor[:, None]
            beta = tl.load(beta_ptr + r64 * stride_bt + h, mask=rmask, other=0.0).to(tl.float32)
            lower = rs[:, None] >= rs[None, :]
            strict = rs[:, None] > rs[None, :]
            kt = tl.trans(k)
            if PER_CHANNEL:
                gk = tl.load(g_ptr + r64[:, None] * stride_gt + h * stride_gh + ks[None, :], mask=qk_mask,
                             other=0.0).to(tl.float32)
                a, aqk = _pairwise_channel_decays(q_ptr, k_ptr, g_ptr, r64, rmask, hk, h, q_factor, k_factor,
                                                  rs, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt,
                                                  stride_gh, DK, BT, BKS)
                a = tl.where(strict, beta[:, None] * a, 0.0)
                aqk = tl.where(lower, aqk, 0.0)
                gc = tl.cumsum(gk, axis=0)  # padded rows add 0
            else:
                g = tl.load(g_ptr + r64 * stride_gt + h, mask=rmask, other=0.0).to(tl.float32)
                gc = tl.cumsum(g, axis=0)[:, None]  # padded rows add 0 (a scan of [BT, 1] does not lower)
                # decay[r, j] = exp(g[j+1] + ... + g[r]): each sum of its own gates, not a difference of running
                # sums (after strong decays a running sum is large, and later small gates round away in the
                # difference)
                segment = tl.cumsum(tl.where(strict, g[:, None], 0.0), axis=0)
                decay = tl.exp(tl.where(lower, segment, float("-inf")))
                a = tl.where(strict, beta[:, None] * _product(k, kt, PRECISION) * decay, 0.0)
                aqk = tl.where(lower, _product(q, kt, PRECISION) * decay, 0.0)
            # (I + A)^-1 by forward substitution, one row at a time: row r = e_r - A[r, :r] @ rows[:r].
            inv = tl.where(rs[:, None] == rs[None, :], 1.0, 0.0)
            for r in range(1, tl.minimum(eos - c0, BT)):  # rows past the sequence end stay identity rows
                a_row = tl.sum(tl.where(rs[:, None] == r, a, 0.0), axis=0)
                row = tl.where(rs == r, 1.0, 0.0) - tl.sum(a_row[:, None] * inv, axis=0)
                inv = tl.where(rs[:, None] == r, row[None, :], inv)
            tl.store(aqk_ptr + r64[:, None] * stride_at + h * stride_ah + rs[None, :], aqk, mask=rmask[:, None])
            w = _product(inv, beta[:, None] * tl.exp(gc) * k, PRECISION)
            tl.store(w_ptr + r64[:, None] * stride_wt + h * stride_wh + ks[None, :], w, mask=qk_mask)
            for v0 in range(0, DV, BV):
                vs = v0 + tl.arange(0, BV)
                v_mask = rmask[:, None] & (vs < DV)[None, :]
                v = tl.load(v_ptr + r64[:, None] * stride_vt + h * stride_vh + vs[None, :], mask=v_mask,
                            other=0.0).to(tl.float32)
                u = _product(inv, beta[:, None] * v, PRECISION)
                tl.store(u_ptr + r64[:, None] * stride_ut + h * stride_uh + vs[None, :], u, mask=v_mask)

    @triton.jit(do_not_specialize=["len_from"])
    def _chunk_state_kernel(
        q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, aqk_ptr, out_ptr, state_ptr, slot_ptr, store_slot_ptr, init_ptr, qsl_ptr,
        snap_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_wt, stride_wh, stride_ut,
        stride_uh, stride_at, stride_ah, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
        scale, GROUP, DK, DV, len_from,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        NORMALIZE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, STORE_OUT: tl.constexpr, PRECISION: tl.constexpr,
        SNAPSHOTS: tl.constexpr, PER_CHANNEL: tl.constexpr,
    ):
        """The state pass of one (sequence, value head, value block): chunk after chunk, the chunk's new values
        ``U - W S``, its output and the state at its end; also the state after each of up to SNAPSHOTS given
        tokens, in the chunk holding it, into the snapshot's slot."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        bos = tl.load(qsl_ptr + i)
        eos = tl.load(qsl_ptr + i + 1)
        if (slot >= 0) & (eos - bos >= len_from):  # shorter sequences: the token-by-token kernel's
            hk = h // GROUP
            ks = tl.arange(0, BK)
            vs = vb * BV + tl.arange(0, BV)
            rs = tl.arange(0, BT)
            kmask = ks < DK
            vmask = vs < DV
            s, s_off, smask = _load_state(state_ptr, init_ptr, i, slot, h, ks, vs, kmask, vmask,
                                          stride_ss, stride_sh, stride_sk, HAS_INIT_FLAGS)
            for c0 in range(bos, eos, BT):
                rows = c0 + rs
                rmask = rows < eos
                r64 = rows.to(tl.int64)
                qk_mask = rmask[:, None] & kmask[None, :]
                v_mask = rmask[:, None] & vmask[None, :]
                k = tl.load(k_ptr + r64[:, None] * stride_kt + hk * stride_kh + ks[None, :], mask=qk_mask,
                            other=0.0).to(tl.float32)
                k = _l2_normalize(k, NORMALIZE, 1)
                w = tl.load(w_ptr + r64[:, None] * stride_wt + h * stride_wh + ks[None, :], mask=qk_mask, other=0.0)
                u = tl.load(u_ptr + r64[:, None] * stride_ut + h * stride_uh + vs[None, :], mask=v_mask, other=0.0)
                # gc: the decay from the chunk's start through each row; after: each row's decay to the chunk's
                # end, the sum of the next rows' gates (g_next: each row's successor's gate, 0 past the chunk or
                # the sequence; a difference of sums would lose small gates after a strong one, and a -inf gate
                # would make it NaN); whole: the chunk's decay of each state row ([BT, BK] and [BK, 1] per key
                # channel, [BT, 1] and a scalar per head: a scan of [BT, 1] does not lower)
                next_mask = (rows + 1 < eos) & (rs < BT - 1)
                if PER_CHANNEL:
                    g = tl.load(g_ptr + r64[:, None] * stride_gt + h * stride_gh + ks[None, :], mask=qk_mask,
                                other=0.0).to(tl.float32)
                    g_next = tl.load(g_ptr + (r64 + 1)[:, None] * stride_gt + h * stride_gh + ks[None, :],
                                     mask=next_mask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                    gc = tl.cumsum(g, axis=0)
                    after = tl.cumsum(g_next, axis=0, reverse=True)
                    whole = tl.exp(tl.sum(g, axis=0))[:, None]
                else:
                    g = tl.load(g_ptr + r64 * stride_gt + h, mask=rmask, other=0.0).to(tl.float32)
                    g_next = tl.load(g_ptr + (r64 + 1) * stride_gt + h, mask=next_mask, other=0.0).to(tl.float32)
                    gc = tl.cumsum(g, axis=0)[:, None]
                    after = tl.cumsum(g_next, axis=0, reverse=True)[:, None]
                    whole = tl.exp(tl.sum(g, axis=0))
                u = u - _product(w, s, PRECISION)
                if STORE_OUT:
                    q = tl.load(q_ptr + r64[:, None] * stride_qt + hk * stride_qh + ks[None, :], mask=qk_mask,
                                other=0.0).to(tl.float32)
                    q = _l2_normalize(q, NORMALIZE, 1) * scale
                    aqk = tl.load(aqk_ptr + r64[:, None] * stride_at + h * stride_ah + rs[None, :],
                                  mask=rmask[:, None], other=0.0)
                    o = _product(q * tl.exp(gc), s, PRECISION) + _product(aqk, u, PRECISION)
                    tl.store(out_ptr + r64[:, None] * stride_ot + h * stride_oh + vs[None, :],
                             o.to(out_ptr.dtype.element_ty), mask=v_mask)
                for m in tl.static_range(SNAPSHOTS):  # (token offset in the sequence, slot) pairs; offset -1: none
                    snap_at = tl.load(snap_ptr + 2 * SNAPSHOTS * i + 2 * m) + bos
                    if (snap_at >= c0) & (snap_at < c0 + BT):
                        dest = tl.load(snap_ptr + 2 * SNAPSHOTS * i + 2 * m + 1).to(tl.int64)
                        _store_snapshot(state_ptr, s, k, u, g, g_next, rows, snap_at, dest - slot, s_off, smask,
                                        stride_ss, PRECISION, PER_CHANNEL)
                k_end = k * tl.exp(after)
                s = whole * s + _product(tl.trans(k_end), u, PRECISION)
            _store_state(state_ptr, s, s_off, smask, slot, store_slot_ptr, i, stride_ss)

    @triton.jit
    def _store_snapshot(state_ptr, s, k, u, g, g_next, rows, token, slot_shift, s_off, smask, stride_ss,
                        PRECISION, PER_CHANNEL: tl.constexpr):
        """The state after ``token`` (a row of this chunk) from the state ``s`` at the chunk's start and the
        chunk's new values ``u``, stored ``slot_shift`` slots from the sequence's own. Each row's decay to that
        token is the sum of the gates after it up to the token (``g_next``: each row's successor's gate), as the
        chunk's end decays are; ``g`` and ``g_next`` [BT], or [BT, BK] per key channel."""
        if PER_CHANNEL:
            decay = tl.exp(tl.cumsum(tl.where((rows + 1 <= token)[:, None], g_next, 0.0), axis=0, reverse=True))
            whole = tl.exp(tl.sum(tl.where((rows <= token)[:, None], g, 0.0), axis=0))[:, None]
        else:
            decay = tl.exp(tl.cumsum(tl.where(rows + 1 <= token, g_next, 0.0), axis=0, reverse=True))[:, None]
            whole = tl.exp(tl.sum(tl.where(rows <= token, g, 0.0), axis=0))
        k_snap = tl.where((rows <= token)[:, None], k * decay, 0.0)
        snap = whole * s + _product(tl.trans(k_snap), u, PRECISION)
        tl.store(state_ptr + s_off + slot_shift * stride_ss, snap.to(state_ptr.dtype.element_ty), mask=smask)


def _snapshot_pairs(snapshots: torch.Tensor | None) -> int:
    """The ``(offset, slot)`` pairs a row of ``snapshots`` holds (0 without snapshots)."""
    return 0 if snapshots is None else snapshots.shape[1] // 2


def _check(q, k, v, g, beta, states, slot_ids, num_seqs):
    if not HAS_TRITON:
        raise RuntimeError("the gated delta rule kernels need triton")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != t or hv % hk:
        raise ValueError(f"want q, k [T, Hk, K], v [T, Hv, V] with Hk | Hv; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if beta.shape != (t, hv) or g.shape not in ((t, hv), (t, hv, dk)):
        raise ValueError(f"want beta [T, Hv] and g [T, Hv] or [T, Hv, K]; got {tuple(beta.shape)}, {tuple(g.shape)}")
    if states.dim() != 4 or tuple(states.shape[1:]) != (hv, dk, dv) or states.stride(3) != 1:
        raise ValueError(f"states must be [num_slots, {hv}, {dk}, {dv}] with a contiguous last dim, "
                         f"got {tuple(states.shape)}")
    if slot_ids.shape != (num_seqs,):
        raise ValueError(f"slot_ids must hold one slot per sequence ({num_seqs}), got {tuple(slot_ids.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if beta.stride(1) != 1:
        raise ValueError("beta needs a contiguous last dimension")


def _blocks(dk: int, dv: int, tile: RecurrentTile) -> tuple[int, int]:
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(tile.block_v, triton.next_power_of_2(dv)))
    return bk, bv


#: ``len_below`` of a launch of the token-by-token kernel that runs every sequence.
EVERY_LENGTH = 2**31 - 1


def _launch_recurrent(q, k, v, g, beta, states, slot_ids, has_initial_state, query_start_loc, scale,
                      normalize_qk, num_seqs, decode, store_slot_ids=None, store_output=True, raw_gates=None,
                      snapshots=None, out=None, len_below=EVERY_LENGTH):
    """The token-by-token kernel over the sequences of fewer than ``len_below`` tokens (the others' outputs
    and states left alone), into ``out`` (a new tensor where None)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty_like(v) if out is None else out
    if num_seqs == 0 or t == 0:
        return out
    tile = DECODE_TILES.for_batch(num_seqs) if decode else PREFILL_TILE
    bk, bv = _blocks(dk, dv, tile)
    per_channel = g.dim() == 3
    flags = has_initial_state if has_initial_state is not None else slot_ids
    qsl = query_start_loc if query_start_loc is not None else slot_ids
    dt_bias, a_log = raw_gates if raw_gates is not None else (g, g)
    _recurrent_kernel[(num_seqs, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, out, states, slot_ids, slot_ids if store_slot_ids is None else store_slot_ids, flags, qsl,
        dt_bias, a_log, snapshots if snapshots is not None else slot_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        g.stride(1) if per_channel else 0, beta.stride(0), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        float(dk**-0.5 if scale is None else scale), hv // hk, dk, dv, len_below,
        BK=bk, BV=bv, PER_CHANNEL=per_channel, NORMALIZE=bool(normalize_qk), DECODE=decode,
        HAS_INIT_FLAGS=has_initial_state is not None, STORE_OUT=bool(store_output), RAW_GATES=raw_gates is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, SNAPSHOTS=_snapshot_pairs(snapshots), num_warps=tile.num_warps,
    )
    return out


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           states: torch.Tensor, slot_ids: torch.Tensor, *, has_initial_state: torch.Tensor | None = None,
           scale: float | None = None, normalize_qk: bool = False, dt_bias: torch.Tensor | None = None,
           a_log: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence (``T == N``); ``out [T, Hv, V]``, ``states`` updated in place (module docstring).

    With ``dt_bias`` and ``a_log`` given, ``g`` and ``beta`` are the gates' projections (``f`` and ``b`` of
    kvforge/kernels/triton_delta_gates.py, ``dt_bias`` one value a decay channel, ``a_log`` one a value head)
    and the kernel computes the gates as that kernel does: one launch fewer a step."""
    _check(q, k, v, g, beta, states, slot_ids, q.shape[0])
    raw = None
    if dt_bias is not None or a_log is not None:
        hv, dk = v.shape[1], q.shape[2]
        channels = hv * (dk if g.dim() == 3 else 1)
        if dt_bias is None or a_log is None or dt_bias.numel() != channels or a_log.numel() != hv:
            raise ValueError(f"raw gates need dt_bias of {channels} values and a_log of {hv}, got "
                             f"{None if dt_bias is None else dt_bias.numel()} and "
                             f"{None if a_log is None else a_log.numel()}")
        raw = (dt_bias.reshape(-1).contiguous(), a_log.reshape(-1).contiguous())
    return _launch_recurrent(q, k, v, g, beta, states, slot_ids, has_initial_state, None, scale,
                             normalize_qk, q.shape[0], decode=True, raw_gates=raw)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            states: torch.Tensor, slot_ids: torch.Tensor, query_start_loc: torch.Tensor, *,
            has_initial_state: torch.Tensor | None = None, scale: float | None = None, normalize_qk: bool = False,
            chunk_size: int | None = None, chunked_from: int | None = None,
            store_slot_ids: torch.Tensor | None = None,
            store_output: bool = True, snapshots: torch.Tensor | None = None,
            host_query_lens: Sequence[int] | None = None, form: route.PrefillForm | None = None) -> torch.Tensor:
    """Sequences of any lengths (``query_start_loc``); ``out [T, Hv, V]``, ``states`` updated in place.

    ``chunk_size``: the chunked form in chunks of that many tokens (16 or 32); None takes the route's
    (kvforge/attention/routing/delta_rule.py: by the call's sequences, tokens and gates, and each sequence's
    tokens where ``host_query_lens`` gives them), whose None runs them token by token. ``chunked_from``: with
    the chunked form, the sequences of fewer tokens run token by token in a launch of their own after the
    chunked form's two (0: none; None: the route's where it picks the form, else 0). ``form``: the route's
    answer for this call where the caller already has it (asked once for a step's many layers), in place of
    asking it here; ``chunk_size`` and ``chunked_from`` given still win.

    ``store_slot_ids`` (int32 [N], default ``slot_ids``): ``slot_ids[i]``, or -1 where sequence ``i`` keeps
    its slot's state (it verifies proposals; its accepted rows are replayed later). ``store_output`` False
    computes only the states (that replay); ``out`` is then left unwritten.

    ``snapshots`` (int32 [N, 2 * pairs], optional, pairs a power of two): per sequence ``(offset, slot)``
    pairs, an offset among its tokens of this call (-1: none; no two alike) after which its state is also
    stored at ``slot`` (prefix-cache snapshots taken inside a chunk, kvforge/engine/state_prefix.py)."""
    num_seqs = slot_ids.shape[0]
    _check(q, k, v, g, beta, states, slot_ids, num_seqs)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [N + 1] = [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if store_slot_ids is not None and store_slot_ids.shape != slot_ids.shape:
        raise ValueError(f"store_slot_ids must be [N] = [{num_seqs}], got {tuple(store_slot_ids.shape)}")
    if snapshots is not None:
        pairs = _snapshot_pairs(snapshots) if snapshots.dim() == 2 else 0
        if snapshots.shape != (num_seqs, 2 * pairs) or pairs < 1 or pairs & (pairs - 1):
            raise ValueError(f"snapshots must be [N, 2 * pairs] = [{num_seqs}, 2 * pairs] with a power of two of "
                             f"pairs, got {tuple(snapshots.shape)}")
        if not snapshots.is_contiguous():
            raise ValueError("snapshots must be contiguous (the kernels read row i at 2 * pairs * i)")
    per_channel = g.dim() == 3
    chunked_seqs = None
    if chunk_size is None:
        if form is None:
            form = route.prefill_form(num_seqs, q.shape[0], per_channel, host_query_lens)
        chunk_size = form.chunk_size
        if chunked_from is None:
            chunked_from, chunked_seqs = form.chunked_from, form.chunked_seqs
    len_from = chunked_from or 0  # sequences of fewer tokens run token by token beside the chunked form
    if chunk_size is None:
        return _launch_recurrent(q, k, v, g, beta, states, slot_ids, has_initial_state, query_start_loc, scale,
                                 normalize_qk, num_seqs, decode=False, store_slot_ids=store_slot_ids,
                                 store_output=store_output, snapshots=snapshots)
    if chunk_size not in CHUNK_STATE_STAGES:
        raise ValueError(f"chunk_size must be one of {sorted(CHUNK_STATE_STAGES)} (tl.dot tiles of a power of two "
                         f">= 16 whose state pass fits a Hopper's shared memory), got {chunk_size}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty_like(v)
    if num_seqs == 0 or t == 0:
        return out
    if chunked_seqs is None:
        chunked_seqs = route.chunked_sequences(num_seqs, host_query_lens, len_from)
    tile = CHUNK_STATE_TILES.for_batch(chunked_seqs)
    bk, bv = _blocks(dk, dv, tile)
    flags = has_initial_state if has_initial_state is not None else slot_ids
    # Each sequence's chunks, numbered from chunk_start[i]; a grid of cdiv(T, chunk) + N programs a head covers
    # them (a sequence wastes less than one chunk), with no host sync.
    lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    chunk_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    chunk_start[1:] = torch.cumsum((lens + chunk_size - 1) // chunk_size, 0)
    f32 = dict(dtype=torch.float32, device=q.device)  # route.chunked_buffer_bytes counts these three
    w, u = torch.empty(t, hv, dk, **f32), torch.empty(t, hv, dv, **f32)
    aqk = torch.empty(t, hv, chunk_size, **f32)
    scale = float(dk**-0.5 if scale is None else scale)
    precision = route.product_precision(str(q.dtype).removeprefix("torch."))
    _chunk_prep_kernel[(triton.cdiv(t, chunk_size) + num_seqs, hv)](
        q, k, v, g, beta, slot_ids, query_start_loc, chunk_start, w, u, aqk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        g.stride(1) if per_channel else 0, beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1),
        scale, hv // hk, dk, dv, num_seqs, max(1, num_seqs.bit_length()), len_from,
        BT=chunk_size, BK=bk, BV=_blocks(dk, dv, CHUNK_PREP_TILE)[1], NORMALIZE=bool(normalize_qk),
        PRECISION=precision, PER_CHANNEL=per_channel, BKS=CHUNK_CHANNEL_SLICE,
        num_warps=CHUNK_PREP_TILE.num_warps,
    )
    _chunk_state_kernel[(num_seqs, hv, triton.cdiv(dv, bv))](
        q, k, g, w, u, aqk, out, states, slot_ids, slot_ids if store_slot_ids is None else store_slot_ids, flags,
        query_start_loc, snapshots if snapshots is not None else slot_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1) if per_channel else 0,
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1), out.stride(0),
        out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        scale, hv // hk, dk, dv, len_from,
        BT=chunk_size, BK=bk, BV=bv, NORMALIZE=bool(normalize_qk),
        HAS_INIT_FLAGS=has_initial_state is not None, STORE_OUT=bool(store_output), PRECISION=precision,
        SNAPSHOTS=_snapshot_pairs(snapshots), PER_CHANNEL=per_channel,
        num_warps=tile.num_warps,
        num_stages=CHUNK_STATE_STAGES[chunk_size],
    )
    if len_from:
        _launch_recurrent(q, k, v, g, beta, states, slot_ids, has_initial_state, query_start_loc, scale,
                          normalize_qk, num_seqs, decode=False, store_slot_ids=store_slot_ids,
                          store_output=store_output, snapshots=snapshots, out=out, len_below=len_from)
    return out
