"""Triton causal conv1d over state slots: sequences shorter than the kernel, fresh and reused slots.

Where they run (tests/triton_kernel_device.py): compiled on a CUDA GPU; without one, in Triton's CPU
interpreter at small widths. The interpreter runs programs one after another, so it checks what each
program computes, not the ordering between warps; the GPU cases repeat the short-sequence update at
model width many times.

Oracle: the float64 convolution of ``cat(history, x)`` below, ``history`` being the slot's rows
before the call (zeros where ``has_initial_state`` is False). A slot's new state is a copy of inputs
(old rows or tokens, all float32 here), so it must match ``cat(history, x)[-(W - 1):]`` exactly;
slots no sequence owns and padding rows must come back bit-identical. Outputs: float32 arithmetic
over at most 5 taps and a SiLU, within 1e-5 of max(1, max |reference|).
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import DEVICE, gpu_only, requires_kernels

from kvforge.kernels import triton_causal_conv1d as conv_kernels

pytestmark = requires_kernels
OUT_TOL = 1e-5


def conv_reference(x, weight, bias, history):
    """``silu(bias + sum_j weight[:, j] * cat(history, x)[t + j])`` for every token t, in float64."""
    xx = torch.cat([history.double(), x.double()])
    width = weight.shape[1]
    out = bias.double().expand(x.shape[0], -1).clone()
    for j in range(width):
        out += weight[:, j].double() * xx[j:j + x.shape[0]]
    return out * torch.sigmoid(out)


def _assert_out_close(got, want, what):
    bound = OUT_TOL * max(1.0, want.abs().max().item()) if want.numel() else 0.0
    err = (got.double().cpu() - want).abs().max().item() if want.numel() else 0.0
    assert err <= bound, f"{what}: max error {err} > {bound}"


def _slots(num_slots, width, d, gen, nan_slots=()):
    states = torch.randn(num_slots, width - 1, d, generator=gen)
    for s in nan_slots:  # a slot whose previous owner left NaN: only readable with has_initial_state
        states[s] = float("nan")
    return states


def _prefill_and_check(states, lens, slots, init, width, d, gen):
    """One conv1d_prefill call on ``states`` (updated in place, on DEVICE) checked against the oracle."""
    weight, bias = torch.randn(d, width, generator=gen), torch.randn(d, generator=gen)
    x = torch.randn(sum(lens), d, generator=gen)
    before = states.cpu().clone()
    qsl = [0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()]
    out = conv_kernels.conv1d_prefill(
        x.to(DEVICE), states, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE), weight.to(DEVICE), bias.to(DEVICE),
        has_initial_state=torch.tensor(init, device=DEVICE))
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        hist = before[slot] if init[i] else torch.zeros(width - 1, d)
        a, b = qsl[i], qsl[i + 1]
        _assert_out_close(out[a:b], conv_reference(x[a:b], weight, bias, hist), f"sequence {i} ({lens[i]} tokens)")
        assert torch.equal(states[slot].cpu(), torch.cat([hist, x[a:b]])[-(width - 1):]), f"slot {slot}"
    for s in set(range(states.shape[0])) - {s for s in slots if s >= 0}:
        assert torch.equal(states[s].cpu(), before[s]), f"unowned slot {s} changed"


@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("with_state", [True, False], ids=["initial_state", "fresh"])
def test_prefill_of_sequences_shorter_than_the_kernel(width, with_state):
    """Every length 1..W-1 (and W, W+2) in one batch, padding rows between them; fresh slots hold NaN."""
    gen = torch.Generator().manual_seed(width)
    d = 40
    lens = [*range(1, width), width, width + 2]
    slots = list(range(len(lens)))
    lens.insert(1, 3)  # a padding row with tokens
    slots.insert(1, -1)
    init = [with_state] * len(lens)
    num_slots = len(lens) + 2
    states = _slots(num_slots, width, d, gen, nan_slots=() if with_state else range(len(lens) - 1)).to(DEVICE)
    _prefill_and_check(states, lens, slots, init, width, d, gen)


def test_prefill_mixes_fresh_and_continued_short_sequences():
    """Neighbouring slots, shuffled, with and without initial state, and an empty sequence."""
    gen = torch.Generator().manual_seed(11)
    width, d = 4, 70  # two channel blocks of the output kernel; one of the state kernel
    lens = [1, 2, 3, 1, 2, 0, 5, 1, 3]
    slots = [3, 2, 8, -1, 0, 5, 1, 7, 4]
    init = [True, False, True, True, False, True, True, False, False]
    states = _slots(10, width, d, gen, nan_slots=(2, 0, 7, 4)).to(DEVICE)
    _prefill_and_check(states, lens, slots, init, width, d, gen)


def test_slot_reuse_and_continuation_in_short_chunks():
    """A sequence prefilled in chunks of 1..3 tokens (each continuing from its slot) equals one pass
    over its whole input; then a new sequence takes over the slot without its state."""
    gen = torch.Generator().manual_seed(5)
    width, d, num_slots = 4, 24, 4
    weight, bias = torch.randn(d, width, generator=gen), torch.randn(d, generator=gen)
    w_dev, b_dev = weight.to(DEVICE), bias.to(DEVICE)
    states = _slots(num_slots, width, d, gen).to(DEVICE)
    other = states[1].cpu().clone()
    tokens = torch.randn(13, d, generator=gen)
    chunks, outs, pos = [2, 1, 3, 1, 1, 2, 3], [], 0
    for k, n in enumerate(chunks):
        x = tokens[pos:pos + n]
        outs.append(conv_kernels.conv1d_prefill(
            x.to(DEVICE), states, torch.tensor([2, -1], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, n, n], dtype=torch.int32, device=DEVICE), w_dev, b_dev,
            has_initial_state=torch.tensor([k > 0, True], device=DEVICE)).cpu())
        pos += n
    _assert_out_close(torch.cat(outs), conv_reference(tokens, weight, bias, torch.zeros(width - 1, d)), "chunks")
    assert torch.equal(states[2].cpu(), tokens[-(width - 1):])
    # Reuse: slot 2 now belongs to a new sequence of 2 tokens that must not see the previous owner.
    fresh = torch.randn(2, d, generator=gen)
    out = conv_kernels.conv1d_prefill(
        fresh.to(DEVICE), states, torch.tensor([2], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), w_dev, b_dev,
        has_initial_state=torch.tensor([False], device=DEVICE))
    _assert_out_close(out, conv_reference(fresh, weight, bias, torch.zeros(width - 1, d)), "reused slot")
    assert torch.equal(states[2].cpu(), torch.cat([torch.zeros(1, d), fresh]))
    assert torch.equal(states[1].cpu(), other)


@pytest.mark.parametrize("width", [2, 4, 5])
def test_decode_reads_zeros_for_fresh_slots_and_shifts_in_place(width):
    gen = torch.Generator().manual_seed(width + 20)
    d, num_slots = 300, 6  # two channel blocks
    weight, bias = torch.randn(d, width, generator=gen), torch.randn(d, generator=gen)
    slots, init = [4, -1, 1, 0], [True, True, False, False]
    states = _slots(num_slots, width, d, gen, nan_slots=(1, 0))
    before = states.clone()
    dev_states = states.to(DEVICE)
    hist = {i: before[slots[i]] if init[i] else torch.zeros(width - 1, d) for i in (0, 2, 3)}
    for step in range(width + 1):
        x = torch.randn(len(slots), d, generator=gen)
        out = conv_kernels.conv1d_decode(
            x.to(DEVICE), dev_states, torch.tensor(slots, dtype=torch.int32, device=DEVICE), weight.to(DEVICE),
            bias.to(DEVICE), has_initial_state=torch.tensor(init if step == 0 else [True] * len(slots), device=DEVICE))
        for i in (0, 2, 3):
            _assert_out_close(out[i:i + 1], conv_reference(x[i:i + 1], weight, bias, hist[i]), f"step {step} seq {i}")
            hist[i] = torch.cat([hist[i], x[i:i + 1]])[1:]
            assert torch.equal(dev_states[slots[i]].cpu(), hist[i]), f"step {step} slot {slots[i]}"
    for s in (2, 3, 5):
        assert torch.equal(dev_states[s].cpu(), before[s])


@gpu_only
@pytest.mark.parametrize("width", [3, 4])
def test_gpu_short_sequence_state_updates_at_model_width_repeatedly(width):
    """Many 1..W-2 token sequences at D = 8192 (each state program moves old rows within its slot),
    repeated; every repetition's slots must equal the oracle exactly."""
    gen = torch.Generator().manual_seed(width)
    d, n = 8192, 96
    lens = [1 + i % (width - 2) for i in range(n)]
    slots = torch.randperm(n + 8, generator=gen)[:n].tolist()
    for rep in range(20):
        states = _slots(n + 8, width, d, gen).to(DEVICE)
        _prefill_and_check(states, lens, slots, [rep % 2 == 0 or i % 3 == 0 for i in range(n)], width, d, gen)
