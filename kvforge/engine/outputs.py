"""Results handed back to callers of the engine (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated continuation. ``text`` and ``token_ids`` are cumulative.

    finish_reason: None while running, else "stop" (EOS, stop string or stop
    token), "length" (max_tokens or max_model_len) or "abort".
    logprobs: per generated token, a dict token_id -> logprob of the top-N
    alternatives plus the sampled token (None when not requested).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
