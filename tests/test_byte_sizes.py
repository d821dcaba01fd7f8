"""Byte sizes (kvforge/byte_sizes.py): one-letter units as vLLM reads them (lowercase decimal, uppercase binary),
KB..TB decimal and KiB..TiB binary in any case, and a refusal that names the examples."""

from __future__ import annotations

import pytest

from kvforge.byte_sizes import byte_count, parse_byte_size
from kvforge.errors import ConfigError


@pytest.mark.parametrize("text, value", [
    ("1024", 1024), ("1G", 1 << 30), ("1g", 10**9), ("8K", 8192), ("8k", 8000), ("2T", 2 << 40), ("1.5G", 3 << 29),
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("8GiB", 8 << 30), ("8gib", 8 << 30), ("2B", 2), ("80e9", 80 * 10**9),
])
def test_units(text, value):
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text", ["GB", "1x", "1 Gi", "-1G", "0.1"])
def test_not_a_size(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_byte_size(text)


def test_byte_count_takes_integers_and_sizes_and_names_the_setting():
    np = pytest.importorskip("numpy")
    assert byte_count("--kv-cache-memory", np.int64(5)) == 5 and byte_count("--kv-cache-memory", "1M") == 1 << 20
    with pytest.raises(ConfigError, match="--gpu-memory: 'lots' is not a byte size"):
        byte_count("--gpu-memory", "lots")
    with pytest.raises(ConfigError, match="--gpu-memory must be >= 1 byte"):
        byte_count("--gpu-memory", 0)
