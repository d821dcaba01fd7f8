"""FP8 KV-cache storage: dtype names, saturating quantization, scales.

Conventions (they match :mod:`kvforge.attention.metadata`):

* stored   = saturate(x / scale) cast to the fp8 format (round to nearest even)
* restored = stored * scale

``scale`` is float32 and either per-tensor (a Python float, a 0-d tensor or a
1-element tensor) or per-KV-head (shape ``[num_kv_heads]``). The KV-head axis of
the data is ``head_axis`` (default ``-2``, i.e. data shaped ``[..., Hkv, D]``
as in ``k``/``v`` of one step). The attention kernels always receive the
per-head form; :func:`as_head_scales` expands a per-tensor scale to it.

Saturation: finite values beyond the format's max clamp to ``±max``; ``±inf``
clamps to ``±max`` as well; **NaN inputs are stored as 0** (the cache never
holds NaN or inf, so one bad activation cannot poison every later read of the
page). Only fp8 storage is scaled: for model-dtype caches (bf16/fp16/fp32)
:func:`quantize` and :func:`dequantize` are plain casts and ignore ``scale``.

Default scale: :data:`DEFAULT_SCALE` = 1.0. It is what a cache uses when the
checkpoint carries no KV scales and calibration was not asked for (the caller
should warn loudly: with scale 1.0, e4m3 saturates at |x| = 448 and keeps only
~2^-4 relative precision, and values below 2^-9 flush to 0). Calibration
(:func:`compute_scales`) maps the observed absolute maximum onto the format max.

Rounding error of one quantize -> dequantize round trip, for |x / scale| <= max
(derived from the formats, checked by tests/test_fp8.py):

=============  ========  ===========  =========================  ==============
format         mantissa  max          relative bound (normal)     abs bound
                                      |x/scale| >= min normal     (subnormal)
=============  ========  ===========  =========================  ==============
float8_e4m3fn  3 bits    448          2^-4 (half ulp)             2^-10 * scale
float8_e5m2    2 bits    57344        2^-3 (half ulp)             2^-17 * scale
=============  ========  ===========  =========================  ==============

min normal is 2^-6 for e4m3fn and 2^-14 for e5m2; the subnormal spacing is
2^-9 and 2^-16, so the absolute error below min normal is half of it. The
combined bound is ``|restored - x| <= max(rel * |x|, abs)`` (plus float32
rounding of the division/multiplication by ``scale``, ~2^-24 relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_SCALE",
    "FP8_DTYPES",
    "Fp8Format",
    "KV_DTYPE_NAMES",
    "as_head_scales",
    "compute_scales",
    "dequantize",
    "fp8_format",
    "fp8_max",
    "is_fp8",
    "quantize",
    "resolve_kv_dtype",
    "storage_dtype_name",
]

DEFAULT_SCALE: float = 1.0
"""Scale used when neither the checkpoint nor calibration provides one."""

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

# Storage dtype names accepted by --kv-cache-dtype (lower-cased). "auto" means
# the model dtype and is resolved by resolve_kv_dtype.
KV_DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}

_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The canonical (torch-free) name of every storage and model dtype, as plans and routing tables spell them.
_CANONICAL_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def storage_dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"fp8_e4m3"``, ``torch.bfloat16`` -> ``"bfloat16"`` (the names of
    :mod:`kvforge.kv_dtypes`); any other dtype -> ``str(dtype)``, which no routing table accepts."""
    return _CANONICAL_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class Fp8Format:
    """Numeric facts about one fp8 storage format (all exact powers of two)."""

    dtype: torch.dtype
    mantissa_bits: int
    max: float  # largest finite value (saturation target)
    min_normal: float  # smallest positive normal value
    subnormal_step: float  # spacing of subnormals (= smallest positive value)

    @property
    def rel_error_bound(self) -> float:
        """Half-ulp relative rounding error in the normal range: 2^-(mantissa_bits+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def abs_error_bound(self) -> float:
        """Absolute rounding error (in units of scale) below ``min_normal``: half a subnormal step."""
        return self.subnormal_step / 2.0


_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, 3, 448.0, 2.0**-6, 2.0**-9),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, 2, 57344.0, 2.0**-14, 2.0**-16),
}


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 storage dtypes this engine supports (e4m3fn, e5m2)."""
    return dtype in _FORMATS


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    """The :class:`Fp8Format` of ``dtype``; ValueError for a non-fp8 dtype."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not a supported fp8 dtype (supported: {list(_FORMATS)})") from None


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of the fp8 format: 448.0 (e4m3fn) or 57344.0 (e5m2)."""
    return fp8_format(dtype).max


def resolve_kv_dtype(name: str | torch.dtype, model_dtype: torch.dtype | None = None) -> torch.dtype:
    """Map a KV storage dtype name (``--kv-cache-dtype``) to a torch dtype.

    Accepted names (case-insensitive): ``auto`` (= ``model_dtype``, which must
    then be given), ``bf16``/``bfloat16``, ``fp16``/``float16``/``half``,
    ``fp32``/``float32``/``float``, ``fp8`` (= ``fp8_e4m3`` = e4m3fn),
    ``fp8_e4m3fn``/``float8_e4m3fn``, ``fp8_e5m2``/``float8_e5m2``. A torch
    dtype is accepted as-is if it is one of those. Anything else raises
    ValueError listing the valid names.
    """
    if isinstance(name, torch.dtype):
        if name in _MODEL_DTYPES or name in _FORMATS:
            return name
        raise ValueError(f"unsupported KV cache dtype {name}")
    key = str(name).strip().lower()
    if key not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown KV cache dtype {name!r}; valid: {', '.join(KV_DTYPE_NAMES)}")
    dtype = KV_DTYPE_NAMES[key]
    if dtype is None:
        if model_dtype is None:
            raise ValueError("kv cache dtype 'auto' needs the model dtype")
        if model_dtype not in _MODEL_DTYPES:
            raise ValueError(f"model dtype {model_dtype} cannot be a KV storage dtype")
        return model_dtype
    return dtype


