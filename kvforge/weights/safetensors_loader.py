"""Stream tensors out of an HF checkpoint directory of ``*.safetensors`` files.

Sharded checkpoints are found through ``model.safetensors.index.json``; a single
``model.safetensors`` (or any ``*.safetensors``) works too. Pickle checkpoints
(``*.bin``, ``*.pt``) are refused: loading them would execute arbitrary code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from kvforge.errors import ConfigError

INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    if not d.is_dir():
        raise ConfigError(f"{d} is not a directory with a safetensors checkpoint")
    index = d / INDEX_NAME
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({d / v for v in weight_map.values()})
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise ConfigError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        if files:
            return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (
            f" It has pickle weights ({', '.join(pickles[:3])}), which kvforge never loads;"
            " convert them with save_pretrained(safe_serialization=True)."
            if pickles
            else ""
        )
        raise ConfigError(f"no *.safetensors files in {d}.{hint}")
    return files


def iterate_safetensors(
    model_dir: str | Path, device: str | torch.device = "cpu", progress: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in the checkpoint, shard by shard."""
    files = safetensors_files(model_dir)
    dev = str(torch.device(device))
    disable = None if progress is None else not progress
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=disable):
        with safe_open(str(path), framework="pt", device=dev) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
