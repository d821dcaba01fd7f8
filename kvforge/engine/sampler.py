"""Token sampling from a batch of logits.

Per row, in this order (vLLM v1's order):

1. logprobs (when asked) = ``log_softmax`` of the RAW logits (before
   penalties, temperature or filters); top-N of them plus the sampled token.
2. a structured-output request's grammar mask (kvforge/structured/), then
   allowed tokens, logit bias, ``min_tokens`` and bad words
   (kvforge/engine/token_biases.py), then
   repetition, presence and frequency penalties (kvforge/engine/penalties.py),
   for rows that set them; the steps below see these processed logits. Where
   the grammar and the other rules leave no token at all, the grammar alone
   decides (a complete output allows only end tokens, which ``min_tokens``
   would ban).
3. greedy (``SamplingParams.is_greedy``: temperature below 1e-5): ``argmax`` of the logits.
4. otherwise: logits / temperature, then min-p (drop tokens whose probability
   is below ``min_p * max_prob``), top-k (keep the k largest), top-p (keep the
   smallest set of largest tokens whose probability sums to >= top_p; the top
   token is always kept), then sample from the renormalized distribution.

Sampling uses the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d.
picks token ``i`` with probability ``p_i``. A row with a seed draws its ``q``
from its own ``torch.Generator``, and every other computation is row-wise, so
the same seed and the same logits give the same tokens whatever else is in the
batch (the model's logits themselves may move in the last bits with the
batch's shape). Rows
without a seed share one draw from the default generator.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvforge.engine.bad_words import banned_next_tokens, longest_prefix
from kvforge.engine.logprob import Logprob, logprob_entry
from kvforge.engine.penalties import History, apply_penalties
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.token_biases import apply_token_biases
from kvforge.host_copies import start_host_copy, values_to_device
from kvforge.structured.token_masks import apply_bitmask, grammar_bitmask


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``x [N, V]``: on a GPU, a few rows over a large vocabulary go to the sliced
    Triton kernels (kvforge/kernels/triton_argmax.py: the same first index of each row's maximum, spread
    over many programs where torch gives a row one)."""
    if x.device.type == "cuda":
        from kvforge.kernels import triton_argmax

        if triton_argmax.use_sliced_argmax(x):
            return triton_argmax.row_argmax(x)
    return x.argmax(dim=-1)


def output_tail(seq, in_flight: dict[str, int] | None) -> list[int]:
    """The last output tokens of ``seq`` that its bad words read (kvforge/engine/bad_words.py), the token it
    has in flight (``in_flight[request_id]``) last."""
    need = longest_prefix(seq.bad_word_ids)
    if not need:
        return []
    tail = seq.output_token_ids[-need:]
    if seq.num_pending:
        if in_flight is None or seq.request_id not in in_flight:
            raise ValueError(f"request {seq.request_id} has a token in flight that its bad words need")
        tail = (tail + [in_flight[seq.request_id]])[-need:]
    return tail


@dataclass
class SamplerOutput:
    """``token_ids``: int64 [N] on the logits' device.

    ``logprobs``: per row, None when the row did not ask for logprobs, else a
    dict token_id -> logprob holding the top-N tokens plus the sampled one (a
    :class:`PendingLogprobs` that builds that list, where the sampler was asked to defer).
    ``sampled_logprobs``: float32 [N] logprob of each sampled token under the raw
    distribution (None when no row asked for logprobs).
    """

    token_ids: torch.Tensor
    logprobs: list[dict[int, Logprob] | None] | PendingLogprobs
    sampled_logprobs: torch.Tensor | None = None

    def tolist(self) -> list[tuple[int, dict[int, float] | None]]:
        """[(token_id, logprobs)] per row, the shape ``Scheduler.update`` takes."""
        logprobs = self.logprobs.resolve() if isinstance(self.logprobs, PendingLogprobs) else self.logprobs
        return list(zip(self.token_ids.tolist(), logprobs))


