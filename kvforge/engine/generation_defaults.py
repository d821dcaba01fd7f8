"""Default sampling parameters from the checkpoint's ``generation_config.json`` (vLLM's ``--generation-config``).

``auto`` (the default, as vLLM's) reads ``generation_config.json`` beside the model's ``config.json``; a
directory reads that directory's (its ``eos_token_id`` then also ends requests, as the model's own file's
does through the tokenizer); ``vllm`` reads none. Of the file, the fields vLLM takes are used:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as
``max_tokens``). They are the defaults of a request that does not set the field: ``LLM.generate`` without
``sampling_params`` (``LLM.get_default_sampling_params()``), and the server's completion and chat requests
(a completion's ``max_tokens`` stays OpenAI's 16; a chat's, when not sent, is ``max_new_tokens`` within the
context). A file that sets a value ``SamplingParams`` refuses is a ConfigError at startup, before weights.

A GGUF file carries its defaults in its header instead (llama.cpp's ``general.sampling.*`` keys): under
``auto`` a GGUF model (by name or by its first bytes) takes ``general.sampling.temp``, ``top_p``, ``top_k``, ``min_p`` and
``penalty_repeat`` the same way (a ``generation_config.json`` beside it, where there is one, wins).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.errors import ConfigError, InvalidRequestError

#: ``generation_config.json`` field -> SamplingParams field, the fields vLLM takes.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SETTINGS = ("auto", "vllm")
#: GGUF header key (llama.cpp's) -> SamplingParams field.
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
               "general.sampling.penalty_repeat": "repetition_penalty"}


def check_setting(setting: str) -> None:
    """``--generation-config``: auto, vllm or a directory; ConfigError naming the value otherwise."""
    if setting in SETTINGS:
        return
    if not Path(setting).is_dir():
        raise ConfigError(f"--generation-config {setting!r}: give auto (the model's generation_config.json), vllm "
                          f"(none) or a directory holding a generation_config.json")


def _config_file(setting: str, model_path: str | None) -> Path | None:
    if setting == "vllm":
        return None
    if setting != "auto":
        return Path(setting) / "generation_config.json"
    if model_path is None:  # the embedded model or a preset: no checkpoint directory
        return None
    path = Path(model_path)
    folder = path if path.is_dir() else path.parent if path.name == "config.json" else None
    return folder / "generation_config.json" if folder is not None else None


def sampling_defaults(setting: str, model_path: str | None) -> dict:
    """The SamplingParams fields ``generation_config.json`` sets (see the module docstring); {} for none."""
    from kvforge.engine.sampling_params import SamplingParams

    check_setting(setting)
    file = _config_file(setting, model_path)
    if file is None or not file.is_file():
        if setting not in SETTINGS:
            raise ConfigError(f"--generation-config {setting}: {file} does not exist")
        if setting == "auto" and model_path is not None:
            from kvforge.weights.gguf_config import is_gguf_file

            if is_gguf_file(model_path):
                return _gguf_defaults(model_path)
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not readable JSON ({e}); fix the file or pass --generation-config vllm") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object; fix the file or pass --generation-config vllm")
    defaults = {ours: data[theirs] for theirs, ours in FIELDS.items() if data.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ConfigError(f"{file}: {e}; fix the file or pass --generation-config vllm") from None
    return defaults


def _gguf_defaults(path: str) -> dict:
    """The SamplingParams fields a GGUF header sets (``GGUF_FIELDS``); {} for none."""
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.weights.gguf_config import GGUFHeader

    metadata = GGUFHeader(str(path)).metadata
    defaults = {ours: metadata[key] for key, ours in GGUF_FIELDS.items() if metadata.get(key) is not None}
    if "top_k" in defaults:
        defaults["top_k"] = int(defaults["top_k"])
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if name in defaults:
            defaults[name] = float(defaults[name])
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ConfigError(f"{path}: its general.sampling keys: {e}; pass --generation-config vllm") from None
    return defaults


def eos_token_ids(setting: str) -> list[int]:
    """The end-of-sequence ids a ``--generation-config`` directory's file names (``eos_token_id``: one id or a
    list); none for ``auto`` (the tokenizer reads the model's own file) and ``vllm``."""
    if setting in SETTINGS:
        return []
    file = Path(setting) / "generation_config.json"
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = value if isinstance(value, list) else [value]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
