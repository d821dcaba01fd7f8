"""One token's logprob as the engine reports it: a float that also carries vLLM's ``Logprob`` fields.

``RequestOutput.prompt_logprobs`` and ``CompletionOutput.logprobs`` map token ids to :class:`Logprob` values.
A value is the logprob itself (a ``float``: it compares, sums and serializes as one), and code written for
vLLM's offline API reads the same fields there: ``.logprob``, ``.rank`` (the token's rank in the
vocabulary, counted as vLLM counts it: the tokens at least as likely, itself included, so 1 is the most
likely and a tie ranks a token last among its equals) and ``.decoded_token`` (always None: the engine leaves
token text to its caller, as vLLM does without detokenization; the server shows each token's text).
"""

from __future__ import annotations


class Logprob(float):
    """A logprob with its ``rank`` (module docstring); ``float(lp)`` and ``lp.logprob`` are the value."""

    __slots__ = ("rank",)
    decoded_token = None

    def __new__(cls, logprob: float, rank: int | None = None):
        value = float.__new__(cls, logprob)
        value.rank = rank
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token=None)"

    def __reduce__(self):
        return Logprob, (float(self), self.rank)


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
                  ) -> dict[int, Logprob]:
    """The entry of one position: ``token_id`` (the sampled or prompt token) with its rank first, then the
    top tokens at ranks 1, 2, ... (vLLM's order; a top token that is ``token_id`` keeps its place and takes
    the top rank, as vLLM's entry does)."""
    entry = {int(token_id): Logprob(logprob, rank)}
    for r, (t, v) in enumerate(zip(top_ids, top_logprobs), start=1):
        entry[int(t)] = Logprob(v, r)
    return entry
