"""Rolling linear-attention state back to the accepted tokens of a speculative verify step.

One step over the state slots holds a fresh prompt chunk, two sequences verifying proposals (1 + 3 and
1 + 1 rows) and a decoding sequence. Every output row must equal the float64 definition of the rule and
the conv (tests/delta_rule_oracle.py) continuing the slot's state; the verifying sequences' slots must
still hold the state before the step (bit for bit), the others the state after their rows. Then
``keep_verified`` replays the accepted rows: each verifying slot must hold the state of a run over its
accepted rows only, computed by the oracle from the state before the step, i.e. the state a run without
speculation reaches over the same tokens; slots it does not name must not change.

The reference path runs in float64 (tolerance 1e-10: the same arithmetic up to summation order); the
Triton kernels (compiled on CUDA, else in Triton's interpreter) in float32, with the kernel tests'
tolerances. Conv states are copies of inputs, so they are compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from delta_rule_oracle import naive_float64, random_inputs, rel_err

from kvforge.attention import linear_state
from kvforge.attention.delta_rule_gates import GateValues
from kvforge.attention.linear_state import LinearStateLayout, LinearStates, SlotBatch

HK, HV, DK, DV, WIDTH = 1, 2, 16, 16, 4
K_SPEC = 3
NUM_SLOTS = 6
# (rows, slot, has_initial_state, proposals verified): a fresh prompt chunk, two verifying sequences, a decode.
SEQS = [(7, 4, False, 0), (1 + K_SPEC, 1, True, K_SPEC), (2, 3, True, 1), (1, 0, True, 0)]


def _layout(per_channel: bool) -> LinearStateLayout:
    return LinearStateLayout(conv_channels=2 * HK * DK + HV * DV, conv_width=WIDTH, num_value_heads=HV, key_dim=DK,
                             value_dim=DV, num_key_heads=HK, gate_per_channel=per_channel)


def _conv_float64(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """SiLU of the causal depthwise conv over ``cat(history, x)``, tap by tap; and the last W - 1 rows."""
    xx = torch.cat([history.double(), x.double()])
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(WIDTH):
            out[t] += weight[:, j].double() * xx[t + j]
    return out * torch.sigmoid(out), xx[-(WIDTH - 1):]


def _step_and_keep(per_channel: bool, kept: dict[int, int], on_kernels: bool, monkeypatch):
    """Run the step, check it against the oracle, keep ``kept`` rows (slot -> rows) and check again."""
    if on_kernels:
        device = pytest.importorskip("triton_kernel_device")
        if not device.KERNELS_RUN:
            pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
        device.skip_unless_loaded_loop_bounds_work()
        dev, dtype, tol = device.DEVICE, torch.float32, 1e-4
        monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", dev))
    else:
        dev, dtype, tol = "cpu", torch.float64, 1e-10
        monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ())
    layout = _layout(per_channel)
    gen = torch.Generator().manual_seed(3)
    states = LinearStates.allocate({0: layout}, NUM_SLOTS, dtype, dev, verify_rows=K_SPEC + 1)
    conv0 = torch.randn(states.conv[0].shape, generator=gen, dtype=torch.float64)
    rec0 = 0.3 * torch.randn(states.recurrent[0].shape, generator=gen, dtype=torch.float64)
    states.conv[0].copy_(conv0)
    states.recurrent[0].copy_(rec0)
    conv0, rec0 = states.conv[0].cpu().double().clone(), states.recurrent[0].cpu().double().clone()  # as stored

    total = sum(n for n, *_ in SEQS)
    q, k, v, g, beta = (x.to(dtype) for x in random_inputs(total, HK, HV, DK, DV, per_channel=per_channel, seed=4))
    x = torch.randn(total, layout.conv_channels, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(layout.conv_channels, WIDTH, generator=gen, dtype=torch.float64).to(dtype)
    batch = SlotBatch.build([n for n, *_ in SEQS], [s for _, s, _, _ in SEQS], [h for _, _, h, _ in SEQS], dev,
                            spec_lens=[p for *_, p in SEQS], verify_rows=K_SPEC + 1)
    states.set_batch(batch)
    conv_out = states.short_conv(0, x.to(dev), weight.to(dev), None, "silu").cpu()
    rule_out = states.delta_rule(0, *(t.to(dev) for t in (q, k, v)), GateValues(g.to(dev), beta.to(dev)),
                                 normalize_qk=True).cpu()
    states.batch = None

    start = 0
    for n, slot, has_init, proposals in SEQS:
        rows = slice(start, start + n)
        hist = conv0[slot] if has_init else torch.zeros_like(conv0[slot])
        s0 = rec0[slot] if has_init else None
        want_conv, conv_after = _conv_float64(hist, x[rows], weight)
        want_rule, rule_after = naive_float64(q[rows], k[rows], v[rows], g[rows], beta[rows], s0)
        assert rel_err(conv_out[rows], want_conv) < tol, (slot, "conv output")
        assert rel_err(rule_out[rows], want_rule) < tol, (slot, "rule output")
        if proposals:  # a verifying sequence's slot keeps the state before the step, untouched
            assert torch.equal(states.conv[0][slot].cpu().double(), conv0[slot])
            assert torch.equal(states.recurrent[0][slot].cpu().double(), rec0[slot])
        else:
            assert torch.equal(states.conv[0][slot].cpu().double(), conv_after.to(dtype).double())
            assert rel_err(states.recurrent[0][slot].cpu(), rule_after) < tol
        start += n
    before_keep = (states.conv[0].cpu().clone(), states.recurrent[0].cpu().clone())

    states.keep_verified(list(kept), list(kept.values()))
    start = 0
    for n, slot, _, _ in SEQS:
        if slot in kept:
            acc = slice(start, start + kept[slot])  # the sequence's real token and its accepted proposals
            _, conv_want = _conv_float64(conv0[slot], x[acc], weight)
            _, rule_want = naive_float64(q[acc], k[acc], v[acc], g[acc], beta[acc], rec0[slot])
            assert torch.equal(states.conv[0][slot].cpu().double(), conv_want.to(dtype).double()), slot
            assert rel_err(states.recurrent[0][slot].cpu(), rule_want) < tol, slot
        start += n
    for slot in set(range(NUM_SLOTS)) - set(kept):
        assert torch.equal(states.conv[0][slot].cpu(), before_keep[0][slot])
        assert torch.equal(states.recurrent[0][slot].cpu(), before_keep[1][slot])


KEPT = {"none_accepted": {1: 1, 3: 1}, "some_accepted": {1: 3, 3: 1}, "all_accepted": {1: 1 + K_SPEC, 3: 2}}


@pytest.mark.parametrize("kept", KEPT.values(), ids=KEPT.keys())
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_reference_path_rolls_back_to_the_accepted_rows(per_channel, kept, monkeypatch):
    _step_and_keep(per_channel, kept, on_kernels=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("kept", KEPT.values(), ids=KEPT.keys())
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_kernels_roll_back_to_the_accepted_rows(per_channel, kept, monkeypatch):
    _step_and_keep(per_channel, kept, on_kernels=True, monkeypatch=monkeypatch)


def test_a_verify_step_needs_verify_rows():
    states = LinearStates.allocate({0: _layout(False)}, 2, torch.float32, "cpu")
    batch = SlotBatch.build([2], [0], [True], "cpu", spec_lens=[1], verify_rows=2)
    with pytest.raises(RuntimeError, match="keep no verify rows"):
        states.set_batch(batch)
    with pytest.raises(ValueError, match="keeps 2 verify rows"):
        SlotBatch.build([4], [0], [True], "cpu", spec_lens=[3], verify_rows=2)


def test_keep_verified_refuses_more_rows_than_a_verify_step_has():
    states = LinearStates.allocate({0: _layout(False)}, 2, torch.float32, "cpu", verify_rows=2)
    with pytest.raises(ValueError, match="3 rows to keep, a verify step has 1 .. 2"):
        states.keep_verified([0], [3])


def test_step_slot_batches_copy_without_blocking():
    """An eager step's slot batch (slots, held-state flags, verify rows, snapshots) reaches the device by
    non-blocking copies (pinned on CUDA), so building it never waits for the step in flight."""
    from blocking_copies import BlockingCopies

    mode = BlockingCopies()
    with mode:
        batch = SlotBatch.build([3, 2], [0, 1], [True, False], "cpu", spec_lens=[2, 0], verify_rows=3,
                                snapshots=[(1, 0, 2)])
    assert batch.verifies and batch.snapshots is not None and mode.calls == []
