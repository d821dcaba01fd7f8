"""Grouping routed rows by expert and summing them back per token (kvforge/models/expert_rows.py),
against a float64 loop over tokens and slots written here; each test runs the PyTorch path and the Triton
kernels (kvforge/kernels/triton_expert_rows.py: compiled on a GPU, else in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import route_fixture

from kvforge.models import expert_rows
from kvforge.models.expert_rows import group_by_expert, weighted_sum_per_token

device = route_fixture(expert_rows, "TRITON_ROWS", "TRITON_ROWS_DEVICES")


def _kernel_ran(rows, device) -> bool:
    """The path under test served: rows grouped where the Triton sum serves carry ``inverse``, the PyTorch
    path's do not."""
    return (rows.inverse is not None) == expert_rows.TRITON_ROWS


def _routing(tokens: int, k: int, experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return ids, weights


@pytest.mark.parametrize("tokens,k,experts", [(1, 1, 4), (7, 3, 8), (64, 6, 64), (33, 8, 256), (256, 8, 512)])
def test_groups_are_sorted_stable_and_counted(device, tokens, k, experts):
    ids, _ = _routing(tokens, k, experts, seed=tokens)
    rows = group_by_expert(ids.reshape(-1).to(device), experts, k)
    assert _kernel_ran(rows, device)
    flat = ids.reshape(-1).tolist()
    want = sorted(range(len(flat)), key=lambda r: (flat[r], r))  # by expert, then by row
    assert rows.order.tolist() == want
    assert rows.expert.tolist() == [flat[r] for r in want]
    assert rows.tokens.tolist() == [r // k for r in want]
    counts = [flat.count(e) for e in range(experts)]
    assert rows.offs.dtype == torch.int32
    assert rows.offs.tolist() == [sum(counts[:e + 1]) for e in range(experts)]
    assert rows.order.dtype == rows.tokens.dtype == torch.int64 and rows.expert.dtype == ids.dtype
    if rows.inverse is not None:  # the sorted position of every flat row: order's inverse permutation
        assert rows.order[rows.inverse].tolist() == list(range(len(flat)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_held_elsewhere_sort_last_in_row_order(device, dtype):
    """Ids equal to ``num_experts`` mark slots of experts on another rank: after every held row, by row."""
    ids = torch.tensor([3, 0, 3, 2, 3, 0, 1, 3], dtype=dtype)
    rows = group_by_expert(ids.to(device), 3, 2)
    assert rows.order.tolist() == [1, 5, 6, 3, 0, 2, 4, 7]
    assert rows.expert.tolist() == [0, 0, 1, 2, 3, 3, 3, 3]
    assert rows.offs.tolist() == [2, 3, 4]
    assert rows.tokens.tolist() == [0, 2, 3, 1, 0, 1, 2, 3]


@torch.no_grad()
def test_the_rule_sends_decode_sized_steps_to_the_kernel(monkeypatch):
    monkeypatch.setattr(expert_rows, "TRITON_ROWS", True)
    monkeypatch.setattr(expert_rows, "TRITON_ROWS_DEVICES", ("meta",))
    ids = torch.zeros(expert_rows.TRITON_ROWS_MAX, dtype=torch.int64, device="meta")
    assert expert_rows.use_triton_rows(ids, 256)
    assert not expert_rows.use_triton_rows(torch.zeros(expert_rows.TRITON_ROWS_MAX + 1, device="meta"), 256)
    assert not expert_rows.use_triton_rows(torch.zeros(0, device="meta"), 256)
    assert not expert_rows.use_triton_rows(torch.zeros(8, dtype=torch.int64), 256)  # cpu: not listed
    with torch.enable_grad():
        assert not expert_rows.use_triton_rows(ids, 256)
    monkeypatch.setattr(expert_rows, "TRITON_ROWS", False)
    assert not expert_rows.use_triton_rows(ids, 256)


def test_kernel_refuses_what_it_cannot_sort():
    from kvforge.kernels import triton_expert_rows as k

    with pytest.raises(ValueError, match="rows with one program"):
        k.group_rows(torch.zeros(k.MAX_ROWS + 1, dtype=torch.int64), 8, 1, counting=False)
    with pytest.raises(ValueError, match="rows with the counting sort"):
        k.group_rows(torch.zeros(k.COUNTING_MAX_ROWS + 1, dtype=torch.int64), 8, 1)
    with pytest.raises(ValueError, match="overflow the int32 sort keys"):
        k.group_rows(torch.zeros(4096, dtype=torch.int64), 2**20, 1, counting=False)
    assert k.sorts(k.COUNTING_MAX_ROWS, 8) and not k.sorts(k.COUNTING_MAX_ROWS + 1, 8) and not k.sorts(0, 8)
    assert not k.sorts(k.ONE_PROGRAM_MAX_ROWS, 2**23) and k.sorts(k.ONE_PROGRAM_MAX_ROWS + 1, 2**22)


@pytest.mark.parametrize("counting", [False, True])
@pytest.mark.parametrize("tokens,k,experts", [(1, 6, 64), (43, 6, 64), (100, 11, 513), (300, 2, 5)])
def test_both_triton_sorts_give_the_stable_order(device, counting, tokens, k, experts):
    """The one-program sort and the counting sort (chunks of ``CHUNK_ROWS``: here one partial chunk, two,
    five, three) each give the stable order, counts, tokens and inverse, with some rows held elsewhere
    (id ``experts``)."""
    from kvforge.kernels import triton_expert_rows

    if not expert_rows.TRITON_ROWS:
        pytest.skip("the Triton sorts alone: the PyTorch path is tested above")
    ids, _ = _routing(tokens, k, experts, seed=tokens + k)
    flat_ids = ids.reshape(-1)
    flat_ids[5::7] = experts
    order, offs, expert, toks, inverse = triton_expert_rows.group_rows(flat_ids.to(device), experts, k,
                                                                       counting=counting)
    flat = flat_ids.tolist()
    want = sorted(range(len(flat)), key=lambda r: (flat[r], r))
    assert order.tolist() == want
    assert expert.tolist() == [flat[r] for r in want]
    assert toks.tolist() == [r // k for r in want]
    counts = [flat.count(e) for e in range(experts)]
    assert offs.tolist() == [sum(counts[:e + 1]) for e in range(experts)]
    assert inverse.tolist() == sorted(range(len(flat)), key=lambda r: want[r])  # order's inverse permutation


def _reference(x, ids, weights, w1, held=None):
    """out[t] = sum over held slots j of weights[t, j] * (x[t] @ w1[ids[t, j]]), in float64."""
    out = torch.zeros(x.shape[0], w1.shape[-1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if held is None or held[t, j]:
                out[t] += weights[t, j].double() * (x[t].double() @ w1[ids[t, j]].double())
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_weighted_sum_matches_a_per_token_loop(device, dtype, tol):
    tokens, k, experts, hidden = 19, 4, 8, 32
    ids, weights = _routing(tokens, k, experts, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = torch.randn(experts, hidden, hidden, generator=g).to(dtype)
    rows = group_by_expert(ids.reshape(-1).to(device), experts, k)
    assert _kernel_ran(rows, device)
    y = torch.stack([x[t] @ w1[e] for t, e in zip(rows.tokens.tolist(), rows.expert.tolist())])  # sorted rows
    got = weighted_sum_per_token(y.to(device), rows, weights.to(device)).cpu()
    assert got.dtype == dtype
    want = _reference(x, ids, weights, w1)
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_an_addend_joins_the_sum_before_its_rounding(device, dtype, tol):
    """A MoE layer's shared experts' output rides in the sum: ``addend[t] + sum_j w * y``, one rounding (the
    bf16 bound is the one rounding's, relative to the largest value)."""
    tokens, k, experts, hidden = 9, 2, 5, 24
    ids, weights = _routing(tokens, k, experts, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = torch.randn(experts, hidden, hidden, generator=g).to(dtype)
    addend = torch.randn(tokens, hidden, generator=g).mul(3).to(dtype)
    rows = group_by_expert(ids.reshape(-1).to(device), experts, k)
    assert _kernel_ran(rows, device)
    y = torch.stack([x[t] @ w1[e] for t, e in zip(rows.tokens.tolist(), rows.expert.tolist())])
    got = weighted_sum_per_token(y.to(device), rows, weights.to(device), addend=addend.to(device)).cpu()
    want = _reference(x, ids, weights, w1) + addend.double()
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_steps_too_large_for_the_sort_kernel_still_sum_in_the_kernel(device, monkeypatch):
    """Past ``TRITON_ROWS_MAX`` rows PyTorch sorts; where the sum kernel serves, one scatter gives it
    ``inverse`` (order's inverse permutation) and the sum equals the per-token loop."""
    monkeypatch.setattr(expert_rows, "TRITON_ROWS_MAX", 8)
    tokens, k, experts, hidden = 13, 3, 5, 16
    ids, weights = _routing(tokens, k, experts, seed=9)
    rows = group_by_expert(ids.reshape(-1).to(device), experts, k)
    assert _kernel_ran(rows, device)
    if rows.inverse is not None:
        assert rows.order[rows.inverse].tolist() == list(range(tokens * k))
    g = torch.Generator().manual_seed(10)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, hidden, hidden, generator=g)
    y = torch.stack([x[t] @ w1[e] for t, e in zip(rows.tokens.tolist(), rows.expert.tolist())])
    got = weighted_sum_per_token(y.to(device), rows, weights.to(device)).cpu()
    want = _reference(x, ids, weights, w1)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_slots_held_elsewhere_add_nothing_even_when_their_rows_are_garbage(device):
    tokens, k, experts, hidden = 11, 3, 6, 16
    ids, weights = _routing(tokens, k, experts, seed=5)
    held = ids < 3  # this rank holds experts 0..2
    flat = torch.where(held, ids, torch.full_like(ids, 3)).reshape(-1)
    rows = group_by_expert(flat.to(device), 3, k)
    assert _kernel_ran(rows, device)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, hidden, hidden, generator=g)
    y = torch.full((tokens * k, hidden), float("nan"))  # rows past offs[-1] are never computed
    for p, (t, e) in enumerate(zip(rows.tokens.tolist(), rows.expert.tolist())):
        if e < 3:
            y[p] = x[t] @ w1[e]
    assert int(rows.offs[-1]) == int(held.sum())
    got = weighted_sum_per_token(y.to(device), rows, weights.to(device), held.to(device)).cpu()
    want = _reference(x, ids, weights, w1, held)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
