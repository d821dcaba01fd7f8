"""Which form runs a per-head-gate delta-rule prefill on CUDA, and what the chunked form allocates.

The kernel module (kvforge/kernels/triton_gated_delta_rule.py) launches the form named here, and the
planner's activation reserve (kvforge/planner/activations.py) counts the chunked form's float32 buffers
when it serves. Per-channel gates (KDA) always run token by token.
"""

from __future__ import annotations

#: The chunk of a per-head-gate prefill where a call names none; None: token by token. On an H100 the
#: token-by-token kernel ran one sequence of Qwen3-Next's layer 3.7-8x faster than the sequential chunked kernel
#: the module had before, at its fastest chunk (16), from 3 to 4096 tokens, and 64 sequences of 3 tokens
#: (verification rows) 27x (docs/BENCHMARKS.md, "Gated delta rule prefill"); the chunk-parallel form now there
#: is not timed yet (chunks of 64 need a Hopper's shared memory, chunks of 32 about 115 KB a program).
PREFILL_CHUNK_SIZE: int | None = None


def chunked_buffer_bytes(tokens: int, value_heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """The chunked form's float32 buffers for ``tokens`` tokens of ``value_heads`` heads: per token and head its
    ``W`` row (``key_dim``), ``U`` row (``value_dim``) and decayed ``q k^T`` row (``chunk``)."""
    return tokens * value_heads * (key_dim + value_dim + chunk) * 4
