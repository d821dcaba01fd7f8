"""The near-tie rule of tests/greedy_agreement.py accepts rounding ties and rejects real differences."""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import (
    assert_greedy_agrees,
    assert_logprobs_close,
    first_difference,
    margins_from_logprobs,
    top2_margins,
)

TOL = 1e-3


def test_equal_streams_agree_everywhere():
    assert assert_greedy_agrees([1, 2, 3], [1, 2, 3], [5.0, 5.0, 5.0], TOL) == 3


def test_difference_at_a_clear_margin_fails():
    with pytest.raises(AssertionError, match="position 1.*margin is 2 >= tolerance"):
        assert_greedy_agrees([1, 9, 3], [1, 2, 3], [5.0, 2.0, 5.0], TOL)


def test_difference_at_a_near_tie_allows_anything_after():
    assert assert_greedy_agrees([1, 9, 8, 7, 6], [1, 2, 3], [5.0, 1e-5, 5.0], TOL) == 1


def test_early_end_counts_as_a_difference():
    assert first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(AssertionError, match="position 2"):
        assert_greedy_agrees([1, 2], [1, 2, 3], [5.0, 5.0, 5.0], TOL)


def test_margins_from_logits_and_logprobs_agree():
    logits = torch.tensor([[3.0, 1.0, 2.5], [0.0, 0.0, -1.0]])
    assert top2_margins(logits) == pytest.approx([0.5, 0.0])
    lps = torch.log_softmax(logits, dim=-1)
    dicts = [{int(t): float(v) for v, t in zip(*row.topk(2))} for row in lps]
    assert margins_from_logprobs(dicts) == pytest.approx([0.5, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="logprobs >= 2"):
        margins_from_logprobs([{1: -0.1}])


def test_logprobs_within_tolerance_and_ties_at_the_cut():
    want = [{1: -0.1, 2: -2.0, 3: -3.0}]
    assert_logprobs_close([{1: -0.1 + 5e-4, 2: -2.0, 3: -3.0}], want, 1, TOL)
    assert_logprobs_close([{1: -0.1, 2: -2.0, 4: -3.0 + 2e-4}], want, 1, TOL)  # 3 and 4 tie at the cut
    with pytest.raises(AssertionError, match="logprob"):
        assert_logprobs_close([{1: -0.11, 2: -2.0, 3: -3.0}], want, 1, TOL)
    with pytest.raises(AssertionError, match="only one top-N"):
        assert_logprobs_close([{1: -0.1, 2: -2.0, 4: -2.5}], want, 1, TOL)
