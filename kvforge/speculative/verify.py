"""Verification: which proposed tokens the target model keeps, exactly.

A decoding sequence with proposals ``d_1 .. d_k`` runs ``1 + k`` query rows in one step (its last
token, then the proposals); row ``i``'s logits give the target's distribution ``p_i`` of the token
after ``d_i`` (``p_0`` after the last known token). Verification emits ``a`` accepted proposals and
then one token drawn from the target, so every step emits between 1 and ``k + 1`` tokens:

- greedy (temperature 0): ``a`` is the length of the longest prefix with ``d_{i+1} == argmax p_i``, and
  the emitted token is ``argmax p_a``. The output equals non-speculative greedy decoding token for
  token (up to the float differences of running the rows in one batch).
- sampling: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Proposal ``d_{i+1}`` drawn
  from ``q_i`` is accepted with probability ``min(1, p_i(d) / q_i(d))``; at the first rejection the
  emitted token is drawn from ``normalize(max(0, p_i - q_i))``, and when all ``k`` are accepted from
  ``p_k``. Each emitted token is then distributed exactly as ``p`` (the target distribution after
  temperature, min-p, top-k and top-p). Proposals without a distribution (n-gram) are point masses:
  ``q_i = one_hot(d_{i+1})``, so acceptance is ``p_i(d)`` and the residual is ``p_i`` without ``d``.

Draws use the request's generator when it has a seed. The final draw is the sampler's exponential
race, so a seeded step without proposals draws exactly what the non-speculative sampler would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_params import SamplingParams


def accept_greedy(target_tokens: list[int], proposals: list[int]) -> list[int]:
    """The emitted tokens given ``target_tokens`` (argmax of the ``len(proposals) + 1`` rows)."""
    a = 0
    while a < len(proposals) and proposals[a] == target_tokens[a]:
        a += 1
    return target_tokens[:a + 1]


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index ``i`` with probability ``weights[i] / weights.sum()`` (the sampler's exponential race)."""
    q = torch.empty_like(weights).exponential_(generator=generator).clamp_(min=1e-20)
    return int((weights / q).argmax())


def rejection_sample(target_probs: torch.Tensor, proposals: list[int], proposal_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The emitted tokens for one sequence (module docstring). ``target_probs``: float32 [k + 1, vocab],
    row ``i`` = ``p_i``; ``proposal_probs``: [k, vocab] = ``q_i``, or None for point-mass proposals."""
    k = len(proposals)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} target rows, got {target_probs.shape[0]}")
    a = k
    if k:
        device = target_probs.device
        idx = torch.tensor(proposals, dtype=torch.long, device=device)[:, None]
        p = target_probs[:k].gather(1, idx).squeeze(1)
        q = proposal_probs.gather(1, idx).squeeze(1) if proposal_probs is not None else torch.ones_like(p)
        u = torch.rand(k, generator=generator, device=device)
        accepted = (u * q < p).tolist()  # u < p / q, without dividing by q
        a = accepted.index(False) if False in accepted else k
    if a == k:
        return proposals + [_race(target_probs[k], generator)]
    if proposal_probs is None:
        residual = target_probs[a].clone()
        residual[proposals[a]] = 0.0
    else:
        residual = (target_probs[a] - proposal_probs[a]).clamp_(min=0.0)
    if not float(residual.sum()) > 0.0:  # p == q up to rounding: then the rejection had probability 0
        residual = target_probs[a]
    return proposals[:a] + [_race(residual, generator)]


@dataclass
class VerifiedStep:
    """Per sequence of the step: ``tokens`` to append (accepted proposals, then the target's token),
    ``logprobs`` per token (None entries when not asked), ``num_accepted`` proposals."""

    tokens: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]
    num_accepted: list[int]


def verify_proposals(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                     proposals: list[list[int]]) -> VerifiedStep:
    """Verify a step: sequence ``i`` owns ``len(proposals[i]) + 1`` consecutive rows of float32 ``logits``,
    in order. Greedy rows take one argmax over the whole batch (one host read); sampled rows go through
    :func:`rejection_sample` over :meth:`Sampler.target_probs`."""
    starts, row = [], 0
    for props in proposals:
        starts.append(row)
        row += len(props) + 1
    if logits.shape[0] != row:
        raise ValueError(f"{len(proposals)} sequences with {row - len(proposals)} proposals need {row} logits rows, "
                         f"got {logits.shape[0]}")
    logits = logits.float()
    greedy = [p.temperature == 0 for p in params]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
    sampled = [i for i, g in enumerate(greedy) if not g]
    probs_of = {}
    if sampled:
        rows = [r for i in sampled for r in range(starts[i], starts[i] + len(proposals[i]) + 1)]
        row_params = [params[i] for i in sampled for _ in range(len(proposals[i]) + 1)]
        probs = Sampler.target_probs(logits[torch.tensor(rows, device=logits.device)], row_params)
        at = 0
        for i in sampled:
            n = len(proposals[i]) + 1
            probs_of[i] = probs[at:at + n]
            at += n
    tokens = []
    for i, props in enumerate(proposals):
        if greedy[i]:
            tokens.append(accept_greedy(argmax[starts[i]:starts[i] + len(props) + 1], props))
        else:
            tokens.append(rejection_sample(probs_of[i], props, None, generators[i]))
    logprobs = [[None] * len(t) for t in tokens]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asking:
        rows = [starts[i] + j for i in asking for j in range(len(tokens[i]))]
        ids = [t for i in asking for t in tokens[i]]
        row_params = [params[i] for i in asking for _ in tokens[i]]
        device = logits.device
        out = Sampler.with_logprobs(logits[torch.tensor(rows, device=device)],
                                    torch.tensor(ids, dtype=torch.long, device=device), row_params)
        at = 0
        for i in asking:
            logprobs[i] = out.logprobs[at:at + len(tokens[i])]
            at += len(tokens[i])
    return VerifiedStep(tokens, logprobs, [len(t) - 1 for t in tokens])
