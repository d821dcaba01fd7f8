"""Triton gated delta rule (decode over state slots, chunked and recurrent prefill) and conv1d decode.

Where they run (tests/triton_kernel_device.py): compiled on a CUDA GPU; without one, in Triton's
CPU interpreter at tiny shapes. The large shapes (128-wide heads, decode batches up to 256, long
prompts, bf16 inputs) are GPU only.

Oracle: the float64 loops of tests/delta_rule_oracle.py on the same inputs, per sequence, from
the state each slot held (or zeros where ``has_initial_state`` is False). Slots no sequence owns
must come back bit-identical (the kernels write only their own slots), padding rows (slot -1)
must leave everything untouched, and the output rows of real sequences must be finite.

Tolerances, relative to max |reference| (float32 arithmetic, see tests/test_gated_delta_rule.py
for the derivation): recurrent kernels 2e-5 (interpreter) / 1e-4 (GPU: hardware exp and rsqrt
differ from correctly rounded ones by a few ulps); chunked kernel 1e-4 (a triangular inverse
over a chunk and a different summation order); bf16 inputs (GPU) 1e-2 (the output is rounded to
bf16, 2^-9 relative).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from delta_rule_oracle import conv_float64, naive_float64, random_inputs, rel_err
from triton_kernel_device import (
    DEVICE,
    INTERPRETED,
    gpu_only,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.attention import linear_state
from kvforge.attention.delta_rule_gates import DeltaGates
from kvforge.attention.linear_state import LinearStateLayout, LinearStates, SlotBatch
from kvforge.kernels import triton_causal_conv1d as conv_kernels
from kvforge.kernels import triton_gated_delta_rule as kernels

pytestmark = requires_kernels
REC_TOL = 2e-5 if INTERPRETED else 1e-4
CHUNK_TOL = 1e-4


@pytest.fixture(autouse=True)
def _loops_over_loaded_bounds():
    skip_unless_loaded_loop_bounds_work()


def _batch(lens, hk, hv, dk, dv, per_channel, seed, repeated_keys=False):
    """Flat inputs of sequences of ``lens`` tokens (concatenated), on DEVICE."""
    parts = [random_inputs(n, hk, hv, dk, dv, per_channel, seed=seed + i, repeated_keys=repeated_keys)
             for i, n in enumerate(lens)]
    return [torch.cat([p[j] for p in parts]).to(DEVICE) for j in range(5)]


@pytest.fixture
def token_by_token_where_none(monkeypatch):
    """A test's ``chunk_size`` None runs token by token: the route names no chunk either."""
    monkeypatch.setattr(kernels.route, "PREFILL_CHUNK_SIZE", None)


def _run_and_check(lens, slots, init, *, hk=2, hv=4, dk=16, dv=24, per_channel=False, num_slots=7,
                   chunk_size=16, tol=CHUNK_TOL, seed=0, dtype=torch.float32, repeated_keys=False,
                   fresh_slots_hold=None, chunked_from=None):
    q, k, v, g, beta = _batch(lens, hk, hv, dk, dv, per_channel, seed, repeated_keys)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    gen = torch.Generator().manual_seed(seed + 100)
    states = (0.3 * torch.randn(num_slots, hv, dk, dv, generator=gen)).to(DEVICE)
    if fresh_slots_hold is not None:  # what a slot held before its new sequence (e.g. NaN: a poisoned slot)
        for slot, fresh in zip(slots, init):
            if slot >= 0 and not fresh:
                states[slot] = fresh_slots_hold
    before = states.clone()
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    flags = torch.tensor(init, dtype=torch.bool, device=DEVICE)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    if all(n == 1 for n in lens):
        out = kernels.decode(q, k, v, g, beta, states, slot_ids, has_initial_state=flags, normalize_qk=True)
    else:
        out = kernels.prefill(q, k, v, g, beta, states, slot_ids, qsl, has_initial_state=flags,
                              normalize_qk=True, chunk_size=chunk_size, chunked_from=chunked_from)
    owned = set()
    for i, n in enumerate(lens):
        a, b = int(qsl[i]), int(qsl[i + 1])
        if slots[i] < 0:
            continue
        owned.add(slots[i])
        s0 = before[slots[i]].cpu() if init[i] else None
        ref_out, ref_s = naive_float64(*(x[a:b].cpu() for x in (q, k, v, g, beta)), s0)
        assert torch.isfinite(out[a:b]).all()
        assert rel_err(out[a:b].cpu(), ref_out) < tol, (i, n)
        assert rel_err(states[slots[i]].cpu(), ref_s) < tol, (i, n)
    for s in range(num_slots):
        if s not in owned:
            assert torch.equal(states[s], before[s]), f"slot {s} is owned by no sequence but changed"
    return out, states


