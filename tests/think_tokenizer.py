"""The embedded SmolLM2 tokenizer with unused special tokens renamed: two of them ``<think>`` (id 3) and ``</think>``
(id 4), plain text tokens as in Qwen3's and DeepSeek-R1's tokenizers: a reasoning model's tags for tests,
on the embedded model's weights."""

from __future__ import annotations

import json
from pathlib import Path

THINK_IDS = {3: "<think>", 4: "</think>"}
START_ID, END_ID = 3, 4


def write_think_tokenizer(directory: Path) -> Path:
    """Write the tokenizer (tokenizer.json, tokenizer_config.json) into ``directory``; return it."""
    return rename_tokens(directory, THINK_IDS, special=False)


def rename_tokens(directory: Path, names: dict[int, str], special: bool) -> Path:
    """The embedded tokenizer with the added tokens ``names`` (id -> new text) renamed, ``special`` or not,
    written into ``directory``."""
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import Tokenizer

    base = Tokenizer.from_gguf(embedded_model_path())
    spec = json.loads(base.backend.to_str())
    vocab = spec["model"]["vocab"]
    for token in spec["added_tokens"]:
        if token["id"] in names:
            vocab[names[token["id"]]] = vocab.pop(token["content"])
            token["content"], token["special"] = names[token["id"]], special
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = {"bos_token": base.bos_token, "eos_token": base.eos_token, "chat_template": base.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
