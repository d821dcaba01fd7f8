"""SamplingParams: per-request generation settings (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

from kvforge.errors import InvalidRequestError
from kvforge.structured.params import StructuredOutputsParams

#: The most logprobs a request may ask per token (``logprobs`` and ``prompt_logprobs``), vLLM's default limit.
MAX_LOGPROBS = 20
#: The most ``bad_words`` a request may give (the tokens they encode to are limited too:
#: kvforge/engine/bad_words.py).
MAX_BAD_WORDS = 128

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a seed is a signed 64-bit integer
_INT_FIELDS = ("n", "top_k", "max_tokens", "seed", "logprobs", "prompt_logprobs", "min_tokens", "best_of",
               "truncate_prompt_tokens")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
#: Temperatures below it sample greedily (:attr:`SamplingParams.is_greedy`).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    A temperature below ``GREEDY_TEMPERATURE`` (0 included) means greedy: dividing the logits by a smaller
    one overflows float32 (vLLM draws the same line). top_k <= 0 (or -1) disables top-k; top_p == 1
    and min_p == 0 disable those filters. ``seed`` makes sampling reproducible
    per request regardless of batch composition. ``logprobs`` = number of top
    logprobs to return per generated token (None = none). ``prompt_logprobs`` =
    the same for every prompt token (``RequestOutput.prompt_logprobs``; the first
    prompt token has none); such a request skips the prefix cache for the prompt
    tokens it has not scored yet. ``stop_token_ids`` are extra end ids. As in
    vLLM, neither a ``stop`` string nor the token that stops a request (EOS or
    one of ``stop_token_ids``) is part of the returned text; that token stays
    in ``token_ids``. ``include_stop_str_in_output`` keeps both in the text (the
    text then ends with the stop string or the stop token's text).

    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0: off) lower the logits of tokens already in
    the output, ``repetition_penalty`` (> 0, 1: off) those of tokens in the prompt or the output
    (kvforge/engine/penalties.py has the formulas); logprobs stay those of the raw logits.

    ``n``: independent samples of the prompt. The engine runs one sequence per
    request (``LLMEngine.add_request`` takes n = 1); ``LLM.generate`` and the
    server run sample ``j`` as its own request with :meth:`sample_params`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: ``{token id: bias}`` given, stored as sorted ``(id, bias)`` pairs (hashable); each bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Only these tokens may be sampled (None or empty: any).
    allowed_token_ids: tuple[int, ...] | None = None
    #: vLLM's: words the output never spells in tokens (kvforge/engine/bad_words.py has the rule).
    bad_words: tuple[str, ...] = ()
    #: Output tokens before EOS, a ``stop_token_ids`` entry or a stop string may end the request (vLLM's).
    min_tokens: int = 0
    #: vLLM's: candidates per prompt to pick the best from; only None or ``n`` (no ranking here).
    best_of: int | None = None
    #: vLLM's: keep only the prompt's last ``k`` tokens (-1: as many as leave room in ``max_model_len`` for
    #: ``max_tokens`` generated tokens; None: all of them).
    truncate_prompt_tokens: int | None = None
    #: vLLM's: False leaves the output's text empty (token ids only; no stop strings then).
    detokenize: bool = True
    #: vLLM's: a JSON schema, regex, choice list or grammar the output must match (kvforge/structured/);
    #: a dict of StructuredOutputsParams' fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        # numpy (and other numbers.Integral / numbers.Real) scalars as the Python numbers they stand for.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, plain_int(getattr(self, name)))
        for name in _BOOL_FIELDS:  # a numpy bool as the bool it holds
            value = getattr(self, name)
            if getattr(value, "dtype", None) is not None and getattr(value, "ndim", None) == 0 \
                    and value.dtype.kind == "b":
                object.__setattr__(self, name, bool(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                object.__setattr__(self, name, float(value))
        for name in ("stop_token_ids", "allowed_token_ids"):  # a 1-D numpy (or torch) array of ids as a list
            value = getattr(self, name)
            if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
                object.__setattr__(self, name, value.tolist())
        # Accept lists/str for convenience but store tuples (frozen, hashable).
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, list, tuple)):
                raise InvalidRequestError(f"invalid sampling parameter {name}: expected a list (or one string for "
                                          f"stop), got {type(value).__name__}", field=name)
        if self.bad_words is None or isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple) or not all(type(t) is int for t in self.stop_token_ids):
            object.__setattr__(self, "stop_token_ids", tuple(plain_int(t) for t in self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict) or self.logit_bias is None:
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias or {}))
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, dict)) or not hasattr(self.allowed_token_ids,
                                                                                       "__iter__"):
                raise InvalidRequestError(f"invalid sampling parameter allowed_token_ids: expected a list of token "
                                          f"ids, got {type(self.allowed_token_ids).__name__}",
                                          field="allowed_token_ids")
            ids = tuple(plain_int(t) for t in self.allowed_token_ids)
            object.__setattr__(self, "allowed_token_ids", ids or None)
        object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_value(self.structured_outputs))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the field when a value is out of range."""

        def bad(field_name: str, why: str):
            raise InvalidRequestError(f"invalid sampling parameter {field_name}: {why}", field=field_name)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < float("inf"):
            bad("temperature", f"must be a finite number >= 0 (0: greedy), got {t!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < -1):
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be a signed 64-bit integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp < float("inf"):
            bad("repetition_penalty", f"must be a finite number > 0 (1 = off), got {rp!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            and isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100
            for t, b in self.logit_bias
        ):  # fmt: skip
            bad("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        if self.allowed_token_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids
        ):
            bad("allowed_token_ids", "must be a list of token ids (integers >= 0)")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"only best_of equal to n ({self.n}) is supported, got {self.best_of!r}: kvforge does not "
                           f"rank candidates; drop best_of, or set n={self.best_of} and pick among the outputs")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            bad("truncate_prompt_tokens", f"must be an integer >= 1 (or -1: as many as leave room for max_tokens), "
                                          f"got {k!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} is above max_tokens {self.max_tokens}")
        if not isinstance(self.bad_words, tuple) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of words, each with a character that is not a space")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings are matched in the text, which detokenize=False leaves out: drop stop (or use "
                        "stop_token_ids), or detokenize")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    def sample_params(self, sample: int) -> SamplingParams:
        """The parameters of sample ``sample`` (0 .. n - 1) run as its own request: n = 1 (``best_of``, which
        can only equal n, dropped with it) and, when seeded, ``seed + sample`` (wrapped into the signed 64-bit
        range), so sample 0 is the request with n = 1 and each sample is reproducible on its own; unseeded
        samples draw independently."""
        if not 0 <= sample < self.n:
            raise ValueError(f"sample must be in [0, {self.n}), got {sample}")
        seed = self.seed
        if seed is not None:
            seed = (seed + sample - SEED_MIN) % (1 << 64) + SEED_MIN
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)

    def clone(self, **changes) -> SamplingParams:
        """A copy (vLLM's ``clone``), with ``changes`` applied: the parameters are frozen, so this (or
        ``dataclasses.replace``) is how a changed copy is made."""
        return dataclasses.replace(self, **changes)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def named_token_ids(self) -> dict[str, list[int]]:
        """The token ids the parameters name, by field (``logit_bias``, ``allowed_token_ids``,
        ``stop_token_ids``): each must be in the vocabulary (the engine checks on ``add_request``)."""
        return {"logit_bias": [t for t, _ in self.logit_bias], "allowed_token_ids": list(self.allowed_token_ids or ()),
                "stop_token_ids": list(self.stop_token_ids)}

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def is_decimal_id(text: str) -> bool:
    """Whether ``text`` is a token id written in ASCII decimal digits, as JSON object keys carry them
    (``str.isdigit`` alone also takes superscripts and other scripts' digits, which ``int`` refuses or reads
    as another number)."""
    digits = text.strip()
    return digits.isascii() and digits.isdigit() and len(digits) <= 19


def plain_int(value):
    """A ``numbers.Integral`` that is not a bool (a numpy integer, say) as a Python int; anything else as it is,
    for the caller's check to name."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    """``{id: bias}`` (ids as ints or decimal strings, as JSON sends them) as sorted ``(id, bias)`` pairs;
    values that are not numbers are kept as they are for ``validate`` to name."""
    pairs = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and is_decimal_id(key) else plain_int(key)
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        pairs.append((token, float(value) if number else value))
    try:
        return tuple(sorted(pairs))
    except TypeError:  # mixed key types: left unsorted, refused by validate
        return tuple(pairs)
