"""Resolve a MODEL argument (path, GGUF file, preset name or None) to a ModelSpec.

Only configuration is read here: config.json, or the metadata of a GGUF file.
No weight tensor is ever opened, so every plan error surfaces before loading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvforge.errors import ConfigError
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.embedded import EMBEDDED_NAME, embedded_model_path
from kvforge.spec.model_spec import ModelSpec
from kvforge.spec.presets import PRESETS


def _read_config_json(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is neither a GGUF file nor a JSON config (not UTF-8 text); pass an HF model "
                          "directory, its config.json, or a GGUF file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def load_hf_config(model: str | None) -> tuple[dict, str, str]:
    """Return (hf_config, display name, source description) for MODEL."""
    if model is None:
        path = embedded_model_path()
        from kvforge.weights.gguf_config import read_gguf_config

        return read_gguf_config(path), EMBEDDED_NAME, f"embedded GGUF {path.name}"
    path = Path(model)
    if path.is_dir():
        cfg_path = path / "config.json"
        if cfg_path.is_file():
            return _read_config_json(cfg_path), path.name, str(cfg_path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ConfigError(f"{path} holds no config.json (and not exactly one .gguf file); pass a model directory")
    if path.is_file():
        from kvforge.weights.gguf_config import is_gguf_file, read_gguf_config

        if is_gguf_file(path):
            return read_gguf_config(path), path.stem, str(path)
        return _read_config_json(path), path.parent.name or path.stem, str(path)
    key = model.strip().lower()
    if key in PRESETS:
        return dict(PRESETS[key]), key, f"preset {key}"
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", model.strip()) is not None
    download = (f"; models are read from local files only: download it first (e.g. `hf download "
                f"{model.strip()} --local-dir DIR`) and pass DIR" if hub_id else "")
    raise ConfigError(
        f"model {model!r} is neither a path that exists nor a preset{download}; presets: {', '.join(sorted(PRESETS))}"
    )


def load_model_spec(model: str | None) -> ModelSpec:
    cfg, name, source = load_hf_config(model)
    return spec_from_hf_config(cfg, name=name, source=source)


def load_draft_model_spec(model: str) -> ModelSpec:
    """:func:`load_model_spec` of a speculative draft model; a ConfigError says it is the draft's."""
    try:
        return load_model_spec(model)
    except ConfigError as exc:
        raise ConfigError(f"the draft model (--speculative-config's \"model\", {model!r}): {exc}") from exc
