"""The prompt-lookup proposer against a brute-force search written independently."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.engine.sequence import Sequence
from kvforge.speculative.ngram import NgramProposer, ngram_proposal


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_examples():
    # The suffix [1, 2] last occurred at 3..4, followed by 9 9 1.
    assert ngram_proposal(np.array([1, 2, 7, 1, 2, 9, 9, 1, 2]), 3, 1, 3) == [9, 9, 1]
    # The longest matching n wins: [5, 1, 2] occurred at 0, [1, 2] more recently at 4.
    assert ngram_proposal(np.array([5, 1, 2, 8, 1, 2, 6, 5, 1, 2]), 2, 1, 3) == [8, 1]
    assert ngram_proposal(np.array([5, 1, 2, 8, 1, 2, 6, 5, 1, 2]), 2, 1, 2) == [6, 5]
    assert ngram_proposal(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # nothing recurs
    assert ngram_proposal(np.array([4, 4]), 3, 1, 3) == [4]  # fewer than k tokens follow
    assert ngram_proposal(np.array([4]), 3, 1, 3) == []


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2 + seed % 5, size=int(rng.integers(1, 80))).tolist()
    k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    max_n = min_n + int(rng.integers(0, 4))
    assert ngram_proposal(np.array(tokens, dtype=np.int64), k, min_n, max_n) == brute_force(tokens, k, min_n, max_n)


def test_proposer_reads_prompt_and_output():
    seq = Sequence("a", [3, 4, 5, 6, 3])
    seq.append_token(4)
    assert NgramProposer(2, 1, 3).propose([seq, Sequence("b", [1, 2])]) == [[5, 6], []]


def test_buffers_follow_growing_sequences():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(3, 1, 4)
    seqs = [Sequence(str(i), rng.integers(0, 3, size=5).tolist()) for i in range(3)]
    for step in range(40):
        for seq in seqs:
            seq.append_token(int(rng.integers(0, 3)))
        live = seqs[step % 2:]  # a sequence missing from a call is rebuilt when it comes back
        assert proposer.propose(live) == [brute_force(s.all_token_ids, 3, 1, 4) for s in live]
    replaced = Sequence("0", [7, 8, 7])  # a new sequence under a known request id
    assert proposer.propose([replaced]) == [[8, 7]]
