"""The planner's inputs: cache and parallel settings (validated, frozen)."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.byte_sizes import byte_count, parse_token_count
from kvforge.errors import ConfigError
from kvforge.kv_dtypes import canonical_kv_dtype

PLATFORMS = ("cpu", "cuda")
SCALE_SCHEMES = ("per_tensor", "per_head")
#: Share of the GPU's memory a run plans for (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: Sequences one step may run when --max-num-seqs is not given.
DEFAULT_MAX_NUM_SEQS = 256
#: KV cache bytes on CPU when --kv-cache-memory is not given (a CPU has no "free device memory" to size from).
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
#: ``--max-model-len auto`` (vLLM's ``auto`` / ``-1``): the longest length up to the model's context length
#: whose one sequence the plan holds (kvforge/planner/fitted_len.py).
AUTO_MAX_MODEL_LEN = "auto"
#: How --max-model-len spells it (any case).
AUTO_MAX_MODEL_LEN_SPELLINGS = ("auto", "-1")


def model_len_setting(name: str, value) -> int | str:
    """``--max-model-len`` as a setting: a token count (:func:`_token_count`), or AUTO_MAX_MODEL_LEN for
    ``"auto"`` / ``-1`` (vLLM's spellings of the fitted length)."""
    if isinstance(value, str) and value.strip().lower() in AUTO_MAX_MODEL_LEN_SPELLINGS:
        return AUTO_MAX_MODEL_LEN
    if not isinstance(value, bool) and isinstance(value, int) and value == -1:
        return AUTO_MAX_MODEL_LEN
    return _token_count(name, value)


def _token_count(name: str, value) -> int:
    """A count of tokens given as an integer or as vLLM's human-readable text ('128K', '25.6k')."""
    if isinstance(value, str):
        try:
            return parse_token_count(value)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    return _positive_int(name, value)


def _positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")
    return value


def resolve_kv_cache_memory(kv_cache_memory: int | None, device: str) -> int | None:
    """KV cache bytes the engine plans with: ``kv_cache_memory`` when set; on CPU (which never sizes from
    the GPU memory flags) DEFAULT_CPU_KV_CACHE_MEMORY; otherwise None (capacity from the GPU's memory)."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    return DEFAULT_CPU_KV_CACHE_MEMORY if device == "cpu" else None


def gpu_memory_flag_ignored_on_cpu(kv_cache_memory: int | None, gpu_memory: int | None,
                                   gpu_memory_utilization: float) -> str | None:
    """The warning for GPU memory flags given to a CPU engine, or None: the CPU sizes its KV cache from
    ``--kv-cache-memory`` alone (DEFAULT_CPU_KV_CACHE_MEMORY when unset) and has no device memory to check a
    plan against, so ``--gpu-memory`` and ``--gpu-memory-utilization`` change nothing there. The engine and
    ``kvforge plan --device cpu`` both ask here, and both then plan without them."""
    flags = (["--gpu-memory"] if gpu_memory is not None else []) + (
        [f"--gpu-memory-utilization {gpu_memory_utilization}"]
        if gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION else [])
    if not flags:
        return None
    size = (f"default {DEFAULT_CPU_KV_CACHE_MEMORY >> 30} GiB" if kv_cache_memory is None
            else f"{kv_cache_memory:,} bytes")
    return (f"{' and '.join(flags)} {'has' if len(flags) == 1 else 'have'} no effect on CPU: the KV cache gets "
            f"--kv-cache-memory ({size})")


def resolve_max_num_seqs(max_num_seqs: int | None, max_num_batched_tokens: int | None) -> int:
    """Sequences one step may run. A step gives each running sequence at least one token, so the token
    budget must hold them: both given and the budget smaller is a ConfigError naming both; the budget alone
    caps the default DEFAULT_MAX_NUM_SEQS at itself; neither given is the default. The engine
    (EngineArgs) and the planner (``kvforge.plan``, ``kvforge plan``) both ask here."""
    seqs = max_num_seqs
    budget = None if max_num_batched_tokens is None else _token_count("--max-num-batched-tokens",
                                                                       max_num_batched_tokens)
    if seqs is None:
        return budget if budget is not None and budget < DEFAULT_MAX_NUM_SEQS else DEFAULT_MAX_NUM_SEQS
    if isinstance(seqs, str) and seqs.strip().isdigit():  # as the other counts take it from text
        seqs = int(seqs)
    if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
        raise ConfigError(f"--max-num-seqs must be an integer >= 1, got {seqs!r}")
    if budget is not None and budget < seqs:
        raise ConfigError(
            f"--max-num-batched-tokens {budget} is below --max-num-seqs {seqs}: a step gives every running "
            f"sequence at least one token, so it could not run {seqs} at once; raise --max-num-batched-tokens "
            f"to at least {seqs}, or lower --max-num-seqs to at most {budget} (or drop --max-num-seqs: it then "
            f"follows the budget)")
    return seqs


#: ``--query-dtype`` values (CacheConfig.query_dtype).
QUERY_DTYPE_CHOICES: tuple[str, ...] = ("auto", "model", "fp8")
#: ``--state-dtype`` values (CacheConfig.state_dtype): the storage dtype of linear-attention state slots.
STATE_DTYPE_CHOICES: tuple[str, ...] = ("auto", "model", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache settings as the user gave them (``None`` = let the planner decide).

    Memory: ``kv_cache_memory`` (bytes for the KV cache on one rank) wins;
    otherwise ``gpu_memory`` x ``gpu_memory_utilization`` minus the weights on
    one rank and the activation reserve of a step of ``max_num_batched_tokens``
    tokens (None: the platform's default budget; kvforge/planner/activations.py).
    With neither, the plan has no capacity figures.
    """

    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    #: None: the model's context length; AUTO_MAX_MODEL_LEN: the longest that fits (kvforge/planner/fitted_len.py).
    max_model_len: int | str | None = None
    num_speculative_tokens: int = 0
    kv_cache_memory: int | None = None
    gpu_memory: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_scale_scheme: str = "per_tensor"
    calculate_kv_scales: bool = False
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    #: "auto": the model dtype, except where a backend declares a quantized query that is not opt-in (none of
    #: the built-in backends does); "model": always the model dtype; "fp8": the backend's declared quantized
    #: query on every attention layer, or a PlanError naming the layers that cannot take it
    #: (kvforge/planner/query_dtype.py).
    query_dtype: str = "auto"
    #: State slots of linear-attention layers: "auto" (float32; the resolver's ``state_dtype`` says why), "model" (the model
    #: dtype) or an explicit float dtype. Never quantized: the state is rewritten every token.
    state_dtype: str = "auto"
    #: Tokens one step may compute (None: the platform's default, raised to ``max_num_seqs``).
    max_num_batched_tokens: int | None = None
    #: Without chunked prefill a prompt runs in one step, so a step holds at least max model len tokens
    #: (the activation reserve and the sliding groups' chunk are sized for it; as vLLM schedules).
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_dtype(self.kv_cache_dtype))
        if self.block_size is not None:
            object.__setattr__(self, "block_size", _positive_int("--block-size", self.block_size))
        if self.max_model_len is not None:
            object.__setattr__(self, "max_model_len", model_len_setting("--max-model-len", self.max_model_len))
        object.__setattr__(self, "num_speculative_tokens",
                           _positive_int("--num-speculative-tokens", self.num_speculative_tokens, allow_zero=True))
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", byte_count("--kv-cache-memory", self.kv_cache_memory))
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", byte_count("--gpu-memory", self.gpu_memory))
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util!r}")
        if self.kv_scale_scheme not in SCALE_SCHEMES:
            raise ConfigError(f"--kv-scale-scheme must be one of {', '.join(SCALE_SCHEMES)}, got {self.kv_scale_scheme!r}")
        object.__setattr__(self, "max_num_seqs", _positive_int("--max-num-seqs", self.max_num_seqs))
        if self.max_num_batched_tokens is not None:
            object.__setattr__(self, "max_num_batched_tokens",
                               _token_count("--max-num-batched-tokens", self.max_num_batched_tokens))
        if self.query_dtype not in QUERY_DTYPE_CHOICES:
            raise ConfigError(f"--query-dtype must be one of {', '.join(QUERY_DTYPE_CHOICES)}, got "
                              f"{self.query_dtype!r}")
        if self.state_dtype not in STATE_DTYPE_CHOICES:
            raise ConfigError(f"--state-dtype must be one of {', '.join(STATE_DTYPE_CHOICES)}, got "
                              f"{self.state_dtype!r} (a linear-attention state is never quantized)")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self):
        object.__setattr__(self, "tensor_parallel_size",
                           _positive_int("--tensor-parallel-size", self.tensor_parallel_size))


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ConfigError(f"--device must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    return platform
