"""Sampler: greedy, filters, seeds, distribution sanity, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from blocking_copies import BlockingCopies, every_rule_batch

from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence

sampler = Sampler()


def rand_logits(n, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_greedy_is_argmax():
    logits = rand_logits(8)
    out = sampler(logits, [SamplingParams(temperature=0)] * 8)
    assert out.token_ids.dtype == torch.long
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs == [None] * 8 and out.sampled_logprobs is None


@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 1e-39, 1e-20, 9.99e-6])
def test_a_temperature_below_the_greedy_line_is_greedy(temperature):
    """Logits divided by 1e-39 (a float32 subnormal) or anything below 1e-5 would overflow to inf and nan:
    such a temperature samples greedily, and returns the raw logits' logprobs like temperature 0."""
    logits = rand_logits(8, seed=3)
    tiny = SamplingParams(temperature=temperature, logprobs=1, seed=5)
    assert tiny.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    got = sampler(logits, [tiny] * 8)
    want = sampler(logits, [SamplingParams(temperature=0, logprobs=1)] * 8)
    assert torch.equal(got.token_ids, logits.argmax(-1))
    assert got.logprobs == want.logprobs


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = rand_logits(16, seed=1)
    for p in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        for _ in range(5):
            assert torch.equal(sampler(logits, [p] * 16).token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = rand_logits(6, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    out = sampler(logits, params).token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def _counts(logits_row, params, n, seed=0):
    torch.manual_seed(seed)
    out = sampler(logits_row.expand(n, -1).contiguous(), [params] * n).token_ids
    return torch.bincount(out, minlength=logits_row.numel())


def _chi2(counts, probs):
    n = counts.sum().item()
    exp = probs * n
    mask = exp > 0
    assert counts[~mask].sum() == 0, "sampled a token with zero probability"
    return (((counts[mask] - exp[mask]) ** 2) / exp[mask]).sum().item()


P = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = P.log()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution_chi_square(temperature):
    counts = _counts(LOGITS, SamplingParams(temperature=temperature), 40_000)
    probs = torch.softmax(LOGITS / temperature, -1)
    # 4 degrees of freedom; 18.47 is the 0.999 quantile.
    assert _chi2(counts, probs) < 18.47


def test_top_k_and_top_p_renormalize_over_kept_tokens():
    counts = _counts(LOGITS, SamplingParams(top_k=2), 20_000)
    assert counts[2:].sum() == 0
    assert _chi2(counts, torch.tensor([2 / 3, 1 / 3, 0, 0, 0])) < 13.8  # df 1, 0.9998
    counts = _counts(LOGITS, SamplingParams(top_p=0.7), 20_000)  # 0.5 + 0.25 >= 0.7: keep 2
    assert counts[2:].sum() == 0 and counts[1] > 0
    counts = _counts(LOGITS, SamplingParams(top_p=0.8), 20_000)  # needs the third too
    assert counts[3:].sum() == 0 and counts[2] > 0


def test_min_p_filters_relative_to_max():
    # min_p 0.4: keep tokens with p >= 0.4 * 0.5 = 0.2 -> tokens 0 and 1
    counts = _counts(LOGITS, SamplingParams(min_p=0.4), 20_000)
    assert counts[2:].sum() == 0 and counts[1] > 0
    assert _chi2(counts, torch.tensor([2 / 3, 1 / 3, 0, 0, 0])) < 13.8
    counts = _counts(LOGITS, SamplingParams(min_p=0.1), 20_000)  # threshold 0.05 -> 4 kept
    assert counts[4] == 0 and counts[3] > 0


def _seeded_run(seed_row_logits, batch_extra, steps=6, seed=1234, position=0):
    """Sample `steps` tokens for a seeded request placed among other rows."""
    seq = Sequence("s", [1], SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
    others = [
        Sequence(f"o{i}", [1], SamplingParams(temperature=0.7, seed=None if i % 2 else i))
        for i in range(batch_extra)
    ]
    rows = others[:position] + [seq] + others[position:]
    toks = []
    for step in range(steps):
        logits = rand_logits(len(rows), seed=100 + step)
        logits[position] = seed_row_logits[step]
        out = sampler.sample_sequences(logits, rows)
        toks.append(out.token_ids[position].item())
    return toks


def test_same_seed_same_tokens_whatever_the_batch():
    row_logits = [rand_logits(1, seed=50 + s)[0] for s in range(6)]
    alone = _seeded_run(row_logits, 0)
    torch.manual_seed(7)  # the global RNG must not matter for a seeded row
    assert _seeded_run(row_logits, 5, position=3) == alone
    torch.manual_seed(8)
    assert _seeded_run(row_logits, 9, position=9) == alone
    # a different seed gives a different stream (on 6 draws over 64 tokens, essentially surely)
    assert _seeded_run(row_logits, 0, seed=4321) != alone


def test_seeded_generator_advances_per_token():
    seq = Sequence("s", [1], SamplingParams(temperature=1.0, seed=3))
    logits = torch.zeros(1, 1000)
    a = [sampler.sample_sequences(logits, [seq]).token_ids.item() for _ in range(5)]
    assert len(set(a)) > 1
    seq2 = Sequence("s2", [1], SamplingParams(temperature=1.0, seed=3))
    b = [sampler.sample_sequences(logits, [seq2]).token_ids.item() for _ in range(5)]
    assert a == b


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(0)
    logits = rand_logits(4, seed=9)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=3, logprobs=0),
    ]
    out = sampler(logits, params)
    ref = torch.log_softmax(logits, -1)
    toks = out.token_ids.tolist()
    for i, p in enumerate(params):
        d = out.logprobs[i]
        if p.logprobs is None:
            assert d is None
            continue
        assert toks[i] in d
        top = ref[i].topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert set(d) == set(top) | {toks[i]}
        for t, lp in d.items():
            assert math.isclose(lp, ref[i, t].item(), rel_tol=1e-5, abs_tol=1e-5)
            assert lp.logprob == lp and lp.decoded_token is None  # vLLM's Logprob fields
        # vLLM's order and ranks: the sampled token first; the top tokens at ranks 1..k; a sampled token
        # outside them at its rank in the vocabulary (the tokens at least as likely, itself included).
        assert next(iter(d)) == toks[i]
        assert [d[t].rank for t in top] == list(range(1, len(top) + 1))
        if toks[i] not in top:
            assert d[toks[i]].rank == int((ref[i] >= ref[i, toks[i]]).sum())
    assert torch.allclose(out.sampled_logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.tolist()[0] == (toks[0], out.logprobs[0])


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        sampler(torch.zeros(3), [SamplingParams()])
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 5), [SamplingParams()])


