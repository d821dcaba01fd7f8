"""Which form runs a delta-rule prefill on CUDA, and what the chunked form allocates.

The kernel module (kvforge/kernels/triton_gated_delta_rule.py) launches the form named here, and the
planner's activation reserve (kvforge/planner/activations.py) counts the chunked form's float32 buffers
when it serves. Per-channel gates (KDA) run token by token unless ``PER_CHANNEL_CHUNKED``.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The chunk of the chunked form where the route takes it; None: every call runs token by token.
PREFILL_CHUNK_SIZE: int | None = 16
#: The chunked form takes a call holding one to ``CHUNKED_MAX_SEQUENCES`` long sequences, of at least
#: ``CHUNKED_MIN_TOKENS`` tokens each, beside any number of shorter ones (decode and verification rows ride
#: along: a short sequence is one chunk); where the caller gives no lengths, the call's mean stands for each
#: sequence's. The token-by-token kernel runs a program per (sequence, value head, 32 value
#: channels) and walks its tokens one by one: one prompt of Qwen3-Next's layer fills 128 programs. The chunked
#: form walks chunks with matrix products. On an H100, Qwen3-Next's layer, chunks of 16 against token by token:
#: one sequence of 32 tokens 1.5x faster, of 64 2.3x, of 4096 3.6x, of 16 0.9x; two sequences of 256-4096
#: 1.7-1.9x; four 1.0x (0.97-1.05), eight to sixteen 1.0-1.1x; verification rows of 3 tokens 0.3-0.4x. End to
#: end, prompts of 8000 tokens one at a time, 2.0x (docs/BENCHMARKS.md, "Gated delta rule prefill").
CHUNKED_MAX_SEQUENCES = 2
CHUNKED_MIN_TOKENS = 32
#: Whether per-channel gates (KDA) take the chunked form by the same rule. Its per-channel kernels are tested
#: but not timed, so they run token by token.
PER_CHANNEL_CHUNKED = False


def largest_chunk(per_channel: bool) -> int | None:
    """The chunk of the chunked form where a prefill of these gates may take it (None: never), the chunk
    whose buffers the activation reserve counts."""
    if per_channel and not PER_CHANNEL_CHUNKED:
        return None
    return PREFILL_CHUNK_SIZE


def prefill_chunk(num_seqs: int, tokens: int, per_channel: bool = False,
                  lengths: Sequence[int] | None = None) -> int | None:
    """The chunk a prefill of ``num_seqs`` sequences and ``tokens`` tokens runs in, or None for token by token;
    ``per_channel``: its gates are per key channel (KDA); ``lengths``: each sequence's tokens where the caller
    knows them on the host (shapes and host values only: no device sync)."""
    chunk = largest_chunk(per_channel)
    if chunk is None or num_seqs == 0:
        return None
    if lengths is None:
        long = num_seqs if tokens >= CHUNKED_MIN_TOKENS * num_seqs else 0
    else:
        long = sum(1 for n in lengths if n >= CHUNKED_MIN_TOKENS)
    return chunk if 0 < long <= CHUNKED_MAX_SEQUENCES else None


def chunked_buffer_bytes(tokens: int, value_heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """The chunked form's float32 buffers for ``tokens`` tokens of ``value_heads`` heads: per token and head its
    ``W`` row (``key_dim``), ``U`` row (``value_dim``) and decayed ``q k^T`` row (``chunk``)."""
    return tokens * value_heads * (key_dim + value_dim + chunk) * 4
