"""kvforge.weights: checkpoint formats -> model parameters.

``load_weights(model, model_path, load_format)`` dispatches on the format:
``safetensors`` (HF directory), ``gguf`` (a file, or a directory holding one),
``dummy`` (seeded random) or ``auto``. ``load_config(model_path)`` returns the
HF-style config dict for either kind of checkpoint.

This package's ``__init__`` imports nothing heavy: the planner imports
``kvforge.weights.gguf_config`` and must not pull in torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.errors import ConfigError

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def find_gguf_file(model_path: str | Path) -> Path:
    p = Path(model_path)
    if p.is_file():
        return p
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ConfigError(
                f"{p} holds several GGUF files ({', '.join(f.name for f in files)}); pass one file"
            )
    raise ConfigError(f"no GGUF file at {p}")


def detect_load_format(model_path: str | Path) -> str:
    """``safetensors`` or ``gguf`` for a checkpoint path; ConfigError when neither is there."""
    p = Path(model_path)
    if p.is_file():
        from kvforge.weights.gguf_config import is_gguf_file

        if is_gguf_file(p):
            return "gguf"
        raise ConfigError(f"{p} is a file but not a GGUF file; pass an HF directory or a .gguf file")
    if p.is_dir():
        if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file():
            return "safetensors"
        if any(p.glob("*.gguf")):
            return "gguf"
        raise ConfigError(
            f"{p} has neither *.safetensors nor *.gguf weights (pickle .bin files are never loaded)"
        )
    raise ConfigError(f"model path {p} does not exist")


def load_config(model_path: str | Path) -> dict:
    """HF-style config: ``config.json`` of a directory, or GGUF metadata (torch-free)."""
    p = Path(model_path)
    if p.is_dir() and (p / "config.json").is_file():
        with open(p / "config.json") as f:
            return json.load(f)
    try:
        gguf_path = find_gguf_file(p)
    except ConfigError:
        raise ConfigError(f"{p}: no config.json and no GGUF file") from None
    from kvforge.weights.gguf_config import read_gguf_config

    return read_gguf_config(str(gguf_path))


def load_weights(
    model, model_path, load_format: str = "auto", seed: int = 0, progress: bool | None = None
) -> None:
    """Fill every parameter of ``model`` (built by ``kvforge.models.registry.build_model``).

    Raises ConfigError for an unknown format, an unusable path, tensors the model
    has no place for, shape mismatches, or parameters the checkpoint lacks.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        from kvforge.weights.dummy import fill_dummy_weights

        fill_dummy_weights(model, seed=seed)
        return
    if load_format == "auto":
        load_format = detect_load_format(model_path)
    if load_format == "safetensors":
        from kvforge.weights.safetensors_loader import iterate_safetensors

        loaded = model.load_weights(iterate_safetensors(model_path, progress=progress))
    else:
        from kvforge.weights.gguf_loader import iterate_gguf

        gguf_path = find_gguf_file(model_path)
        loaded = model.load_weights(iterate_gguf(str(gguf_path), config=model.config, progress=progress))
    missing = sorted(set(model.hf_param_names()) - set(loaded))
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ConfigError(
            f"checkpoint at {model_path} lacks {len(missing)} tensor(s) the model needs: {shown}"
        )