def test_sampling_copies_host_values_without_blocking():
    """Temperature, min-p, top-k, top-p, seeds, penalties, a logit bias, allowed tokens and min_tokens: every
    host value the sampler sends to the device goes by a non-blocking (pinned on CUDA) copy, so a sampled step
    never synchronizes the stream and overlapped scheduling keeps the next step's host work beside it."""
    logits, params, generators, histories, generated = every_rule_batch("cpu")
    mode = BlockingCopies()
    with mode:
        tokens = Sampler().sample(logits, params, generators, histories, num_generated=generated).token_ids
    assert tokens.shape == (5,) and tokens[2].item() in (1, 2, 3, 4) and mode.calls == []


def test_deferred_logprobs_read_nothing_until_resolved():
    """``defer_logprobs``: the sampler reads no value to the host (no ``tolist`` / ``item``), and the entries
    resolved later equal those built at once (the same tensors, read later; exact)."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, seed=5),
              SamplingParams(temperature=0.9, seed=6, logprobs=0), SamplingParams(temperature=0.0, logprobs=5)]

    class Reads(torch.overrides.TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("tolist", "item"):
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    gens = [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(6), None]
    with Reads():
        deferred = Sampler().sample(logits, params, gens, defer_logprobs=True)
    assert Reads.count == 0
    gens = [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(6), None]
    now = Sampler().sample(logits, params, gens)
    assert torch.equal(deferred.token_ids, now.token_ids)
    assert deferred.logprobs.resolve() == now.logprobs and now.logprobs[1] is None and len(now.logprobs[3]) >= 5