@pytest.mark.parametrize("large_tile", [False, True], ids=["small_tile", "large_tile"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_decode_over_slots_with_padding_and_fresh_sequences(per_channel, large_tile, monkeypatch):
    if large_tile:  # the tile of large batches, at four sequences
        monkeypatch.setattr(kernels, "DECODE_TILES", dataclasses.replace(kernels.DECODE_TILES, large_from_seqs=1))
    assert kernels.DECODE_TILES.for_batch(4) == (kernels.DECODE_TILES.large if large_tile
                                                 else kernels.DECODE_TILES.small)
    # 40 value channels: two masked blocks of 32 on the small tile, one of 64 on the large
    _run_and_check([1, 1, 1, 1], [5, -1, 0, 2], [True, True, False, True], dv=40, per_channel=per_channel,
                   tol=REC_TOL)


@pytest.mark.parametrize("form", ["chunked_scalar_gate", "chunked_per_channel_gate", "recurrent_scalar_gate",
                                  "recurrent_per_channel_gate"])
def test_prefill_lengths_the_chunk_does_not_divide(form, monkeypatch):
    monkeypatch.setattr(kernels.route, "PREFILL_CHUNK_SIZE", None)  # chunk_size None: token by token
    per_channel = form.endswith("channel_gate")
    if form.startswith("recurrent"):  # token by token: the interpreter runs every op of every token, keep it short
        _run_and_check([1, 9, 3], [3, 6, 1], [True, False, True], dv=40, per_channel=per_channel,
                       chunk_size=None, tol=REC_TOL, seed=3)
    else:  # two value blocks (40 > 32 columns), chunks of 16 over 17 and 40 tokens
        _run_and_check([1, 17, 40], [3, 6, 1], [True, False, True], dv=40, per_channel=per_channel, seed=3)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_finds_each_chunks_sequence(chunk, per_channel):
    """The chunked form's per-chunk programs find their sequence among empty and padding sequences (slot -1) and
    sequences of one to several chunks; per-channel gates over 32 key channels, two of the pairwise decays'
    slices."""
    _run_and_check([5, 0, 40, 3, 1, 133], [2, -1, 0, -1, 4, 5], [True, False, False, True, True, False],
                   chunk_size=chunk, seed=chunk, per_channel=per_channel, dk=32 if per_channel else 16)


@pytest.mark.parametrize("lens", [[40], [17, 40]], ids=["one_sequence", "two_sequences"])
def test_chunked_tiles_cover_every_value_channel(lens, monkeypatch):
    """The state pass's tile follows the call's chunked sequences (``CHUNK_STATE_TILES``: narrow for one, wide from
    two: its grid's value blocks say which ran) and the per-chunk program has its own (``CHUNK_PREP_TILE``); with
    80 value channels each walks several value blocks, the last part-masked, and every channel matches float64."""
    grids = []
    real = kernels._chunk_state_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(kernels, "_chunk_state_kernel", Spy())
    tiles = kernels.CHUNK_STATE_TILES
    tile = tiles.small if len(lens) < tiles.large_from_seqs else tiles.large
    assert tiles.small.block_v != tiles.large.block_v and 80 % tiles.small.block_v and 80 % tiles.large.block_v
    _run_and_check(lens, [1, 0][:len(lens)], [True, False][:len(lens)], hk=1, hv=2, dv=80, chunk_size=16, seed=41)
    assert grids == [(len(lens), 2, -(-80 // tile.block_v))]


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_short_sequences_run_token_by_token_beside_the_chunked_ones(per_channel):
    """``chunked_from``: the sequences of fewer tokens (empty, padding, one token, under the bound) run token by
    token in a launch of their own and the others chunked, each against float64 with its own slot, and no
    program of one form touches a sequence of the other (every other slot unchanged, every output right)."""
    _run_and_check([5, 0, 40, 3, 1, 133, 8], [2, -1, 0, -1, 4, 5, 6], [True, False, False, True, True, False, True],
                   chunk_size=16, chunked_from=8, seed=31, per_channel=per_channel, dk=32 if per_channel else 16,
                   num_slots=9)


@pytest.mark.parametrize("chunk", [None, 16, "split"], ids=["token_by_token", "chunked", "split"])
@pytest.mark.parametrize("store_output", [True, False])
def test_a_verifying_sequence_keeps_its_slot(chunk, store_output):
    """``store_slot_ids`` -1 (a sequence verifying proposals) leaves that slot as it was while its outputs are
    computed from it; the other sequence's slot takes its final state. ``store_output`` False (the replay of
    accepted rows) still stores the states."""
    lens, slots, hv, dk, dv = [7, 20], [1, 3], 2, 16, 16
    q, k, v, g, beta = _batch(lens, 1, hv, dk, dv, False, 11)
    states = (0.3 * torch.randn(4, hv, dk, dv, generator=torch.Generator().manual_seed(12))).to(DEVICE)
    before = states.clone()
    qsl = [0, 7, 27]
    out = kernels.prefill(q, k, v, g, beta, states, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                          torch.tensor(qsl, dtype=torch.int32, device=DEVICE), normalize_qk=True,
                          chunk_size=16 if chunk == "split" else chunk, chunked_from=8 if chunk == "split" else None,
                          store_slot_ids=torch.tensor([-1, 3], dtype=torch.int32, device=DEVICE),
                          store_output=store_output)  # split: the verifying sequence (7 tokens) token by token
    assert torch.equal(states[1], before[1]) and torch.equal(states[0], before[0]) and torch.equal(states[2], before[2])
    for i, slot in enumerate(slots):
        a, b = qsl[i], qsl[i + 1]
        want_out, want_state = naive_float64(*(x[a:b].cpu() for x in (q, k, v, g, beta)), before[slot].cpu())
        if store_output:
            assert rel_err(out[a:b].cpu(), want_out) < CHUNK_TOL, i
        if slot == 3:
            assert rel_err(states[3].cpu(), want_state) < CHUNK_TOL


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_prefill_stores_snapshots_inside_a_sequence(per_channel):
    """``snapshots``: the state after a given token of a sequence also lands in a given slot (two for one
    sequence, four for another, none for a third), each equal to the float64 state over that prefix; the
    sequences' own slots take their final states and every other slot is untouched. Token by token, in
    chunks of 16 and 32, and in chunks of 16 with the two short sequences token by token: snapshots after a sequence's first token, in a first, middle and last chunk, two in
    one chunk, at a chunk's last token and at the sequence's last token."""
    lens, slots, init, hv, dk, dv = [9, 40, 5], [1, 3, 5], [True, False, True], 2, 16, 24
    q, k, v, g, beta = _batch(lens, 1, hv, dk, dv, per_channel, 21)
    snaps = [[0, 0, 8, 2, -1, -1, -1, -1], [15, 4, 33, 6, 5, 7, 20, 8], [-1] * 8]  # two in sequence 1's first chunk
    num_slots = 10
    for chunk, chunked_from in ((None, None), (16, None), (32, None), (16, 10)):  # 10: 9 and 5 token by token
        tol = REC_TOL if chunk is None else CHUNK_TOL
        states = (0.3 * torch.randn(num_slots, hv, dk, dv, generator=torch.Generator().manual_seed(22))).to(DEVICE)
        before = states.clone()
        qsl = [0, 9, 49, 54]
        out = kernels.prefill(q, k, v, g, beta, states, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                              torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                              has_initial_state=torch.tensor(init, device=DEVICE), normalize_qk=True,
                              chunk_size=chunk, chunked_from=chunked_from,
                              snapshots=torch.tensor(snaps, dtype=torch.int32, device=DEVICE))
        written = set(slots)
        for i, slot in enumerate(slots):
            a, b = qsl[i], qsl[i + 1]
            s0 = before[slot].cpu() if init[i] else None
            want_out, want_state = naive_float64(*(x[a:b].cpu() for x in (q, k, v, g, beta)), s0)
            assert rel_err(out[a:b].cpu(), want_out) < tol and rel_err(states[slot].cpu(), want_state) < tol
            for offset, dest in zip(snaps[i][0::2], snaps[i][1::2]):
                if offset >= 0:
                    _, want_snap = naive_float64(*(x[a:a + offset + 1].cpu() for x in (q, k, v, g, beta)), s0)
                    assert rel_err(states[dest].cpu(), want_snap) < tol, (chunk, i, offset)
                    written.add(dest)
        for slot in set(range(num_slots)) - written:
            assert torch.equal(states[slot], before[slot]), slot


def test_chunked_prefill_allocates_what_the_route_counts(monkeypatch):
    """The chunked form's float32 buffers are the bytes the planner reserves for them
    (``delta_rule.chunked_buffer_bytes``)."""
    from kvforge.attention.routing import delta_rule

    allocated = []

    class TorchSpy:  # the kernel module's torch, recording its float32 ``empty`` buffers
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *shape, dtype=None, device=None):
            x = torch.empty(*shape, dtype=dtype, device=device)
            if dtype == torch.float32:
                allocated.append(x.numel() * 4)
            return x

    monkeypatch.setattr(kernels, "torch", TorchSpy())
    lens, hk, hv, dk, dv, chunk = [5, 20], 1, 2, 16, 16, 16
    q, k, v, g, beta = _batch(lens, hk, hv, dk, dv, False, 0)
    kernels.prefill(q, k, v, g, beta, torch.zeros(2, hv, dk, dv, device=DEVICE),
                    torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                    torch.tensor([0, 5, 25], dtype=torch.int32, device=DEVICE), chunk_size=chunk)
    assert sum(allocated) == delta_rule.chunked_buffer_bytes(sum(lens), hv, dk, dv, chunk) > 0


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_keeps_small_gates_after_strong_ones(chunk, per_channel):
    """Strong decays (-80 a token, the 8th -5000) for the first 8 tokens of each chunk, then nearly none
    (-1e-3): every decay between rows, and from a row to the chunk's end, is a sum of its own gates, so the
    small gates are not lost beside a large one (a difference of sums in float32 is off by 1e-5 or more here).
    Per key channel, half the channels decay strongly throughout besides: a factorisation into ``exp(G)`` and
    ``exp(-G)`` would overflow."""
    hk, hv, dk, dv, n = 1, 2, 16, 16, 64
    q, k, v, g, beta = _batch([n], hk, hv, dk, dv, per_channel, 40)
    g = torch.full_like(g, -1e-3)
    for c0 in range(0, n, chunk):
        g[c0:c0 + 8] = -80.0
        g[c0 + 7] = -5000.0  # the row whose decay to the chunk's end is the tiny gates after it alone
    if per_channel:
        g[:, :, : dk // 2] = -80.0
    states = torch.zeros(1, hv, dk, dv, device=DEVICE)
    out = kernels.prefill(q, k, v, g, beta, states, torch.tensor([0], dtype=torch.int32, device=DEVICE),
                          torch.tensor([0, n], dtype=torch.int32, device=DEVICE), normalize_qk=True, chunk_size=chunk)
    want_out, want_state = naive_float64(*(x.cpu() for x in (q, k, v, g, beta)), None)
    assert rel_err(out.cpu(), want_out) < 1e-5 and rel_err(states[0].cpu(), want_state) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
@pytest.mark.parametrize("chunk", [16, 32, None], ids=["chunks_of_16", "chunks_of_32", "token_by_token"])
def test_a_gate_of_minus_infinity_resets_the_state(chunk, per_channel, token_by_token_where_none):
    """A gate of -inf (a full reset of the state, or of a key channel) inside a chunk and at a chunk's start:
    every decay across it is 0, never NaN, and a snapshot after it holds only what followed."""
    n, hv, dk, dv = 40, 2, 16, 16
    q, k, v, g, beta = _batch([n], 1, hv, dk, dv, per_channel, 45)
    g[5] = float("-inf")
    g[16] = float("-inf")
    states = (0.3 * torch.randn(3, hv, dk, dv, generator=torch.Generator().manual_seed(46))).to(DEVICE)
    before = states.clone()
    snaps = torch.tensor([[3, 1, 20, 2]], dtype=torch.int32, device=DEVICE)
    out = kernels.prefill(q, k, v, g, beta, states, torch.tensor([0], dtype=torch.int32, device=DEVICE),
                          torch.tensor([0, n], dtype=torch.int32, device=DEVICE), normalize_qk=True,
                          chunk_size=chunk, snapshots=snaps)
    want_out, want_state = naive_float64(*(x.cpu() for x in (q, k, v, g, beta)), before[0].cpu())
    tol = REC_TOL if chunk is None else CHUNK_TOL
    assert torch.isfinite(out).all() and torch.isfinite(states).all()
    assert rel_err(out.cpu(), want_out) < tol and rel_err(states[0].cpu(), want_state) < tol
    for offset, dest in ((3, 1), (20, 2)):
        _, want_snap = naive_float64(*(x[:offset + 1].cpu() for x in (q, k, v, g, beta)), before[0].cpu())
        assert rel_err(states[dest].cpu(), want_snap) < tol, offset


def test_prefill_takes_the_route_s_form_unless_a_chunk_is_named(monkeypatch):
    """The route (kvforge/attention/routing/delta_rule.py) picks the form from the call's sequences and tokens:
    up to the route's bound of long sequences run chunked beside short ones while they hold enough tokens for
    each short one, the short ones then token by token in a launch of their own where the caller gives the
    lengths; short ones alone (verification rows) and too many long ones token by token (each sequence's length
    where the caller gives them, else the mean), per-channel gates token by token unless the route takes them,
    and every call token by token where the route names no chunk; a chunk named by the caller runs chunked."""
    launched = []

    class Spy:  # records which kernel a launch (``kernel[grid](...)``) runs
        def __init__(self, name):
            self.name, self.real = name, getattr(kernels, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.real[grid]

    for name in ("_recurrent_kernel", "_chunk_state_kernel"):
        monkeypatch.setattr(kernels, name, Spy(name))
    monkeypatch.setattr(kernels.route, "PREFILL_CHUNK_SIZE", 16)
    monkeypatch.setattr(kernels.route, "CHUNKED_MAX_SEQUENCES", 2)
    monkeypatch.setattr(kernels.route, "CHUNKED_MIN_TOKENS", 8)
    monkeypatch.setattr(kernels.route, "CHUNKED_TOKENS_PER_SHORT", 4)

    def call(lens, **kw):
        q, k, v, g, beta = _batch(lens, 1, 1, 16, 16, False, 0)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        kernels.prefill(q, k, v, g, beta, torch.zeros(len(lens), 1, 16, 16, device=DEVICE),
                        torch.arange(len(lens), dtype=torch.int32, device=DEVICE), qsl, **kw)
        return tuple(launched.pop(0) for _ in list(launched))

    chunked, recurrent, split = ("_chunk_state_kernel",), ("_recurrent_kernel",), (
        "_chunk_state_kernel", "_recurrent_kernel")  # split: the short sequences token by token after the chunks
    assert call([3]) == recurrent  # 3 tokens a sequence: under the route's mean
    assert call([3], chunk_size=16) == chunked  # a named chunk runs every sequence chunked
    assert call([1, 9], chunk_size=16, chunked_from=8) == split
    assert call([8]) == chunked
    assert call([4, 12]) == chunked  # the mean decides: 8 a sequence, and no lengths to split by
    assert call([4, 11]) == recurrent
    assert call([8, 8, 8]) == recurrent  # more sequences than the route's bound
    assert call([1, 1, 1, 12]) == recurrent  # by the mean: 3.75 a sequence
    assert call([1, 1, 1, 12], host_query_lens=[1, 1, 1, 12]) == split  # one long beside 3 short
    assert call([1, 1, 1, 1, 12], host_query_lens=[1, 1, 1, 1, 12]) == recurrent  # 3 tokens a short one
    assert call([9, 2, 9], host_query_lens=[9, 2, 9]) == split
    assert call([9, 9], host_query_lens=[9, 9]) == chunked  # none short: one launch
    assert call([12, 0, 0, 0], host_query_lens=[12, 0, 0, 0]) == chunked  # padding rows are not short ones
    assert call([9, 9, 9], host_query_lens=[9, 9, 9]) == recurrent  # three long
    form = kernels.route.prefill_form(4, 15, lengths=[1, 1, 1, 12])
    assert form == kernels.route.PrefillForm(16, chunked_from=8, chunked_seqs=1)
    assert call([1, 1, 1, 12], form=form) == split  # a form the caller holds: the route is not asked again
    assert call([1, 1, 1, 12], form=kernels.route.PrefillForm(None), host_query_lens=[1, 1, 1, 12]) == recurrent
    assert call([1, 1, 1, 12], form=form, chunked_from=0) == chunked  # a split named by the caller wins
    assert call([1, 1, 1, 12], form=form, chunk_size=16) == chunked  # and so does a chunk
    assert kernels.route.prefill_form(2, 18, lengths=[9, 9]) == kernels.route.PrefillForm(16, 0, 2)
    assert kernels.route.prefill_form(3, 27, lengths=[9, 9, 9]) == kernels.route.PrefillForm(None)
    monkeypatch.setattr(kernels.route, "SHORT_TOKEN_BY_TOKEN", False)
    assert call([9, 2, 9], host_query_lens=[9, 2, 9]) == chunked
    monkeypatch.setattr(kernels.route, "SHORT_TOKEN_BY_TOKEN", True)
    assert call([8], snapshots=torch.tensor([[3, 0, -1, -1]], dtype=torch.int32, device=DEVICE)) == (
        chunked)  # the chunked form stores snapshots too
    def per_channel_call(lens):
        q, k, v, _, beta = _batch(lens, 1, 1, 16, 16, False, 0)
        g = -torch.rand(sum(lens), 1, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        kernels.prefill(q, k, v, g, beta, torch.zeros(len(lens), 1, 16, 16, device=DEVICE),
                        torch.arange(len(lens), dtype=torch.int32, device=DEVICE), qsl)
        return tuple(launched.pop(0) for _ in list(launched))

    monkeypatch.setattr(kernels.route, "PER_CHANNEL_CHUNKED", False)
    assert per_channel_call([8]) == recurrent  # per-channel gates keep token by token
    monkeypatch.setattr(kernels.route, "PER_CHANNEL_CHUNKED", True)
    assert per_channel_call([8]) == chunked
    monkeypatch.setattr(kernels.route, "PREFILL_CHUNK_SIZE", None)
    assert call([8]) == recurrent
    assert launched == []


@pytest.mark.parametrize("lens, chunk", [([1, 1, 1], 16), ([1, 17, 9], 16), ([1, 7, 3], None)],
                         ids=["decode", "chunked_prefill", "recurrent_prefill"])
def test_a_fresh_sequence_never_reads_its_slot(lens, chunk):
    """A slot that held NaN (a request that overflowed, or never-written memory) starts its next sequence from
    zeros: a fresh sequence's state is masked off, not multiplied by zero (NaN x 0 is NaN)."""
    _run_and_check(lens, [4, 2, 0], [True, False, False], fresh_slots_hold=float("nan"), chunk_size=chunk,
                   tol=CHUNK_TOL if chunk and lens != [1, 1, 1] else REC_TOL, seed=5)


def test_chunked_prefill_with_repeated_keys():
    """Nearly identical keys with beta ~ 1: the chunk's triangular inverse must be solved, not series-expanded."""
    _run_and_check([40], [0], [False], hk=1, hv=1, num_slots=1, chunk_size=32, repeated_keys=True, seed=8)


def _model_layout_inputs(lens, hk, hv, dk, dv, seed):
    """Inputs laid out as a Gated DeltaNet layer passes them: q, k and v are strided views of one conv output
    ``[T, 2 * hk * dk + hv * dv]`` (row stride wider than a head block), and the gates have the decay range of
    ``-exp(A_log) * softplus(a + dt_bias)`` with ``A`` in (0, 16): from almost none to ``exp(-40)`` per token."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    mixed = torch.nn.functional.silu(torch.randn(t, 2 * hk * dk + hv * dv, generator=gen))
    q, k, v = mixed.to(DEVICE).split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    decay_rate = torch.cat([torch.tensor([0.05]), torch.empty(hv - 1).uniform_(0.5, 16.0, generator=gen)])
    g = -decay_rate * torch.nn.functional.softplus(torch.randn(t, hv, generator=gen) + 1.0)
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    return q, k, v, g.to(DEVICE), beta.to(DEVICE)


@pytest.mark.parametrize("lens, chunk", [([70, 23], 16), ([16, 5], 16), ([16, 5], None)],
                         ids=["full_and_partial_chunks", "one_chunk_each", "token_by_token"])
def test_prefill_on_the_model_layout(lens, chunk):
    """Both prefill forms on a Gated DeltaNet layer's own inputs (strided views, 2 value heads per key head,
    16-wide heads, strong decays), a fresh sequence and one continuing its slot, against the float64 oracle."""
    hk, hv, dk, dv = 2, 4, 16, 16
    q, k, v, g, beta = _model_layout_inputs(lens, hk, hv, dk, dv, seed=len(lens) + lens[0])
    assert q.stride(0) == 2 * hk * dk + hv * dv and not q.is_contiguous()
    states = 0.3 * torch.randn(3, hv, dk, dv, generator=torch.Generator().manual_seed(4))
    before = states.clone()
    states = states.to(DEVICE)
    slots, init = [2, 0], [False, True]
    qsl = [0, lens[0], lens[0] + lens[1]]
    out = kernels.prefill(q, k, v, g, beta, states, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                          torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                          has_initial_state=torch.tensor(init, device=DEVICE), normalize_qk=True, chunk_size=chunk)
    for i, (slot, has_state) in enumerate(zip(slots, init)):
        a, b = qsl[i], qsl[i + 1]
        want_out, want_state = naive_float64(*(x[a:b].cpu() for x in (q, k, v, g, beta)),
                                             before[slot] if has_state else None)
        assert rel_err(out[a:b].cpu(), want_out) < CHUNK_TOL, i
        assert rel_err(states[slot].cpu(), want_state) < CHUNK_TOL, i
    assert torch.equal(states[1].cpu(), before[1])


@pytest.mark.parametrize("chunk", [16, None], ids=["chunked", "token_by_token"])
def test_prefill_split_across_calls_equals_one_call(chunk, token_by_token_where_none):
    lens = [37]
    q, k, v, g, beta = _batch(lens, 2, 4, 16, 16, False, 5)
    one = torch.zeros(2, 4, 16, 16, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    out_one = kernels.prefill(q, k, v, g, beta, one, slot, torch.tensor([0, 37], dtype=torch.int32, device=DEVICE),
                              normalize_qk=True, chunk_size=chunk)
    split = torch.zeros_like(one)
    outs = []
    for a, b in [(0, 5), (5, 21), (21, 36), (36, 37)]:
        x = [t[a:b] for t in (q, k, v, g, beta)]
        if b - a == 1:
            outs.append(kernels.decode(*x, split, slot, normalize_qk=True))
        else:
            qsl = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
            outs.append(kernels.prefill(*x, split, slot, qsl, normalize_qk=True, chunk_size=chunk))
    assert rel_err(torch.cat(outs).cpu(), out_one.double().cpu()) < CHUNK_TOL
    assert rel_err(split[1].cpu(), one[1].double().cpu()) < CHUNK_TOL
    assert torch.equal(split[0], one[0])  # slot 0 untouched by both (zeros)


def test_bad_snapshots_are_named():
    q, k, v, g, beta = _batch([3, 4], 1, 1, 16, 16, False, 0)
    args = (q, k, v, g, beta, torch.zeros(4, 1, 16, 16, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE))
    wide = torch.full((2, 8), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.prefill(*args, snapshots=wide[:, :4])
    with pytest.raises(ValueError, match="power of two of pairs"):
        kernels.prefill(*args, snapshots=wide[:, :6].contiguous())
    with pytest.raises(ValueError, match="power of two of pairs"):
        kernels.prefill(*args, snapshots=wide[:1].contiguous())


@pytest.mark.parametrize("bad", [24, 8, 64])
def test_bad_chunk_size_is_named(bad):
    q, k, v, g, beta = _batch([3], 1, 1, 16, 16, False, 0)
    with pytest.raises(ValueError, match="one of \\[16, 32\\]"):
        kernels.prefill(q, k, v, g, beta, torch.zeros(1, 1, 16, 16, device=DEVICE),
                        torch.zeros(1, dtype=torch.int32, device=DEVICE),
                        torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), chunk_size=bad)


def test_conv1d_decode_steps_match_float64_and_shift_the_state():
    gen = torch.Generator().manual_seed(0)
    n, d, width, num_slots = 3, 40, 4, 5
    weight, bias = torch.randn(d, width, generator=gen), torch.randn(d, generator=gen)
    states = torch.randn(num_slots, width - 1, d, generator=gen)
    before = states.clone()
    slots, init = [4, -1, 1], [True, True, False]
    hist = {i: (before[slots[i]] if init[i] else torch.zeros(width - 1, d)) for i in (0, 2)}
    dev_states = states.to(DEVICE)
    for step in range(3):
        x = torch.randn(n, d, generator=gen)
        out = conv_kernels.conv1d_decode(
            x.to(DEVICE), dev_states, torch.tensor(slots, dtype=torch.int32, device=DEVICE), weight.to(DEVICE),
            bias.to(DEVICE), has_initial_state=torch.tensor(init if step == 0 else [True] * n, device=DEVICE))
        for i in (0, 2):
            want = conv_float64(x[i:i + 1], weight, bias, hist[i])
            assert rel_err(out[i:i + 1].cpu(), want) < 1e-5
            hist[i] = torch.cat([hist[i], x[i:i + 1]])[1:]
            assert torch.equal(dev_states[slots[i]].cpu(), hist[i])  # the shift copies values: exact
    for s in (0, 2, 3):
        assert torch.equal(dev_states[s].cpu(), before[s])


def test_conv1d_prefill_matches_float64_and_leaves_each_slot_its_last_inputs():
    _check_conv1d_prefill(70, [1, 2, 9, 3, 4], [4, 1, -1, 0, 5], [True, True, True, False, True])


@gpu_only
def test_gpu_conv1d_prefill_at_model_width():
    _check_conv1d_prefill(8192, [1, 300, 2, 17, 64], [3, 0, 5, 1, 2], [True, False, True, True, False])


def _check_conv1d_prefill(d, lens, slots, init):
    gen = torch.Generator().manual_seed(3)
    width, num_slots = 4, 6
    weight, bias = torch.randn(d, width, generator=gen), torch.randn(d, generator=gen)
    states = torch.randn(num_slots, width - 1, d, generator=gen)
    x = torch.randn(sum(lens), d, generator=gen)
    dev_states = states.clone().to(DEVICE)  # a copy also on CPU: `states` keeps the values before
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    out = conv_kernels.conv1d_prefill(
        x.to(DEVICE), dev_states, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE), weight.to(DEVICE), bias.to(DEVICE),
        has_initial_state=torch.tensor(init, device=DEVICE))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        hist = states[slot] if init[i] else torch.zeros(width - 1, d)
        a, b = qsl[i], qsl[i + 1]
        assert rel_err(out[a:b].cpu(), conv_float64(x[a:b], weight, bias, hist)) < 1e-5, i
        assert torch.equal(dev_states[slot].cpu(), torch.cat([hist, x[a:b]])[-(width - 1):])  # copies: exact
    for s in sorted(set(range(num_slots)) - set(slots)):  # slots no sequence names stay as they were
        assert torch.equal(dev_states[s].cpu(), states[s])


def _raw_gates(n, hv, head_dim, gen, dev) -> DeltaGates:
    """Gate projections of ``n`` tokens (``f`` of ``hv * head_dim`` channels, ``b`` of ``hv``) and the two
    parameters, in float32: decays from ~-0.02 to ~-6, write strengths over (0, 1)."""
    f = 2.0 * torch.randn(n, hv * head_dim, generator=gen)
    b = 2.0 * torch.randn(n, hv, generator=gen)
    dt_bias = torch.randn(hv * head_dim, generator=gen)
    a_log = 0.5 * torch.randn(hv, generator=gen)
    return DeltaGates(*(t.to(dev) for t in (f, dt_bias, a_log, b)), head_dim)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_decode_computing_its_gates_equals_decode_over_computed_gates(per_channel):
    """The recurrent kernel given the gates' projections (``dt_bias``, ``a_log``) against the same kernel given
    the gates of the PyTorch formulas (kvforge/models/delta_gates.py): float32 exp and log in both, so the
    outputs and states agree to float32 rounding; and both against the float64 definition."""
    from kvforge.models.delta_gates import delta_gates_reference

    hk, hv, dk, dv, n = 2, 4, 16, 24, 3
    gen = torch.Generator().manual_seed(5)
    q, k, v, _, _ = _batch([1] * n, hk, hv, dk, dv, per_channel, seed=8)
    gates = _raw_gates(n, hv, dk if per_channel else 1, gen, DEVICE)
    g, beta = delta_gates_reference(gates.f, gates.dt_bias, gates.a_log, gates.b, gates.head_dim)
    g = g.view(n, hv, dk) if per_channel else g
    start = (0.3 * torch.randn(n + 1, hv, dk, dv, generator=gen)).to(DEVICE)
    slot_ids = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE)
    f, b = gates.projections()
    fused_states, plain_states = start.clone(), start.clone()
    fused = kernels.decode(q, k, v, f, b, fused_states, slot_ids, normalize_qk=True, dt_bias=gates.dt_bias,
                           a_log=gates.a_log)
    plain = kernels.decode(q, k, v, g, beta, plain_states, slot_ids, normalize_qk=True)
    assert rel_err(fused.cpu(), plain.cpu().double()) < 1e-5
    assert rel_err(fused_states.cpu(), plain_states.cpu().double()) < 1e-5
    for i, slot in enumerate(slot_ids.tolist()):
        want_out, want_state = naive_float64(*(x[i:i + 1].cpu() for x in (q, k, v, g, beta)), start[slot].cpu())
        assert rel_err(fused[i:i + 1].cpu(), want_out) < REC_TOL
        assert rel_err(fused_states[slot].cpu(), want_state) < REC_TOL
    assert torch.equal(fused_states[1], start[1])  # no sequence's slot: untouched


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_linear_states_kernel_path_equals_reference_path(per_channel, monkeypatch):
    """LinearStates dispatches to the kernels (prefill and decode steps, slots, fresh sequences; the decode
    step's recurrent kernel computing the gates from the layer's projections) and gets what its PyTorch path
    gets: outputs and every slot after each step."""
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", DEVICE))
    hk, hv, dk, dv, width = 1, 2, 16, 16, 4
    layout = LinearStateLayout(conv_channels=2 * hk * dk + hv * dv, conv_width=width, num_value_heads=hv,
                               key_dim=dk, value_dim=dv, num_key_heads=hk, gate_per_channel=per_channel)
    weight = torch.randn(layout.conv_channels, width, generator=torch.Generator().manual_seed(0))
    runs = {}
    for on_kernels in (True, False):
        dev = DEVICE if on_kernels else "cpu"
        gen = torch.Generator().manual_seed(2)  # the same inputs for both paths
        states = LinearStates.allocate({0: layout}, 4, torch.float32, dev)
        for t in (states.conv[0], states.recurrent[0]):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
        if not on_kernels:
            monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ())
        outs = []
        # step 1: two prompts (slots 2 and 0, fresh); step 2: both decode; step 3: a third prompt joins a decode
        for lens, slots, init in (([9, 3], [2, 0], [False, False]), ([1, 1], [2, 0], [True, True]),
                                  ([1, 5, 1], [2, 3, 0], [True, False, True])):
            n = sum(lens)
            x = torch.randn(n, layout.conv_channels, generator=gen)
            gates = _raw_gates(n, hv, dk if per_channel else 1, gen, dev)
            states.set_batch(SlotBatch.build(lens, slots, init, dev))
            mixed = states.short_conv(0, x.to(dev), weight.to(dev), None)
            q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
            o = states.delta_rule(0, q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), gates)
            outs.append((mixed.cpu(), o.cpu(), states.conv[0].cpu().clone(), states.recurrent[0].cpu().clone()))
        runs[on_kernels] = outs
    for got, want in zip(runs[True], runs[False]):
        for a, b in zip(got, want):
            assert rel_err(a, b.double()) < CHUNK_TOL


def test_rounding_to_tf32_nearest_matches_its_definition():
    """``_to_tf32_nearest`` against the rounding written in float64: 11 significant bits (at most 2^-136 apart
    below float32's normal range), to nearest with ties away from zero; infinities and NaN kept, values at or
    past the halfway point above the largest tf32 to infinity, those just below it to that largest."""
    from kvforge.kernels.optional_triton import tl, triton

    @triton.jit
    def rounded(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, kernels._to_tf32_nearest(tl.load(x_ptr + offs)))

    tie = 1 + 2.0**-11  # halfway between 1 and 1 + 2^-10
    special = [1.0, tie, -tie, 1 + 3 * 2.0**-11, tie - 2.0**-23, tie + 2.0**-23, 3.0e38, 3.4028234e38,
               float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39, 2.0**-126, 0.1, -0.1]
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(238, generator=gen) * torch.exp2(torch.randint(-130, 127, (238,), generator=gen).float())
    below_halfway = torch.tensor([0x7F7FEFFF], dtype=torch.int32).view(torch.float32)  # to tf32's largest
    x = torch.cat([torch.tensor(special), below_halfway, spread[:-1]]).to(torch.float32)
    y = torch.empty_like(x, device=DEVICE)
    rounded[(1,)](x.to(DEVICE), y, N=256)
    xd = x.double()
    mantissa, exponent = torch.frexp(xd)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    quantum = torch.exp2((torch.clamp(exponent, min=-125) - 11).double())
    want = (torch.sign(xd) * torch.floor(xd.abs() / quantum + 0.5) * quantum).to(torch.float32)
    finite = torch.isfinite(x)
    assert torch.equal(y.cpu()[finite], want[finite])
    assert torch.equal(y.cpu()[torch.isinf(x)], x[torch.isinf(x)])
    assert torch.isnan(y.cpu()[torch.isnan(x)]).all()
    assert y[1].item() == 1 + 2.0**-10 and y[2].item() == -(1 + 2.0**-10) and y[7].item() == float("inf")
    assert y[len(special)].item() == (2 - 2.0**-10) * 2.0**127


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_tf32_nearest_products_keep_the_chunked_form_within_their_rounding(per_channel, monkeypatch):
    """Every product of the chunked form at "tf32-nearest" (one tf32 product of operands rounded to nearest),
    bf16 inputs, against the rule in float64 from the same inputs: the states within 1.5e-3 (relative L2;
    operands at 11 significant bits, 4-9e-4 at these 32-channel heads, where dropping the bits instead gives
    about three times that: benchmarks/delta_rule_product_precision.py), and above 1e-4, so the rounded form
    ran (tf32x3 keeps them ~1e-7 off, and Triton's interpreter multiplies float32 exactly whatever the
    precision)."""
    monkeypatch.setattr(kernels.route, "PRODUCT_PRECISION", {"bfloat16": "tf32-nearest"})
    lens, hk, hv, dk, dv = [64, 48, 80], 1, 2, 32, 32
    q, k, v, g, beta = _batch(lens, hk, hv, dk, dv, per_channel, seed=7)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    states = torch.zeros(len(lens), hv, dk, dv, device=DEVICE)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = kernels.prefill(q, k, v, g, beta, states, torch.arange(len(lens), dtype=torch.int32, device=DEVICE), qsl,
                          normalize_qk=True, chunk_size=16)
    for i in range(len(lens)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        _, want_state = naive_float64(*(x[a:b].cpu() for x in (q, k, v, g, beta)))
        assert 1e-4 < rel_err(states[i].cpu(), want_state) < 1.5e-3, i
        assert torch.isfinite(out[a:b]).all(), i


def test_a_step_asks_the_delta_rule_route_once_for_all_its_layers(monkeypatch):
    """The route's host work grows with a step's rows, so LinearStates asks it once a step
    (``SlotBatch.delta_rule_form``, per gate kind) and each layer's prefill takes that form; a new step asks
    again."""
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", DEVICE))
    asked = []
    real = kernels.route.prefill_form
    monkeypatch.setattr(kernels.route, "prefill_form", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    hk, hv, dk, dv = 1, 2, 16, 16
    layout = LinearStateLayout(conv_channels=2 * hk * dk + hv * dv, conv_width=4, num_value_heads=hv, key_dim=dk,
                               value_dim=dv, num_key_heads=hk, gate_per_channel=False)
    states = LinearStates.allocate({0: layout, 1: layout}, 3, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(3)
    for step, lens in enumerate(([40, 1], [2, 1])):
        n = sum(lens)
        states.set_batch(SlotBatch.build(lens, [0, 1], [bool(step), False], DEVICE))
        for layer in (0, 1):
            q, k = (torch.randn(n, hk, dk, generator=gen).to(DEVICE) for _ in range(2))
            v = torch.randn(n, hv, dv, generator=gen).to(DEVICE)
            states.delta_rule(layer, q, k, v, _raw_gates(n, hv, 1, gen, DEVICE))
        assert len(asked) == step + 1
        assert asked[-1][3] == tuple(lens)


@pytest.mark.parametrize("on_kernels", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_a_snapshot_inside_a_step_equals_the_state_of_that_prefix_alone(per_channel, on_kernels, monkeypatch):
    """A 10-token chunk with snapshots after its tokens 2 and 5 (into free slots) leaves there the conv and
    recurrent states that steps of only its first 3 and 6 tokens leave in their own slots (the conv states
    exactly: they are copies of inputs), beside the chunk's own final state; beside it a second sequence with
    none."""
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", DEVICE) if on_kernels else ())
    dev = DEVICE if on_kernels else "cpu"
    hk, hv, dk, dv, width = 1, 2, 16, 16, 4
    layout = LinearStateLayout(conv_channels=2 * hk * dk + hv * dv, conv_width=width, num_value_heads=hv,
                               key_dim=dk, value_dim=dv, num_key_heads=hk, gate_per_channel=per_channel)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(layout.conv_channels, width, generator=gen).to(dev)
    x = torch.randn(13, layout.conv_channels, generator=gen).to(dev)
    gates = _raw_gates(13, hv, dk if per_channel else 1, gen, dev)
    start = LinearStates.allocate({0: layout}, 6, torch.float32, dev)
    for t in (start.conv[0], start.recurrent[0]):
        t.copy_(torch.randn(t.shape, generator=gen))

    def step(states, rows, lens, slots, init, snapshots=()):
        states.set_batch(SlotBatch.build(lens, slots, init, dev, snapshots=snapshots))
        mixed = states.short_conv(0, x[rows], weight, None)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        n = len(rows)
        g = DeltaGates(gates.f[rows], gates.dt_bias, gates.a_log, gates.b[rows], gates.head_dim)
        return states.delta_rule(0, q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g)

    whole = LinearStates({0: start.conv[0].clone()}, {0: start.recurrent[0].clone()})
    out = step(whole, list(range(13)), [10, 3], [1, 4], [True, False], snapshots=[(0, 2, 0), (0, 5, 3)])
    for prefix, dest in ((3, 0), (6, 3)):
        alone = LinearStates({0: start.conv[0].clone()}, {0: start.recurrent[0].clone()})
        out_alone = step(alone, list(range(prefix)), [prefix], [1], [True])
        assert torch.equal(whole.conv[0][dest], alone.conv[0][1])
        assert rel_err(whole.recurrent[0][dest].cpu(), alone.recurrent[0][1].cpu().double()) < CHUNK_TOL
        assert rel_err(out[:prefix].cpu(), out_alone.cpu().double()) < CHUNK_TOL
    for slot in (2, 5):  # no sequence's and no snapshot's
        assert torch.equal(whole.conv[0][slot], start.conv[0][slot])
        assert torch.equal(whole.recurrent[0][slot], start.recurrent[0][slot])


# ------------------------------------------------------------------------------ GPU only
@gpu_only
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_gpu_decode_batches_at_model_shapes(batch, per_channel):
    slots = torch.randperm(batch + 3, generator=torch.Generator().manual_seed(batch))[:batch].tolist()
    _run_and_check([1] * batch, slots, [True] * batch, hk=16, hv=32, dk=128, dv=128, per_channel=per_channel,
                   num_slots=batch + 3, tol=REC_TOL, seed=batch)


@gpu_only
@pytest.mark.parametrize("per_channel", [False, True], ids=["qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("chunk_size", [16, 32, None])
def test_gpu_prefill_at_model_shapes(chunk_size, per_channel, token_by_token_where_none):
    """Qwen3-Next's layer (16 key heads, 32 value heads, per-head gates) and Kimi-Linear's (32 heads,
    per-channel gates), K = V = 128."""
    _run_and_check([1, 100, 333], [2, 0, 4], [False, True, True], hk=32 if per_channel else 16, hv=32, dk=128,
                   dv=128, num_slots=5, chunk_size=chunk_size, seed=chunk_size or 1, per_channel=per_channel)


@gpu_only
@pytest.mark.parametrize("chunk_size", [16, 32, None])
def test_gpu_prefill_with_repeated_keys(chunk_size, token_by_token_where_none):
    _run_and_check([200, 64], [1, 0], [True, False], hk=2, hv=4, dk=128, dv=128, num_slots=2,
                   chunk_size=chunk_size, repeated_keys=True, seed=chunk_size or 1)


@gpu_only
@pytest.mark.parametrize("chunk_size", [16, None])
def test_gpu_bf16_inputs(chunk_size):
    _run_and_check([1, 65, 130], [1, 2, 0], [True, True, False], hk=4, hv=8, dk=128, dv=128, num_slots=3,
                   tol=1e-2, dtype=torch.bfloat16, chunk_size=chunk_size)
