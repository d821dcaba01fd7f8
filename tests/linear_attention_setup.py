"""Shared set-up of the linear-attention model tests (Qwen3-Next, Kimi-Linear tiny checkpoints on CPU)."""

from __future__ import annotations

import pytest
import torch

#: Engine arguments of every tiny linear-attention engine: float32, small blocks, chunked prompts.
ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 21, progress=False, device="cpu", max_num_batched_tokens=16, max_model_len=128)
CASES = ["qwen3-next", "kimi-linear"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread while a test runs (restored after it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
