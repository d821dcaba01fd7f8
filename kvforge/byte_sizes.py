"""Byte sizes as people write them: ``85899345920``, ``80GiB``, ``80GB``, ``80e9``, ``1.5GB``, and token
counts as vLLM reads them: ``131072``, ``128K``, ``128k``, ``25.6k`` (torch-free).

One rule for the CLI's ``--kv-cache-memory`` / ``--gpu-memory`` and the Python API's ``kv_cache_memory=`` /
``gpu_memory=``: an integer, or a number with a unit, at least one byte. A one-letter unit follows vLLM's
human-readable numbers: lowercase decimal (``8g`` = 8e9), uppercase binary (``8G`` = 8 GiB); ``KB`` ... ``TB``
(any case) are decimal and ``KiB`` ... ``TiB`` binary; no unit or ``B``: bytes.
"""

from __future__ import annotations

import numbers
import re

from kvforge.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}
#: One-letter units, case-sensitive as vLLM reads them.
_LETTERS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
EXAMPLES = "8589934592, 8GiB, 8G, 80GB"


def parse_byte_size(text: str) -> int:
    """``text`` as a positive number of bytes; ValueError naming the examples otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2) if m else None
    scale = _LETTERS.get(unit) if unit is not None and len(unit) == 1 and unit not in "bB" else (
        _UNITS.get(unit.lower()) if unit is not None else None)
    if scale is None:
        raise ValueError(f"{text!r} is not a byte size (examples: {EXAMPLES})")
    value = float(m.group(1)) * scale
    if value < 1:
        raise ValueError(f"{text!r}: a byte size must be >= 1")
    return int(value)


def byte_count(name: str, value) -> int:
    """``value`` (an integer, numpy's included, or a size string) as bytes; ConfigError naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1 byte, got {value}")
        return int(value)
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    if isinstance(value, str):
        try:
            return parse_byte_size(value)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    raise ConfigError(f"{name} must be a byte count (an integer, or a size such as {EXAMPLES}), got {value!r}")


_TOKEN_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
TOKEN_EXAMPLES = "131072, 128K = 131072, 128k = 128000"


def parse_token_count(text: str) -> int:
    """A positive count of tokens, plain or human-readable as vLLM takes it: '131072', '128K' (x 1024),
    '128k' (x 1000), '25.6k'; lowercase multipliers are decimal, uppercase binary (whole numbers only).
    ValueError naming the examples otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)([kmgKMG]?)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a token count (examples: {TOKEN_EXAMPLES})")
    number, unit = m.groups()
    if "." in number and unit not in ("k", "m", "g"):
        raise ValueError(f"{text!r}: a fraction needs a decimal multiplier (k, m, g), e.g. 25.6k")
    value = float(number) * _TOKEN_MULTIPLIERS[unit] if "." in number else int(number) * _TOKEN_MULTIPLIERS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    if value < 1:
        raise ValueError(f"{text!r} must be >= 1")
    return int(value)
