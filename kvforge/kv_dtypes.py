"""KV-cache storage dtype names and sizes, without importing torch.

Canonical names: ``bfloat16``, ``float16``, ``float32``, ``fp8_e4m3``,
``fp8_e5m2``. ``auto`` means "the model dtype" and is resolved by the planner.
Aliases follow vLLM's ``--kv-cache-dtype`` habits (``fp8`` is e4m3).
"""

from __future__ import annotations

from kvforge.errors import ConfigError

BYTES_PER_ELEMENT: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

QUANTIZED = frozenset({"fp8_e4m3", "fp8_e5m2"})
MODEL_DTYPES = frozenset({"bfloat16", "float16", "float32"})

_ALIASES = {
    "auto": "auto",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


def canonical_kv_dtype(name: str) -> str:
    """Map a user-facing KV dtype name to its canonical name (or ``auto``)."""
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ConfigError(
            f"unknown KV cache dtype {name!r}; use one of: auto, bfloat16 (bf16), float16 (fp16), float32 (fp32), "
            f"fp8 (= fp8_e4m3), fp8_e5m2"
        )
    return _ALIASES[key]


def canonical_model_dtype(name: str) -> str:
    """Map a model dtype name (config ``torch_dtype`` or ``--dtype``) to a canonical name."""
    key = str(name).strip().lower().removeprefix("torch.")
    canon = _ALIASES.get(key)
    if canon not in MODEL_DTYPES:
        raise ConfigError(f"unknown model dtype {name!r}; use one of: bfloat16, float16, float32")
    return canon


def platform_model_dtype(requested: str | None, platform: str, config_dtype: str) -> str:
    """The model dtype a run uses: ``requested`` (``--dtype``; None or ``auto``: not given), else float32 on
    CPU (fast and exact there), else the checkpoint config's ``config_dtype``. The engine and ``plan``
    both ask here, so a plan predicts the engine's model dtype, KV dtype and bytes per token."""
    if requested and requested != "auto":
        try:
            return canonical_model_dtype(requested)
        except ConfigError:
            raise ConfigError(f"--dtype {requested!r} is not a model dtype; use one of: auto (the checkpoint's on "
                              f"GPU, float32 on CPU), bfloat16, float16, float32") from None
    return "float32" if platform == "cpu" else canonical_model_dtype(config_dtype)


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANTIZED
