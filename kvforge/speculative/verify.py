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
from kvforge.host_copies import values_to_device


def accept_greedy(target_tokens: list[int], proposals: list[int]) -> list[int]:
    """The emitted tokens given ``target_tokens`` (argmax of the ``len(proposals) + 1`` rows)."""
    a = 0
    while a < len(proposals) and proposals[a] == target_tokens[a]:
        a += 1
    return target_tokens[:a + 1]


def _exponential(vocab: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """Exp(1) draws ``[len(generators), vocab]``: row ``i`` from ``generators[i]`` where it is set, the
    other rows from one batched draw of the default generator (as the sampler draws them)."""
    out = torch.empty((len(generators), vocab), dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return out.exponential_()
    if unseeded:
        out[values_to_device(unseeded, device)] = torch.empty(
            (len(unseeded), vocab), dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            out[i].exponential_(generator=g)
    return out


def rejection_sample_batch(target_probs: torch.Tensor, proposals: list[list[int]],
                           generators: list[torch.Generator | None] | None = None,
                           proposal_probs: torch.Tensor | None = None) -> list[list[int]]:
    """The emitted tokens of several sequences (module docstring), with two host reads in all.

    Sequence ``i`` owns ``len(proposals[i]) + 1`` consecutive rows of ``target_probs`` (float32
    ``[rows, vocab]``, row ``j`` of it = ``p_j``). ``proposal_probs``: ``[total proposals, vocab]``, the
    ``q`` of every proposal in order, or None for point-mass proposals. A seeded sequence's generator
    draws its acceptance uniforms, then the Exp(1) race of its emitted token (alone, the race the
    non-speculative sampler runs)."""
    device = target_probs.device
    n = len(proposals)
    generators = generators if generators is not None else [None] * n
    counts = [len(p) for p in proposals]
    starts, row = [], 0
    for k in counts:
        starts.append(row)
        row += k + 1
    if target_probs.shape[0] != row:
        raise ValueError(f"{n} sequences with {row - n} proposals need {row} target rows, got {target_probs.shape[0]}")
    accepted = list(counts)
    offsets = [start - i for i, start in enumerate(starts)]  # sequence i's first proposal in the flat order
    flat = [t for p in proposals for t in p]
    if flat:
        tokens = values_to_device(flat, device)
        rows = values_to_device([starts[i] + j for i, k in enumerate(counts) for j in range(k)], device)
        p = target_probs[rows, tokens]
        q = (proposal_probs[torch.arange(len(flat), device=device), tokens] if proposal_probs is not None
             else torch.ones_like(p))
        u = torch.empty(len(flat), dtype=torch.float32, device=device).uniform_()  # unseeded sequences' uniforms
        for i, (k, g) in enumerate(zip(counts, generators)):
            if g is not None and k:
                u[offsets[i]:offsets[i] + k].uniform_(generator=g)
        ok = (u * q < p).tolist()  # u < p / q, without dividing by q
        for i, k in enumerate(counts):
            seg = ok[offsets[i]:offsets[i] + k]
            accepted[i] = seg.index(False) if False in seg else k
    final_rows = values_to_device([starts[i] + accepted[i] for i in range(n)], device)
    weights = target_probs[final_rows].clone()
    rejected = [i for i in range(n) if accepted[i] < counts[i]]
    if rejected:
        idx = values_to_device(rejected, device)
        if proposal_probs is None:  # the residual of a point mass: p without the rejected token
            cols = values_to_device([proposals[i][accepted[i]] for i in rejected], device)
            weights.index_put_((idx, cols), weights.new_zeros(()))
        else:
            q_rows = values_to_device([offsets[i] + accepted[i] for i in rejected], device)
            weights[idx] = (weights[idx] - proposal_probs[q_rows]).clamp_(min=0.0)
        # p == q up to rounding leaves no residual; that rejection had probability 0: keep p.
        empty = weights.sum(dim=-1, keepdim=True) <= 0.0
        weights = torch.where(empty, target_probs[final_rows], weights)
    race = _exponential(weights.shape[1], generators, device).clamp_(min=1e-20)
    emitted = (weights / race).argmax(dim=-1).tolist()
    return [list(proposals[i][:accepted[i]]) + [emitted[i]] for i in range(n)]


def rejection_sample(target_probs: torch.Tensor, proposals: list[int], proposal_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """One sequence's emitted tokens: :func:`rejection_sample_batch` with ``target_probs`` [k + 1, vocab]
    and ``proposal_probs`` [k, vocab] (or None for point masses)."""
    k = len(proposals)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} target rows, got {target_probs.shape[0]}")
    return rejection_sample_batch(target_probs, [list(proposals)], [generator], proposal_probs)[0]


@dataclass
class VerifiedStep:
    """Per sequence of the step: ``tokens`` to append (accepted proposals, then the target's token),
    ``logprobs`` per token (None entries when not asked), ``num_accepted`` proposals."""

    tokens: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]
    num_accepted: list[int]


def _proposal_q(proposals: list[list[int]], probs: list[torch.Tensor | None], vocab: int,
                device) -> torch.Tensor | None:
    """The ``q`` rows of every proposal in order (``proposal_probs`` of :func:`rejection_sample_batch`):
    ``probs[i][:len(proposals[i])]``, a point mass where a sequence has none; None when no sequence has any."""
    if all(p is None for p in probs):
        return None
    rows = []
    for props, q in zip(proposals, probs):
        if not props:
            continue
        if q is None:
            q = torch.zeros((len(props), vocab), dtype=torch.float32, device=device)
            q.index_put_((torch.arange(len(props), device=device), values_to_device(props, device)), q.new_ones(()))
        elif q.shape[0] < len(props) or q.shape[1] != vocab:
            raise ValueError(f"proposal probabilities of shape {tuple(q.shape)} for {len(props)} proposals over "
                             f"a vocabulary of {vocab}")
        rows.append(q[:len(props)].to(device, torch.float32, non_blocking=True))
    return torch.cat(rows) if rows else None


def verify_proposals(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                     proposals: list[list[int]], proposal_probs: list[torch.Tensor | None] | None = None,
                     raw_logits: torch.Tensor | None = None, unread: torch.Tensor | None = None) -> VerifiedStep:
    """Verify a step: sequence ``i`` owns ``len(proposals[i]) + 1`` consecutive rows of float32 ``logits``,
    in order. Greedy rows take one argmax over the whole batch (one host read); sampled rows go through
    :func:`rejection_sample_batch` over :meth:`Sampler.target_probs`. ``proposal_probs[i]``: the ``q``
    [>= len(proposals[i]), vocab] sequence ``i``'s proposals were drawn from (a draft model), or None for
    point-mass proposals (n-gram); None for all point masses. ``raw_logits``: the logits before penalties
    where ``logits`` are penalized (logprobs are those of the raw logits, as the sampler's); None: ``logits``.
    ``unread``: int64 [every proposal, in order] on the device where ``proposals`` holds placeholders of the
    right counts (kvforge/speculative/device_proposals.py); greedy sequences only, read in the argmax's host
    read."""
    starts, row = [], 0
    for props in proposals:
        starts.append(row)
        row += len(props) + 1
    if logits.shape[0] != row:
        raise ValueError(f"{len(proposals)} sequences with {row - len(proposals)} proposals need {row} logits rows, "
                         f"got {logits.shape[0]}")
    logits = logits.float()
    greedy = [p.is_greedy for p in params]
    if unread is not None:
        if unread.shape[0] != row - len(proposals):
            raise ValueError(f"{unread.shape[0]} unread proposals for {row - len(proposals)} placeholders")
        if any(props and not g for props, g in zip(proposals, greedy)):
            raise ValueError("unread proposals of a sampled sequence: read them (and their q) first")
        both = torch.cat([logits.argmax(dim=-1), unread]).tolist()  # one host read
        argmax, values = both[:row], iter(both[row:])
        proposals = [[next(values) for _ in props] for props in proposals]
    else:
        argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
    sampled = [i for i, g in enumerate(greedy) if not g]
    tokens_of = {}
    if sampled:
        rows = [r for i in sampled for r in range(starts[i], starts[i] + len(proposals[i]) + 1)]
        row_params = [params[i] for i in sampled for _ in range(len(proposals[i]) + 1)]
        probs = Sampler.target_probs(logits[values_to_device(rows, logits.device)], row_params)
        q = (_proposal_q([proposals[i] for i in sampled], [proposal_probs[i] for i in sampled], logits.shape[1],
                         logits.device) if proposal_probs is not None else None)
        emitted = rejection_sample_batch(probs, [proposals[i] for i in sampled], [generators[i] for i in sampled], q)
        tokens_of = dict(zip(sampled, emitted))
    tokens = [accept_greedy(argmax[starts[i]:starts[i] + len(props) + 1], props) if greedy[i] else tokens_of[i]
              for i, props in enumerate(proposals)]
    logprobs = [[None] * len(t) for t in tokens]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asking:
        rows = [starts[i] + j for i in asking for j in range(len(tokens[i]))]
        ids = [t for i in asking for t in tokens[i]]
        row_params = [params[i] for i in asking for _ in tokens[i]]
        device = logits.device
        raw = (raw_logits if raw_logits is not None else logits).float()
        out = Sampler.with_logprobs(raw[values_to_device(rows, device)], values_to_device(ids, device), row_params)
        at = 0
        for i in asking:
            logprobs[i] = out.logprobs[at:at + len(tokens[i])]
            at += len(tokens[i])
    return VerifiedStep(tokens, logprobs, [len(t) - 1 for t in tokens])