def as_head_scales(
    scale: float | torch.Tensor | None,
    num_kv_heads: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return ``scale`` as the contract's float32 ``[num_kv_heads]`` tensor.

    Accepts None (-> :data:`DEFAULT_SCALE`), a Python number, a 0-d or
    1-element tensor (per-tensor: repeated), or a ``[num_kv_heads]`` tensor.
    """
    if scale is None:
        scale = DEFAULT_SCALE
    if not isinstance(scale, torch.Tensor):
        s = float(scale)
        if not (s > 0.0 and s < float("inf")):
            raise ValueError(f"fp8 scale must be positive and finite, got {s}")
        return torch.full((num_kv_heads,), s, dtype=torch.float32, device=device)
    t = scale.to(device=device if device is not None else scale.device, dtype=torch.float32)
    if t.numel() == 1:
        return t.reshape(1).expand(num_kv_heads).contiguous()
    if t.dim() != 1 or t.shape[0] != num_kv_heads:
        raise ValueError(f"scale must be per-tensor or shape [{num_kv_heads}], got {tuple(t.shape)}")
    return t


def _broadcast_scale(scale: float | torch.Tensor, x: torch.Tensor, head_axis: int) -> torch.Tensor | float:
    """Shape ``scale`` so it broadcasts against ``x`` along ``head_axis``."""
    if not isinstance(scale, torch.Tensor):
        return float(scale)
    s = scale.to(device=x.device, dtype=torch.float32)
    if s.numel() == 1:
        return s.reshape(())
    if s.dim() != 1:
        raise ValueError(f"scale must be a scalar or 1-D per-head tensor, got shape {tuple(s.shape)}")
    axis = head_axis % x.dim()
    if x.shape[axis] != s.shape[0]:
        raise ValueError(f"per-head scale has {s.shape[0]} entries but axis {head_axis} of x has {x.shape[axis]}")
    shape = [1] * x.dim()
    shape[axis] = s.shape[0]
    return s.reshape(shape)


def quantize(
    x: torch.Tensor,
    scale: float | torch.Tensor,
    dtype: torch.dtype,
    head_axis: int = -2,
) -> torch.Tensor:
    """Saturating quantization: ``cast(clamp(x / scale, -max, max))`` to ``dtype``.

    ``scale``: per-tensor (number, 0-d or 1-element tensor) or per-KV-head
    (``[Hkv]`` matched against ``x.shape[head_axis]``); must be positive and
    finite (not checked for tensors, to avoid a device sync). The division is
    done in float32; the cast rounds to nearest even. ``±inf`` and out-of-range
    values become ``±max``; NaN becomes 0. The result never holds NaN or inf.
    For a non-fp8 ``dtype`` this is a plain cast and ``scale`` is ignored.
    See the module docstring for the rounding error bounds.
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = fp8_max(dtype)
    y = x.to(torch.float32) / _broadcast_scale(scale, x, head_axis)
    y = torch.nan_to_num(y, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax)
    return y.to(dtype)


def dequantize(
    q: torch.Tensor,
    scale: float | torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    head_axis: int = -2,
) -> torch.Tensor:
    """``q * scale`` computed in float32, returned as ``out_dtype``.

    Same ``scale`` shapes as :func:`quantize`. For a non-fp8 ``q`` this is a
    plain cast and ``scale`` is ignored (model-dtype caches are unscaled).
    """
    if not is_fp8(q.dtype):
        return q.to(out_dtype)
    return (q.to(torch.float32) * _broadcast_scale(scale, q, head_axis)).to(out_dtype)


def compute_scales(
    x: torch.Tensor,
    scheme: str = "per_tensor",
    dtype: torch.dtype = torch.float8_e4m3fn,
    head_axis: int = -2,
) -> torch.Tensor:
    """Calibrated scale(s) ``amax / fmax`` from a sample of K or V.

    Used for "calibrate on the first batch": the largest finite ``|x|`` maps
    exactly onto the format max, so the sample itself never saturates.
    ``scheme="per_tensor"`` returns a 0-d float32 tensor (amax over all of
    ``x``); ``scheme="per_head"`` returns float32 ``[Hkv]`` (amax over all
    axes but ``head_axis``). NaN and inf in the sample are ignored. A head (or
    tensor) whose sample is all zeros gets :data:`DEFAULT_SCALE` (1.0). Scales
    are clamped below at the smallest normal float32 so they stay positive.
    """
    fmax = fp8_max(dtype)
    a = x.detach().to(torch.float32).abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    if scheme == "per_tensor":
        amax = a.amax() if a.numel() else torch.zeros((), device=a.device)
    elif scheme == "per_head":
        axis = head_axis % a.dim()
        heads = a.movedim(axis, 0).reshape(a.shape[axis], -1)
        amax = heads.amax(dim=1) if heads.shape[1] else torch.zeros(heads.shape[0], device=a.device)
    else:
        raise ValueError(f"unknown scale scheme {scheme!r} (use 'per_tensor' or 'per_head')")
    scale = (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, torch.full_like(scale, DEFAULT_SCALE))
