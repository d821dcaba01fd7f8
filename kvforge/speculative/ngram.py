"""Prompt-lookup (n-gram) proposals: continue the sequence the way it continued before.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the sequence's last ``n``
tokens, find their most recent earlier occurrence in the sequence (prompt and output), and propose
the up to ``k`` tokens that followed it. The first ``n`` with a match wins. No model runs; the cost
is one scan of the sequence per ``n`` (numpy), so it pays where the output repeats its context
(editing or quoting a given text, code, structured output).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from kvforge.engine.sequence import Sequence


def ngram_proposal(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier occurrence of the longest suffix of
    ``tokens`` (int64, 1-D) of length ``min_n .. max_n``; [] when no such suffix recurs."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length - n - 1: every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """See the module docstring; implements :class:`kvforge.speculative.proposer.Proposer`."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]:
        k = self.num_speculative_tokens
        return [ngram_proposal(np.asarray(seq.all_token_ids, dtype=np.int64), k, self.min_n, self.max_n)
                for seq in seqs]
