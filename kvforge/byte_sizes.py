"""Byte sizes as people write them: ``85899345920``, ``80GiB``, ``80GB``, ``80e9``, ``1.5GB`` (torch-free).

One rule for the CLI's ``--kv-cache-memory`` / ``--gpu-memory`` and the Python API's ``kv_cache_memory=`` /
``gpu_memory=``: an integer, or a number with a unit (decimal ``k``/``KB`` ... ``TB``, binary ``KiB`` ... ``TiB``;
no unit or ``B``: bytes), at least one byte.
"""

from __future__ import annotations

import numbers
import re

from kvforge.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
EXAMPLES = "8589934592, 8GiB, 80GB"


def parse_byte_size(text: str) -> int:
    """``text`` as a positive number of bytes; ValueError naming the examples otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a byte size (examples: {EXAMPLES})")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
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
