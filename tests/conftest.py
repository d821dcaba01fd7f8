"""Shared fixtures: the embedded SmolLM2 engine is loaded once per session per config."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_ENGINES: dict = {}


@pytest.fixture(scope="session")
def smol_llm():
    """Factory: ``smol_llm(**engine_kwargs)`` -> a cached kvforge.LLM on the embedded model."""
    from kvforge import LLM

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(progress=False, **kwargs)
        return _ENGINES[key]

    return make
