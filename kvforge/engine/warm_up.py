"""The engine's startup warm-up: a few synthetic requests run to completion before the first real one.

Graph capture compiles the kernels of decode steps; the kernels of prefill steps, of prompt chunks that
continue a cached prefix, of steps mixing both, and of the eager products after a graph (the LM head of
a one-sequence step) would otherwise compile inside the first requests that need them: a second or more
each on a cold Triton cache. The warm-up's requests (:func:`warm_up_rounds`) are chosen to pass through
those paths:

- prompts of several lengths (short, past the prefill attention's SDPA threshold, past MLA's absorbed
  limit) in one step, and, with chunked prefill and where ``max_model_len`` allows, one prompt longer
  than the step budget, so its second chunk continues a cached prefix beside decoding sequences;
- ``max_tokens`` that differ, so the decode batch shrinks to one sequence;
- then short prompts alone (a decode-like query tile, a one-tile prefill), fresh and continuing a long
  cached prefix.

A request the scheduler refuses is left out (none should be: every plan admits a request of
max-model-len, and no warm-up request is longer). Afterwards the engine forgets them
(:func:`forget_warm_up`): the prefix cache drops their hashes and every counter a user reads
(``LLMEngine.stats``, the step log, speculative-decoding counters) starts at zero, as on an engine that
never warmed up. The KV blocks the requests used are free again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvforge.attention.routing.mla import ABSORBED_PREFILL_MAX_SEQ_LEN
from kvforge.attention.routing.paged import SDPA_PREFILL
from kvforge.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: Prompt lengths of the first round (cut to what ``max_model_len`` allows): below and above the prefill
#: attention's SDPA rule, and past MLA's absorbed-prefill limit.
BASE_PROMPT_LENGTHS = (16, 300, SDPA_PREFILL.min_query_len + 188, ABSORBED_PREFILL_MAX_SEQ_LEN + 52)
#: Tokens the shortest prompt's request generates; each longer one generates 2 more.
FIRST_MAX_TOKENS = 2
#: Query lengths of the later rounds' requests: one decode-like query tile, and one full prefill tile.
SHORT_QUERIES = (3, 20)
#: A round takes at most this fraction of the KV capacity.
CAPACITY_FRACTION = 0.5


@dataclass(frozen=True)
class WarmUpRequest:
    """A prompt of runs of one token (``segments``: (token id, count) pairs) and the tokens to generate."""

    segments: tuple[tuple[int, int], ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return sum(n for _, n in self.segments)

    def prompt_token_ids(self) -> list[int]:
        return [t for t, n in self.segments for _ in range(n)]


def warm_up_rounds(max_model_len: int, step_budget: int, capacity_tokens: float, vocab_size: int,
                   chunked_prefill: bool = True) -> list[list[WarmUpRequest]]:
    """The warm-up's rounds of requests (each round runs to completion before the next) for an engine with
    these limits (``step_budget``: the most tokens one step computes, ``max_num_batched_tokens``).

    Round 1: prompts of ``BASE_PROMPT_LENGTHS`` and, with ``chunked_prefill``, one longer than the step
    budget (its second chunk continues a cached prefix beside decoding sequences), shortest first; request
    i generates ``FIRST_MAX_TOKENS + 2 i`` tokens, so the decode batch shrinks one by one. Prompts are cut to leave room
    for the most tokens any request generates (lengths that become equal count once), then the longest are
    dropped until the round fits ``CAPACITY_FRACTION`` of the KV capacity.

    Then one request a round, each alone in its steps: fresh prompts of ``SHORT_QUERIES`` tokens, and the
    longest round-1 prompt, and the longest within MLA's absorbed limit, each with ``SHORT_QUERIES[-1]`` new
    tokens (a short query over a cached prefix). Every prompt starts with its own token id, so only the
    continuations share a prefix (with the prompt they continue). Deterministic."""
    lengths = [*BASE_PROMPT_LENGTHS] + ([step_budget + 300] if chunked_prefill else [])
    most = max(1, min(FIRST_MAX_TOKENS + 2 * (len(lengths) - 1), max_model_len - 2))
    cap = max(1, max_model_len - 1 - most)
    ids = iter(range(11, 11 + 64))

    def token() -> int:
        return next(ids) % vocab_size

    first = [WarmUpRequest(((token(), n),), min(most, FIRST_MAX_TOKENS + 2 * i))
             for i, n in enumerate(sorted({min(n, cap) for n in lengths}))]
    while first and sum(r.prompt_len + r.max_tokens for r in first) > CAPACITY_FRACTION * capacity_tokens:
        first.pop()
    later = [WarmUpRequest(((token(), n),), FIRST_MAX_TOKENS) for n in SHORT_QUERIES]
    extra = SHORT_QUERIES[-1]
    fits = [r for r in first if r.prompt_len + extra + FIRST_MAX_TOKENS <= max_model_len]
    absorbed = [r for r in fits if r.prompt_len + extra <= ABSORBED_PREFILL_MAX_SEQ_LEN]
    for base in dict.fromkeys(group[-1] for group in (fits, absorbed) if group):
        later.append(WarmUpRequest(base.segments + ((token(), extra),), FIRST_MAX_TOKENS))
    room = min(max_model_len, CAPACITY_FRACTION * capacity_tokens)
    later = [r for r in later if r.prompt_len + r.max_tokens <= room]
    return ([first] if first else []) + [[r] for r in later]


def run_warm_up(engine) -> int:
    """Run the warm-up requests through ``engine`` to completion, then :func:`forget_warm_up`. Returns the
    number of steps taken."""
    from kvforge.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    scheduler = engine.scheduler
    rounds = warm_up_rounds(engine.max_model_len, scheduler.max_num_batched_tokens,
                            engine.plan.capacity_tokens or float("inf"), engine.spec.vocab_size,
                            chunked_prefill=scheduler.enable_chunked_prefill)
    steps = skipped = 0
    for k, requests in enumerate(rounds):
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            try:
                engine.add_request(f"kvforge-warm-up-{k}-{i}", {"prompt_token_ids": r.prompt_token_ids()}, params)
            except InvalidRequestError:  # not expected (module docstring): left out rather than fatal
                skipped += 1
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    forget_warm_up(engine)
    logger.info("warm-up: %d rounds (prompts of %s tokens; %d refused) in %d steps, %.1f s", len(rounds),
                [[r.prompt_len for r in requests] for requests in rounds], skipped, steps, time.perf_counter() - t0)
    return steps


def forget_warm_up(engine) -> None:
    """Reset what the warm-up left behind to an unused engine's values: cached prefix hashes and the
    counters of the engine, its scheduler, block manager and runners (the draft model's too, and every
    tensor-parallel rank's), the step log and the speculative decoding counters and back-off."""
    from kvforge.engine.step_log import StepLog

    if not engine.reset_prefix_cache():
        raise RuntimeError("warm-up left requests unfinished")
    bm = engine.block_manager
    if engine.scheduler.state_prefix is not None:
        engine.scheduler.state_prefix.snapshots_taken = engine.scheduler.state_prefix.snapshots_restored = 0
    bm.prefix_cache_queries = bm.prefix_cache_hits = bm.num_evictions = 0
    engine.scheduler.num_preemptions = engine.scheduler.prompt_tokens_admitted = 0
    engine.generation_tokens_total = engine.num_steps = engine.prefill_tokens_computed = 0
    engine.num_launches = engine.async_pressure_resolves = 0
    if engine.tp is not None:  # the other ranks' runners, in order with the steps
        engine.tp.reset_worker_counters()
    for runner in (engine.runner, engine.draft_runner):
        if runner is not None:
            runner.reset_counters()
    engine.step_log = StepLog()
    if engine.spec_counters is not None:
        engine.spec_counters = type(engine.spec_counters)(engine.speculative.num_speculative_tokens)
    if engine.spec_backoff is not None:
        engine.spec_backoff = type(engine.spec_backoff)()
