"""Grouping routed rows by expert and summing them back per token (kvforge/models/expert_rows.py),
against a float64 loop over tokens and slots written here."""

from __future__ import annotations

import pytest
import torch

from kvforge.models.expert_rows import group_by_expert, weighted_sum_per_token


def _routing(tokens: int, k: int, experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return ids, weights


@pytest.mark.parametrize("tokens,k,experts", [(1, 1, 4), (7, 3, 8), (64, 6, 64), (33, 8, 256)])
def test_groups_are_sorted_stable_and_counted(tokens, k, experts):
    ids, _ = _routing(tokens, k, experts, seed=tokens)
    rows = group_by_expert(ids.reshape(-1), experts, k)
    flat = ids.reshape(-1).tolist()
    want = sorted(range(len(flat)), key=lambda r: (flat[r], r))  # by expert, then by row
    assert rows.order.tolist() == want
    assert rows.expert.tolist() == [flat[r] for r in want]
    assert rows.tokens.tolist() == [r // k for r in want]
    counts = [flat.count(e) for e in range(experts)]
    assert rows.offs.dtype == torch.int32
    assert rows.offs.tolist() == [sum(counts[:e + 1]) for e in range(experts)]


def _reference(x, ids, weights, w1, held=None):
    """out[t] = sum over held slots j of weights[t, j] * (x[t] @ w1[ids[t, j]]), in float64."""
    out = torch.zeros(x.shape[0], w1.shape[-1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if held is None or held[t, j]:
                out[t] += weights[t, j].double() * (x[t].double() @ w1[ids[t, j]].double())
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_weighted_sum_matches_a_per_token_loop(dtype, tol):
    tokens, k, experts, hidden = 19, 4, 8, 32
    ids, weights = _routing(tokens, k, experts, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = torch.randn(experts, hidden, hidden, generator=g).to(dtype)
    rows = group_by_expert(ids.reshape(-1), experts, k)
    y = torch.stack([x[t] @ w1[e] for t, e in zip(rows.tokens.tolist(), rows.expert.tolist())])  # sorted rows
    got = weighted_sum_per_token(y, rows, weights)
    assert got.dtype == dtype
    want = _reference(x, ids, weights, w1)
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_slots_held_elsewhere_add_nothing_even_when_their_rows_are_garbage():
    tokens, k, experts, hidden = 11, 3, 6, 16
    ids, weights = _routing(tokens, k, experts, seed=5)
    held = ids < 3  # this rank holds experts 0..2
    flat = torch.where(held, ids, torch.full_like(ids, 3)).reshape(-1)
    rows = group_by_expert(flat, 3, k)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, hidden, hidden, generator=g)
    y = torch.full((tokens * k, hidden), float("nan"))  # rows past offs[-1] are never computed
    for p, (t, e) in enumerate(zip(rows.tokens.tolist(), rows.expert.tolist())):
        if e < 3:
            y[p] = x[t] @ w1[e]
    assert int(rows.offs[-1]) == int(held.sum())
    got = weighted_sum_per_token(y, rows, weights, held)
    want = _reference(x, ids, weights, w1, held)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
