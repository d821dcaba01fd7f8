"""One token's logprob as the engine reports it: a float that also carries vLLM's ``Logprob`` fields.

``RequestOutput.prompt_logprobs`` and ``CompletionOutput.logprobs`` map token ids to :class:`Logprob` values.
A value is the logprob itself (a ``float``: it compares, sums and serializes as one), and code written for
vLLM's offline API reads the same fields there: ``.logprob``, ``.rank`` (the token's rank in the
vocabulary, counted as vLLM counts it: the tokens at least as likely, itself included, so 1 is the most
likely and a tie ranks a token last among its equals) and ``.decoded_token`` (the token's text decoded alone,
special tokens as their text; None where the engine has no tokenizer, as vLLM leaves it without
detokenization). The sampler and the prompt scorer build entries without text; a sequence with a tokenizer
labels each entry as it records it (:func:`label_entry`).
"""

from __future__ import annotations


class Logprob(float):
    """A logprob with its ``rank`` (module docstring); ``float(lp)`` and ``lp.logprob`` are the value."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        value = float.__new__(cls, logprob)
        value.rank = rank
        value.decoded_token = decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
                  ) -> dict[int, Logprob]:
    """The entry of one position: ``token_id`` (the sampled or prompt token) with its rank first, then the
    top tokens at ranks 1, 2, ... (vLLM's order; a top token that is ``token_id`` keeps its place and takes
    the top rank, as vLLM's entry does)."""
    entry = {int(token_id): Logprob(logprob, rank)}
    for r, (t, v) in enumerate(zip(top_ids, top_logprobs), start=1):
        entry[int(t)] = Logprob(v, r)
    return entry


def token_text(tokenizer, token_id: int) -> str:
    """A token's text in logprobs: what it decodes to alone, special tokens as their text (``<|im_end|>``),
    as OpenAI and vLLM show them, though a completion's text omits them (``skip_special_tokens``). A kvforge
    :class:`~kvforge.tokenizer.Tokenizer` remembers it per id; any other tokenizer decodes it."""
    remembered = getattr(tokenizer, "token_text", None)
    return remembered(token_id) if remembered is not None else tokenizer.decode([token_id], skip_special_tokens=False)


def label_entry(entry: dict[int, float], tokenizer) -> dict[int, float]:
    """``entry`` with each :class:`Logprob` carrying its token's text (:func:`token_text`); values that are
    plain floats become Logprobs without a rank. A new dict; ``entry`` is left as it was."""
    out = {}
    for t, v in entry.items():
        rank = v.rank if isinstance(v, Logprob) else None
        out[t] = Logprob(float(v), rank, token_text(tokenizer, t))
    return out
