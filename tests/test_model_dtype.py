"""The model dtype a run takes (``--dtype``; kvforge/kv_dtypes.py ``platform_model_dtype``, which the engine
and ``kvforge plan`` both ask): the flag's value, else float32 on CPU and the checkpoint's on GPU; an
unknown value names the flag and every accepted value."""

from __future__ import annotations

import pytest

from kvforge.errors import ConfigError
from kvforge.kv_dtypes import platform_model_dtype


@pytest.mark.parametrize("requested, platform, config, expected", [
    (None, "cpu", "bfloat16", "float32"), ("auto", "cuda", "bfloat16", "bfloat16"), ("auto", "cuda", "float16", "float16"),
    ("bf16", "cpu", "float32", "bfloat16"), ("float16", "cuda", "bfloat16", "float16"),
])
def test_the_flag_else_the_platforms_choice(requested, platform, config, expected):
    assert platform_model_dtype(requested, platform, config) == expected


def test_an_unknown_dtype_names_the_flag_and_auto():
    with pytest.raises(ConfigError, match=r"--dtype 'int8' is not a model dtype; use one of: auto .*float32"):
        platform_model_dtype("int8", "cpu", "bfloat16")
