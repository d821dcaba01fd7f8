"""Verification functions (kvforge/speculative/verify.py) on their own.

Rejection sampling: the first emitted token must be distributed as the target distribution ``p``
whatever the proposal distribution ``q``. Checked with a chi-square goodness-of-fit test of N draws
(one fixed seed per draw, so the test is deterministic) against ``p`` itself, the independent
reference. Threshold: the test fails when p-value < 1e-3. The same test applied to a biased
acceptance rule (always accept the proposal) must reject, which shows the test has the power to fail.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.engine.sampling_params import SamplingParams
from kvforge.speculative.verify import (
    accept_greedy,
    rejection_sample,
    rejection_sample_batch,
    verify_proposals,
)

P_VALUE_THRESHOLD = 1e-3
N = 6000
TARGET = torch.tensor([0.30, 0.05, 0.25, 0.15, 0.20, 0.05])
PROPOSAL = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.05, 0.10])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic of ``counts`` against ``probs`` (df = bins - 1)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def first_tokens(draw) -> torch.Tensor:
    counts = torch.zeros(TARGET.numel(), dtype=torch.long)
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        counts[draw(g)] += 1
    return counts


def test_distribution_proposals_keep_the_target_distribution():
    second = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([TARGET, second, second])

    def draw(g):
        proposals = torch.multinomial(PROPOSAL, 2, replacement=True, generator=g).tolist()
        return rejection_sample(target, proposals, torch.stack([PROPOSAL, PROPOSAL]), g)[0]

    assert chi_square_p_value(first_tokens(draw), TARGET) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("proposal", [0, 1, 3])
def test_point_mass_proposals_keep_the_target_distribution(proposal):
    # An n-gram proposal is a fixed token: q is a point mass on it.
    target = torch.stack([TARGET, TARGET])
    assert chi_square_p_value(first_tokens(lambda g: rejection_sample(target, [proposal], None, g)[0]),
                              TARGET) > P_VALUE_THRESHOLD


def test_no_proposals_samples_the_target():
    assert chi_square_p_value(first_tokens(lambda g: rejection_sample(TARGET[None], [], None, g)[0]),
                              TARGET) > P_VALUE_THRESHOLD


def test_the_chi_square_test_rejects_a_biased_rule():
    def always_accept(g):
        return int(torch.multinomial(PROPOSAL, 1, generator=g))

    assert chi_square_p_value(first_tokens(always_accept), TARGET) < P_VALUE_THRESHOLD


def test_second_token_after_acceptance_follows_its_row():
    # Given the first proposal was accepted, the next emitted token is distributed as row 1.
    row1 = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])
    target = torch.stack([torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), row1])  # proposal 2 always accepted
    counts = first_tokens(lambda g: rejection_sample(target, [2], None, g)[1])
    assert chi_square_p_value(counts, row1) > P_VALUE_THRESHOLD


def test_certain_and_impossible_proposals():
    g = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert rejection_sample(certain, [1, 2], None, g) == [1, 2, 0]
    assert rejection_sample(certain, [0, 2], None, g) == [1]  # p(0) = 0: rejected, residual is all on 1


def test_accept_greedy():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted + the bonus token
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept_greedy([1, 5, 6, 7], [4, 5, 6]) == [1]
    assert accept_greedy([3], []) == [3]


def test_verify_proposals_rows_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(6, 10)
    argmax = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0, logprobs=1)
    # Sequence 0: two proposals, the first right and the second wrong; sequence 1: none; sequence 2: one, right.
    proposals = [[argmax[0], (argmax[1] + 1) % 10], [], [argmax[4]]]
    out = verify_proposals(logits, [greedy, SamplingParams(temperature=0), greedy], [None] * 3, proposals)
    assert out.tokens == [[argmax[0], argmax[1]], [argmax[3]], [argmax[4], argmax[5]]]
    assert out.num_accepted == [1, 0, 1]
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[1] == [None]
    for seq, rows in ((0, [0, 1]), (2, [4, 5])):
        for entry, r in zip(out.logprobs[seq], rows):
            assert entry == pytest.approx({argmax[r]: float(lp[r, argmax[r]])}, abs=1e-6)
    with pytest.raises(ValueError, match="need 6 logits rows"):
        verify_proposals(logits[:5], [greedy] * 3, [None] * 3, proposals)


@pytest.mark.parametrize("with_q", [False, True])
def test_batched_sequences_each_keep_the_target_distribution(with_q):
    """One call over many sequences with 0 .. 3 proposals each (so the rows and proposals of a sequence
    sit at varying offsets), every sequence with its own seeded generator; for each number of proposals,
    the first emitted tokens of those sequences follow the target."""
    n = 4 * N // 3
    g = torch.Generator().manual_seed(12345)
    counts = [i % 4 for i in range(n)]
    proposals = [torch.multinomial(PROPOSAL, k, replacement=True, generator=g).tolist() if k else []
                 for k in counts]
    target = torch.cat([torch.stack([TARGET] * (k + 1)) for k in counts])
    q = torch.stack([PROPOSAL] * sum(counts)) if with_q else None
    generators = [torch.Generator().manual_seed(seed) for seed in range(n)]
    out = rejection_sample_batch(target, proposals, generators, q)
    for k in range(4):
        first = torch.tensor([o[0] for o, c in zip(out, counts) if c == k])
        counts_k = torch.bincount(first, minlength=TARGET.numel())
        assert chi_square_p_value(counts_k, TARGET) > P_VALUE_THRESHOLD, k
    assert all(len(o) <= c + 1 for o, c in zip(out, counts))
    assert all(o[:-1] == p[:len(o) - 1] for o, p in zip(out, proposals))  # accepted tokens are a prefix


def test_seeded_sequence_without_proposals_draws_what_the_sampler_draws():
    from kvforge.engine.sampler import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, seed=s) for s in (1, 2, 3)]
    want = Sampler().sample(logits, params, [torch.Generator().manual_seed(s) for s in (1, 2, 3)]).token_ids
    probs = Sampler.target_probs(logits, params)
    got = rejection_sample_batch(probs, [[], [], []], [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    assert [t[0] for t in got] == want.tolist()


def _verify_first_tokens(claimed_q: torch.Tensor) -> torch.Tensor:
    """First emitted tokens of :func:`verify_proposals` over sampled rows whose logits give ``TARGET`` (then a
    second row), with two proposals drawn from ``PROPOSAL`` and ``claimed_q`` handed over as their q."""
    second = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    logits = torch.stack([TARGET, second, second]).log()
    params = SamplingParams(temperature=1.0, max_tokens=8)

    def draw(g):
        proposals = torch.multinomial(PROPOSAL, 2, replacement=True, generator=g).tolist()
        q = claimed_q.expand(2, -1)
        return verify_proposals(logits, [params], [g], [proposals], [q]).tokens[0][0]

    return first_tokens(draw)


def test_verify_with_draft_q_keeps_the_target_distribution():
    # A draft model hands over the q its proposals were drawn from: verify_proposals must use it.
    assert chi_square_p_value(_verify_first_tokens(PROPOSAL), TARGET) > P_VALUE_THRESHOLD


def test_verify_with_a_wrong_q_is_detected():
    # The same proposals with a q they were not drawn from (uniform) bias the output: the test has power.
    assert chi_square_p_value(_verify_first_tokens(torch.full((6,), 1 / 6)), TARGET) < P_VALUE_THRESHOLD


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_verification_copies_host_values_without_blocking(with_q):
    """Sampled verification (rows, proposal tokens, rejected rows, point-mass q rows, logprob rows) sends its
    host values by non-blocking copies and assigns no Python number through an advanced index: on CUDA
    neither synchronizes the stream (tests/blocking_copies.py)."""
    from blocking_copies import BlockingCopies

    torch.manual_seed(3)
    vocab = 16
    logits = torch.randn(5, vocab) * 2
    params = [SamplingParams(temperature=0.9, logprobs=1), SamplingParams(temperature=0.7, seed=2)]
    gens = [None, torch.Generator().manual_seed(2)]
    proposals = [[1, 2], [3]]
    q = [torch.softmax(torch.randn(2, vocab), -1), torch.softmax(torch.randn(1, vocab), -1)] if with_q else None
    mode = BlockingCopies()
    with mode:
        out = verify_proposals(logits, params, gens, proposals, q)
    assert mode.calls == []
    # The seed rejects a proposal in both cases, so the residual's paths (point mass or q rows) ran.
    assert out.num_accepted[1] == 0 and [len(t) for t in out.tokens] == [n + 1 for n in out.num_accepted]
