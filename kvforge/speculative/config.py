"""SpeculativeConfig: the ``--speculative-config`` JSON (vLLM's keys), parsed and checked.

Accepted keys: ``method`` (``ngram``, ``draft_model``, ``mtp``; vLLM's ``[ngram]`` means ``ngram``, its
``deepseek_mtp`` and ``qwen3_next_mtp`` mean ``mtp``), ``num_speculative_tokens``,
``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram only) and ``model`` (draft_model only). Without a
method (or with null) it is inferred as vLLM does: a ``model`` of ``ngram`` / ``[ngram]`` is the ngram
method, another ``model`` a draft model, no model ngram. vLLM's ``draft_tensor_parallel_size`` and
``disable_logprobs`` are taken and change nothing; its other keys are refused with the reason.
``--num-speculative-tokens N`` alone means ``{"method": "ngram", "num_speculative_tokens": N}``.
Everything here is checked without reading a model; what depends on the model (an MTP layer, the
plan's limits) is checked by ``kvforge/speculative/support.py``, still before weights load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvforge.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp")
#: vLLM's per-family names of the MTP method -> the method (the checkpoint's architecture picks the layer).
METHOD_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "[ngram]": "ngram"}
#: vLLM's ``model`` values that name the n-gram proposer rather than a draft model.
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
#: n-gram sizes when the config names neither bound: look for the longest suffix of up to 5 tokens,
#: and never propose from a single-token match (too often a coincidence).
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 2
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "backoff"}
#: vLLM's keys taken without effect: the draft runs at the target's tensor-parallel size (its layers are
#: planned in the target's groups), and no draft logprobs are ever computed.
_NEUTRAL_KEYS = {"draft_tensor_parallel_size": "an integer >= 1", "disable_logprobs": "true or false"}
#: vLLM's keys that would change what runs, refused with what to do instead.
_REFUSED_KEYS = {
    "disable_by_batch_size": "kvforge speculates at every batch size; its back-off skips proposals for a "
                             "sequence whose proposals keep being rejected (\"backoff\")",
    "speculative_token_tree": "tree proposals are not supported: proposals form one chain",
    "max_model_len": "the draft shares the target's --max-model-len",
    "quantization": "the draft model loads as its checkpoint stores it",
    "revision": "give the path of the draft's checkout", "code_revision": "give the path of the draft's checkout",
}
_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"--speculative-config: {name} must be an integer >= {minimum}, got {value!r}; set "
                          f"{name} to {minimum} or more, or omit --speculative-config to decode without speculation")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. ``num_speculative_tokens``: proposals per decoding sequence and step
    (the plan reserves room for them). ``prompt_lookup_min/max``: the n-gram sizes the ngram method
    matches, longest first. ``model``: the draft model (draft_model method). ``backoff``: a sequence whose
    probes keep gaining nothing skips proposals for a growing number of steps
    (:mod:`kvforge.speculative.backoff`; False: proposals every step)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    backoff: bool = True

    def __post_init__(self):
        if not isinstance(self.backoff, bool):
            raise ConfigError(f"--speculative-config: backoff must be true or false, got {self.backoff!r}")
        if self.method in METHOD_ALIASES:
            object.__setattr__(self, "method", METHOD_ALIASES[self.method])
        if self.method not in METHODS:
            raise ConfigError(f"--speculative-config: unknown method {self.method!r}; use one of "
                              f"{', '.join(METHODS)} (example: {_EXAMPLE})")
        _count("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None:
                _count("prompt_lookup_min", lo, 1)
            if hi is not None:
                _count("prompt_lookup_max", hi, 1)
            if lo is None and hi is None:
                lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
            elif lo is None:  # one bound given: the other equals it, as vLLM reads the same line
                lo = hi
            elif hi is None:
                hi = lo
            if lo > hi:
                raise ConfigError(f"--speculative-config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi}); "
                                  "the shortest n-gram to match must not be longer than the longest")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ConfigError("--speculative-config: method ngram takes no model; use method draft_model "
                                  "for a draft model")
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"--speculative-config: {key} applies to method ngram only, not "
                                      f"{self.method}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ConfigError('--speculative-config: method draft_model needs "model" (an HF directory, '
                              '.gguf file or preset sharing the target\'s tokenizer)')
        if self.method == "mtp" and self.model is not None:
            raise ConfigError("--speculative-config: method mtp uses the target checkpoint's own MTP layer; "
                              "drop \"model\"")

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, got {type(data).__name__} "
                              f"(example: {_EXAMPLE})")
        for key, why in _REFUSED_KEYS.items():
            if data.get(key) is not None:
                raise ConfigError(f"--speculative-config: {key} is not supported: {why}")
        for key, wanted in _NEUTRAL_KEYS.items():
            value = data.get(key)
            ok = value is None or (isinstance(value, bool) if key == "disable_logprobs"
                                   else not isinstance(value, bool) and isinstance(value, int) and value >= 1)
            if not ok:
                raise ConfigError(f"--speculative-config: {key} must be {wanted}, got {value!r}")
        unknown = sorted(set(data) - _KEYS - set(_NEUTRAL_KEYS) - set(_REFUSED_KEYS))
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; accepted: "
                              f"{', '.join(sorted(_KEYS))}")
        if "num_speculative_tokens" not in data:
            raise ConfigError(f"--speculative-config needs num_speculative_tokens (example: {_EXAMPLE})")
        method, model = data.get("method"), data.get("model")
        if isinstance(model, str) and model.strip().lower() in NGRAM_MODEL_NAMES and method in (None, *NGRAM_MODEL_NAMES):
            method, model = "ngram", None  # vLLM's spelling of the n-gram proposer as a model
        if method is None:  # inferred as vLLM does: a model is a draft model, none is the n-gram proposer
            method = "draft_model" if model is not None else "ngram"
        return cls(method=method, num_speculative_tokens=data["num_speculative_tokens"],
                   prompt_lookup_min=data.get("prompt_lookup_min"), prompt_lookup_max=data.get("prompt_lookup_max"),
                   model=model, backoff=data.get("backoff", True))

    @classmethod
    def parse(cls, value) -> SpeculativeConfig:
        """A SpeculativeConfig, a dict, or its JSON text."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}); "
                                  f"example: {_EXAMPLE}") from None
        return cls.from_dict(value)


def resolve_speculative(speculative_config, num_speculative_tokens: int) -> SpeculativeConfig | None:
    """The one speculative setting of ``--speculative-config`` and ``--num-speculative-tokens``: the config
    when given (a shorthand that disagrees with it is an error), else ngram with the shorthand's count,
    else None (no speculation)."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
            or num_speculative_tokens < 0:
        raise ConfigError(f"--num-speculative-tokens must be an integer >= 0, got {num_speculative_tokens!r}")
    if speculative_config is None:
        return SpeculativeConfig("ngram", num_speculative_tokens) if num_speculative_tokens else None
    config = SpeculativeConfig.parse(speculative_config)
    if num_speculative_tokens and num_speculative_tokens != config.num_speculative_tokens:
        raise ConfigError(f"--num-speculative-tokens {num_speculative_tokens} disagrees with --speculative-config's "
                          f"num_speculative_tokens {config.num_speculative_tokens}; give one of them")
    return config
