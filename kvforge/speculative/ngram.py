"""Prompt-lookup (n-gram) proposals: continue the sequence the way it continued before.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the sequence's last ``n``
tokens, find their most recent earlier occurrence in the sequence (prompt and output), and propose
the up to ``k`` tokens that followed it. The first ``n`` with a match wins. No model runs: one
vectorized scan for the last token's earlier occurrences, then at most ``prompt_lookup_max - 1``
comparisons over those candidates. Each sequence's token ids are kept in a growing numpy buffer that
only appends the tokens added since the last step. It pays where the output repeats its context
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
    longest = min(max_n, length - 1)
    if longest < min_n:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence of the suffix ends
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from each end
    alive = np.ones(ends.size, dtype=bool)
    for i in range(1, longest):
        idx = ends - i
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[length - 1 - i]
        if not alive.any():
            break
        matched += alive
    for n in range(longest, min_n - 1, -1):
        hits = np.flatnonzero(matched >= n)
        if hits.size:
            start = int(ends[hits[-1]]) + 1
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
        # request id -> (the sequence, its token ids in a buffer, how many are filled); only the sequences
        # of the latest call are kept.
        self._buffers: dict[str, tuple[Sequence, np.ndarray, int]] = {}

    def _tokens(self, seq: Sequence, buffers: dict) -> np.ndarray:
        n = seq.num_tokens
        entry = self._buffers.get(seq.request_id)
        if entry is None or entry[0] is not seq or entry[2] > n:
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        else:
            _, buf, have = entry
            if n > buf.shape[0]:
                grown = np.empty(2 * n, dtype=np.int64)
                grown[:have] = buf[:have]
                buf = grown
        if have < n:
            buf[have:n] = seq.token_ids_slice(have, n)
        buffers[seq.request_id] = (seq, buf, n)
        return buf[:n]

    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]:
        k, buffers = self.num_speculative_tokens, {}
        out = [ngram_proposal(self._tokens(seq, buffers), k, self.min_n, self.max_n) for seq in seqs]
        self._buffers = buffers
        return out
