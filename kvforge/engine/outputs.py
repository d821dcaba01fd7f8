"""Results handed back to callers of the engine (vLLM's shapes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvforge.engine.logprob import Logprob
from kvforge.speculative.stats import SpeculativeStats


@dataclass
class CompletionOutput:
    """One generated continuation. ``text`` and ``token_ids`` are cumulative.

    finish_reason: None while running, else "stop" (EOS, stop string or stop
    token), "length" (max_tokens or max_model_len) or "abort".
    logprobs: per generated token, a dict token_id -> logprob of the sampled
    token and the top-N alternatives (None when not requested); each logprob
    is a float with vLLM's ``.logprob``, ``.rank`` and ``.decoded_token``
    (kvforge/engine/logprob.py).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this continuation has ended (vLLM's): it has a ``finish_reason``."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    prompt_logprobs: None unless ``SamplingParams.prompt_logprobs`` was set;
    then one entry per prompt token: None for the first (nothing precedes it),
    else a dict token_id -> logprob (a :class:`Logprob`) of the prompt token
    itself and the top-N alternatives, from the logits of the position before it. Complete in
    every output of the request (the first output comes after the prefill).
    speculative: None unless the engine speculates; then the request's acceptance so far
    (``acceptance_rate``, ``mean_accepted_length``; kvforge/speculative/stats.py).
    first_scheduled_time: ``time.monotonic()`` when the engine first scheduled the request (its first
    prefill chunk), None before; not compared by ``==`` (two runs of the same request differ only there).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    speculative: SpeculativeStats | None = None
    first_scheduled_time: float | None = field(default=None, compare=False, repr=False)


def num_token_ids(completion: CompletionOutput) -> int:
    """``len(completion.token_ids)`` without copying a snapshot's list: the engine's per-step hooks count
    every running sequence's tokens each step, which copying would make quadratic in the output length."""
    d = completion.__dict__
    src = d.get("_src")
    if src is not None and "_token_ids" not in d:
        return src[2]
    return len(completion.token_ids)


def token_ids_since(completion: CompletionOutput, start: int) -> list[int]:
    """``completion.token_ids[start:]`` without copying a snapshot's first ``start`` tokens (a stream sends
    each step's new tokens)."""
    d = completion.__dict__
    src = d.get("_src")
    if src is not None and "_token_ids" not in d:
        return src[0][start:src[2]]
    return list(completion.token_ids[start:])


def logprobs_between(completion: CompletionOutput, start: int, end: int) -> list[dict[int, Logprob]]:
    """``(completion.logprobs or [])[start:end]`` without copying a snapshot's other entries (a stream with
    logprobs sends each step's new ones); each dict the caller's own, as ``logprobs`` gives them."""
    d = completion.__dict__
    src = d.get("_src")
    if src is not None and "_logprobs" not in d:
        _, lps, n = src
        return [] if lps is None else [dict(x) for x in lps[start:min(end, n)]]
    return list((completion.logprobs or [])[start:end])


def num_prompt_token_ids(output: RequestOutput) -> int:
    """``len(output.prompt_token_ids)`` without copying a snapshot's prompt."""
    d = output.__dict__
    src = d.get("_prompt_src")
    if src is not None and "_prompt_token_ids" not in d:
        return len(src)
    return len(output.prompt_token_ids)


class _SnapshotCompletionOutput(CompletionOutput):
    """A ``CompletionOutput`` the engine builds every step without copying token lists.

    ``token_ids`` and ``logprobs`` are the first ``n`` entries of the sequence's
    own lists, copied when first read (then kept, so reads and writes behave as
    on the plain dataclass). The engine only ever appends to those lists and
    never rewrites an entry, so a later copy holds exactly what a copy made at
    the step would have held. Compares equal to, and prints like, the plain
    ``CompletionOutput`` with the same fields. Built with :meth:`snapshot`; the
    inherited dataclass ``__init__`` (e.g. from ``dataclasses.replace``) works as usual.
    """

    @classmethod
    def snapshot(cls, index, text, tokens_src, n, finish_reason, stop_reason, logprobs_src, cumulative_logprob):
        self = cls.__new__(cls)
        d = self.__dict__
        d["index"], d["text"], d["finish_reason"], d["stop_reason"] = index, text, finish_reason, stop_reason
        d["cumulative_logprob"] = cumulative_logprob
        d["_src"] = (tokens_src, logprobs_src, n)
        return self

    @property
    def token_ids(self) -> list[int]:
        d = self.__dict__
        if "_token_ids" not in d:
            tokens, _, n = d["_src"]
            d["_token_ids"] = tokens[:n]
        return d["_token_ids"]

    @token_ids.setter
    def token_ids(self, value) -> None:
        self.__dict__["_token_ids"] = value

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        d = self.__dict__
        if "_logprobs" not in d:
            _, lps, n = d["_src"]
            d["_logprobs"] = None if lps is None else [dict(x) for x in lps[:n]]
        return d["_logprobs"]

    @logprobs.setter
    def logprobs(self, value) -> None:
        self.__dict__["_logprobs"] = value

    def __eq__(self, other):
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return _fields(self, CompletionOutput) == _fields(other, CompletionOutput)

    def __repr__(self) -> str:
        return _repr(self, CompletionOutput)


class _SnapshotRequestOutput(RequestOutput):
    """A ``RequestOutput`` whose ``prompt_token_ids`` are copied from the
    sequence's (never modified) prompt list when first read; see
    ``_SnapshotCompletionOutput``. Built with :meth:`snapshot`; the inherited
    dataclass ``__init__`` (e.g. from ``dataclasses.replace``) works as usual."""

    @classmethod
    def snapshot(cls, request_id, prompt, prompt_src, outputs, finished, num_cached_tokens, prompt_logprobs=None,
                 speculative=None, first_scheduled_time=None):
        self = cls.__new__(cls)
        d = self.__dict__
        d["request_id"], d["prompt"], d["outputs"] = request_id, prompt, outputs
        d["finished"], d["num_cached_tokens"] = finished, num_cached_tokens
        d["prompt_logprobs"], d["speculative"] = prompt_logprobs, speculative
        d["first_scheduled_time"] = first_scheduled_time
        d["_prompt_src"] = prompt_src
        return self

    @property
    def prompt_token_ids(self) -> list[int]:
        d = self.__dict__
        if "_prompt_token_ids" not in d:
            d["_prompt_token_ids"] = list(d["_prompt_src"])
        return d["_prompt_token_ids"]

    @prompt_token_ids.setter
    def prompt_token_ids(self, value) -> None:
        self.__dict__["_prompt_token_ids"] = value

    def __eq__(self, other):
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return _fields(self, RequestOutput) == _fields(other, RequestOutput)

    def __repr__(self) -> str:
        return _repr(self, RequestOutput)


def _fields(obj, cls) -> tuple:
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(cls) if f.compare)


def _repr(obj, cls) -> str:
    inner = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(cls) if f.repr)
    return f"{cls.__qualname__}({inner})"
