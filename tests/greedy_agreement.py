"""Comparing greedy token streams of two runs whose logits differ only by float rounding.

Two runs of one model rarely compute bitwise-equal logits: another batch composition (rows in a
GEMM change its blocking), a prefix-cache hit (a shorter prefill), a recompute after preemption,
another kernel, tensor parallelism or another implementation (transformers) all sum in another
order. Greedy decoding then picks the same token wherever the reference's best token leads the
runner-up by more than the logit difference between the runs; at a near-tie it may pick the other
one, and from there on the two streams see different inputs and may differ anywhere.

The rule, used by every such comparison in the tests: the streams are identical up to the first
position where they differ, and at that position the reference's top-2 logit margin must be below
the stated tolerance. A wrong token at a clear margin (a real bug) fails. Logprobs are compared
within the same tolerance, up to the first difference.
"""

from __future__ import annotations

FP32_LOGIT_TOL = 1e-3
"""Largest logit difference two float32 CPU runs of one model may show. Measured on SmolLM2-135M
(logits of magnitude ~20): up to 2e-5 between batch compositions; 1e-3 leaves 50x room, and a bug
that feeds a wrong token or position moves logits by far more than that."""


def top2_margins(logits) -> list[float]:
    """Per row of ``logits`` [T, vocab] (a torch tensor): best minus second-best logit."""
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def margins_from_logprobs(logprobs: list[dict[int, float]]) -> list[float]:
    """Top-2 margins from an engine output's per-token logprobs (asked with ``logprobs >= 2``).

    Logprobs are ``log_softmax`` of the raw logits, which shifts a row by one constant, so the
    difference of the two largest logprobs is the logit margin."""
    margins = []
    for i, lp in enumerate(logprobs):
        best = sorted(lp.values(), reverse=True)
        if len(best) < 2:
            raise ValueError(f"position {i} holds {len(best)} logprob(s); ask the reference for logprobs >= 2")
        margins.append(best[0] - best[1])
    return margins


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first position where the streams differ (a stream that ends early differs at
    its end); None when they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_greedy_agrees(got: list[int], want: list[int], margins: list[float], tol: float,
                         what: str = "") -> int:
    """Assert ``got`` follows the reference ``want`` until a near-tie of the reference.

    ``margins[i]``: the reference's top-2 logit margin at the step that chose ``want[i]`` (one
    more entry covers the step after the reference's last token, when ``got`` runs past it).
    Returns the number of leading positions that agree."""
    i = first_difference(got, want)
    if i is None:
        return len(want)
    where = f"{what}: " if what else ""
    assert i < len(margins), (
        f"{where}streams differ at position {i} (got {got[i:i + 4]}, want {want[i:i + 4]}) and the "
        f"reference's margin there is unknown")
    assert margins[i] < tol, (
        f"{where}greedy tokens differ at position {i} (got {got[i:i + 4]}..., want {want[i:i + 4]}...) "
        f"where the reference's top-2 margin is {margins[i]:.3g} >= tolerance {tol:g}: not a rounding tie")
    return i


def assert_logprobs_close(got: list[dict[int, float]], want: list[dict[int, float]], n: int, tol: float,
                          what: str = "") -> None:
    """Per-token logprob dicts of the first ``n`` positions agree within ``tol``.

    A token present in only one dict (the top-N cut fell at a near-tie) must sit within ``tol`` of
    the other dict's smallest logprob."""
    where = f"{what}: " if what else ""
    for i, (a, b) in enumerate(zip(got[:n], want[:n])):
        for t in a.keys() & b.keys():
            assert abs(a[t] - b[t]) <= tol, f"{where}position {i} token {t}: logprob {a[t]} vs {b[t]}"
        for t in a.keys() ^ b.keys():
            mine, other = (a, b) if t in a else (b, a)
            assert abs(mine[t] - min(other.values())) <= tol, (
                f"{where}position {i}: token {t} (logprob {mine[t]}) is in only one top-N list and is "
                f"not tied with its cut ({min(other.values())})")


def assert_outputs_agree(got_outputs, want_outputs, tol: float = FP32_LOGIT_TOL) -> int:
    """Engine ``RequestOutput`` lists, the reference run asked with ``logprobs >= 2``: greedy tokens
    by the near-tie rule, logprobs (when both asked) within ``tol`` and text and finish reason equal
    where the tokens are. Returns the number of positions that agree, over all requests."""
    assert len(got_outputs) == len(want_outputs)
    agreed = 0
    for k, (g, w) in enumerate(zip(got_outputs, want_outputs)):
        go, wo = g.outputs[0], w.outputs[0]
        n = assert_greedy_agrees(go.token_ids, wo.token_ids, margins_from_logprobs(wo.logprobs), tol,
                                 what=f"request {k}")
        if go.logprobs is not None:
            assert_logprobs_close(go.logprobs, wo.logprobs, n, tol, what=f"request {k}")
        if n == len(wo.token_ids) == len(go.token_ids):
            assert (go.text, go.finish_reason) == (wo.text, wo.finish_reason), f"request {k}"
        agreed += n
    return agreed


def assert_speculative_and_async_agree(engine_kwargs: dict, prompts, params, plain, k: int = 3) -> None:
    """Engines built with ``engine_kwargs`` that verify ``k`` garbage proposals a step (every one rolled back
    through the request's grammar) and that schedule asynchronously give ``plain``'s outputs."""
    from test_speculative_engine import GarbageProposer

    from kvforge import LLM

    with LLM(**engine_kwargs, speculative_config={"num_speculative_tokens": k, "backoff": False}) as llm:
        llm.engine.proposer = GarbageProposer(k, llm.engine.spec.vocab_size)
        assert_outputs_agree(llm.generate(prompts, params, use_tqdm=False), plain, tol=FP32_LOGIT_TOL)
        assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    with LLM(**engine_kwargs, async_scheduling=True) as llm:
        assert_outputs_agree(llm.generate(prompts, params, use_tqdm=False), plain, tol=FP32_LOGIT_TOL)