class PendingLogprobs:
    """A sampled step's logprob entries while their values travel to the host (pinned, non-blocking copies
    on CUDA, started at construction): :meth:`resolve` waits for them and builds the entries, None for the rows
    that did not ask (``want[i]`` is the row's top-N count, None for none)."""

    def __init__(self, want: list[int | None], token_ids: torch.Tensor, sampled_lp: torch.Tensor,
                 sampled_rank: torch.Tensor, top_lp: torch.Tensor | None, top_ids: torch.Tensor | None):
        self.want = want
        self._host = [start_host_copy(t) if t is not None else None
                      for t in (token_ids, sampled_lp, sampled_rank, top_lp, top_ids)]
        self._ready = None
        if token_ids.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def resolve(self) -> list[dict[int, Logprob] | None]:
        if self._ready is not None:
            self._ready.synchronize()
        tok, samp, rank, top_lp, top_ids = (t.tolist() if t is not None else None for t in self._host)
        return [None if w is None else logprob_entry(tok[i], samp[i], rank[i], top_ids[i][:w] if w else [],
                                                     top_lp[i][:w] if w else [])
                for i, w in enumerate(self.want)]


class Sampler:
    """Call it with logits and the rows' SamplingParams (and generators); it holds only the model's EOS ids
    (``min_tokens`` keeps them from ending a request early)."""

    def __init__(self, eos_token_ids: Collection[int] = ()):
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
    ) -> SamplerOutput:
        return self.sample(logits, params, generators)

    def sample_sequences(self, logits: torch.Tensor, seqs, pending: torch.Tensor | None = None,
                         defer_logprobs: bool = False, in_flight: dict[str, int] | None = None) -> SamplerOutput:
        """Take params, generators and (for penalties) token histories from ``Sequence`` objects; ``pending``
        as :func:`~kvforge.engine.penalties.apply_penalties` takes it; ``defer_logprobs``: see
        :meth:`with_logprobs`; ``in_flight``: by request id, the value of the token a sequence has in flight
        (``num_pending``), where its bad words read it."""
        params = [s.params for s in seqs]
        histories = ([s.token_arrays() if p.has_penalties else ((), ()) for s, p in zip(seqs, params)]
                     if any(p.has_penalties for p in params) else None)  # fmt: skip
        generated = ([s.num_output_tokens + s.num_pending for s in seqs] if any(p.min_tokens for p in params)
                     else None)  # fmt: skip
        bitmask = grammar_bitmask([s.grammar for s in seqs], logits.shape[-1])
        bans = None
        if any(s.bad_word_ids for s in seqs):
            bans = [banned_next_tokens(s.bad_word_ids, output_tail(s, in_flight)) if s.bad_word_ids else ()
                    for s in seqs]
        return self.sample(logits, params, [s.generator_for(logits.device) for s in seqs], histories, pending,
                           generated, bitmask, defer_logprobs, bans)  # fmt: skip

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        histories: list[History] | None = None,
        pending: torch.Tensor | None = None,
        num_generated: list[int] | None = None,
        token_bitmask: torch.Tensor | None = None,
        defer_logprobs: bool = False,
        bad_word_bans: list[Collection[int]] | None = None,
    ) -> SamplerOutput:
        """Rows of ``logits`` [N, vocab] sampled under ``params`` (module docstring); ``histories`` (per row,
        prompt and output token ids) are needed where a row sets a penalty, ``num_generated`` (output tokens
        so far) where it sets ``min_tokens``, ``token_bitmask`` (kvforge/structured/token_masks.py) where a
        row's output follows a grammar, ``bad_word_bans`` (per row, the tokens that would complete a bad word)
        where it has bad words; ``defer_logprobs``: see :meth:`with_logprobs`."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} rows of logits")
        if generators is None:
            generators = [None] * n
        raw = logits.float()
        device = raw.device
        logits = self.processed_logits(raw, params, histories, pending, num_generated, token_bitmask, bad_word_bans)

        greedy_mask = [p.is_greedy for p in params]
        token_ids = torch.empty(n, dtype=torch.long, device=device)
        if any(greedy_mask):
            token_ids.copy_(row_argmax(logits))
        random_rows = [i for i, g in enumerate(greedy_mask) if not g]
        if random_rows:
            idx = values_to_device(random_rows, device)
            sub_params = [params[i] for i in random_rows]
            sub_gens = [generators[i] for i in random_rows]
            token_ids[idx] = self._sample_random(logits[idx], sub_params, sub_gens)

        return self.with_logprobs(raw, token_ids, params, defer_logprobs)

    def processed_logits(self, raw: torch.Tensor, params: list[SamplingParams], histories: list[History] | None = None,
                         pending: torch.Tensor | None = None, num_generated: list[int] | None = None,
                         token_bitmask: torch.Tensor | None = None,
                         bad_word_bans: list[Collection[int]] | None = None) -> torch.Tensor:  # fmt: skip
        """float32 ``raw`` logits [N, vocab] after each row's grammar mask (``token_bitmask``), allowed
        tokens, logit bias, ``min_tokens`` rule and bad-word bans (kvforge/engine/token_biases.py), then its
        penalties (kvforge/engine/penalties.py): what greedy and random selection see. ``raw`` itself where no
        row asks for anything. A row the other rules empty after its grammar mask keeps the grammar's mask alone."""
        masked = raw if token_bitmask is None else apply_bitmask(raw, token_bitmask)
        logits = apply_token_biases(masked, params, num_generated, self.eos_token_ids, bad_word_bans)
        if any(p.has_penalties for p in params):
            if histories is None or len(histories) != raw.shape[0]:
                raise ValueError("penalties need each row's (prompt, output) token ids")
            logits = apply_penalties(logits, params, histories, pending)
        if token_bitmask is not None and logits is not masked:
            emptied = torch.isneginf(logits).all(dim=-1, keepdim=True)
            logits = torch.where(emptied, masked, logits)
        return logits

    @staticmethod
    def with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams],
                      defer: bool = False) -> SamplerOutput:
        """``token_ids`` [N] chosen from float32 ``logits`` [N, vocab], with the logprobs of the rows whose
        params ask for them (see :class:`SamplerOutput`). ``defer``: the entries are a :class:`PendingLogprobs`
        whose values are still on their way to the host (no host wait here)."""
        n, vocab = logits.shape
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * n)
        raw_lp = torch.log_softmax(logits, dim=-1)
        sampled_lp = raw_lp.gather(1, token_ids[:, None]).squeeze(1)
        sampled_rank = (raw_lp >= sampled_lp[:, None]).sum(dim=-1)  # vLLM's rank (kvforge/engine/logprob.py)
        k = min(max(w or 0 for w in want), vocab)
        top_lp, top_ids = raw_lp.topk(k, dim=-1) if k > 0 else (None, None)
        pending = PendingLogprobs(want, token_ids, sampled_lp, sampled_rank, top_lp, top_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=pending if defer else pending.resolve(),
                             sampled_logprobs=sampled_lp)

    @staticmethod
    def _sample_random(logits: torch.Tensor, params: list[SamplingParams], generators) -> torch.Tensor:
        probs = Sampler.target_probs(logits, params)
        m, vocab = probs.shape
        device = probs.device
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == m:
            q.exponential_()
        else:
            if unseeded:
                idx = values_to_device(unseeded, device)
                q[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_()
            for i, g in enumerate(generators):
                if g is not None:
                    q[i].exponential_(generator=g)
        q.clamp_(min=1e-20)
        return row_argmax(probs / q)

    @staticmethod
    def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution a non-greedy row samples from: float32 ``logits`` [M, vocab] / temperature,
        then min-p, top-k and top-p (module docstring), softmax. [M, vocab] float32."""
        m, vocab = logits.shape
        device = logits.device
        temp = values_to_device([p.temperature for p in params], device, torch.float32)
        logits = logits / temp[:, None]

        min_ps = [p.min_p for p in params]
        if any(mp > 0 for mp in min_ps):
            probs = torch.softmax(logits, dim=-1)
            thresh = values_to_device(min_ps, device, torch.float32)[:, None] * probs.amax(
                dim=-1, keepdim=True
            )
            logits = logits.masked_fill(probs < thresh, float("-inf"))

        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)[None, :]
            k_t = values_to_device(top_ks, device)[:, None]
            drop = ranks >= k_t
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            if any(tp < 1.0 for tp in top_ps):
                sorted_probs = torch.softmax(sorted_logits, dim=-1)
                before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
                # 2.0: disabled (cumsum rounding must not drop tail tokens)
                p_t = values_to_device([tp if tp < 1.0 else 2.0 for tp in top_ps], device, torch.float32)[:, None]
                drop = drop | (before >= p_t)
                drop[:, 0] = False  # the top token always survives
            logits = torch.full_like(logits, float("-inf")).scatter(
                1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf"))
            )

        return torch.softmax(logits, dim=-1)
