"""Which form runs a delta-rule prefill on CUDA, and what the chunked form allocates.

The kernel module (kvforge/kernels/triton_gated_delta_rule.py) launches the form named here, and the
planner's activation reserve (kvforge/planner/activations.py) counts the chunked form's float32 buffers
when it serves. Per-head gates (Gated DeltaNet) and per-channel gates (KDA) take the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: The chunk of the chunked form where the route takes it; None: every call runs token by token.
PREFILL_CHUNK_SIZE: int | None = 16
#: The chunked form takes a call holding one to ``CHUNKED_MAX_SEQUENCES`` long sequences, of at least
#: ``CHUNKED_MIN_TOKENS`` tokens each, beside shorter ones (decode and verification rows) while the long
#: sequences hold at least ``CHUNKED_TOKENS_PER_SHORT`` tokens for each short one; the short ones then run token
#: by token in a launch of their own where the caller gives each sequence's length (``chunked_from``), else the
#: call's mean stands for each sequence's and every sequence runs chunked. The token-by-token kernel walks each
#: sequence's tokens one by one, short rows beside a long walk for free; the chunked form walks chunks with
#: matrix products, a short sequence in it costing a chunk's passes over its state. On an H100, chunks of 16
#: against token by token (docs/BENCHMARKS.md, "Gated delta rule prefill"): Qwen3-Next's layer (per-head
#: gates), one sequence of 32 tokens 1.5x faster, of 4096 5.3x, two of 256-4096 3.0-3.7x, three to sixteen of
#: 256-1024 1.8-2.0x,
#: verification rows of 3 tokens 0.4x; with the short rows token by token, a prompt of 2048 beside 32 decode
#: rows 4.0x, of 256 beside 64 2.1x, of 64 beside 64 1.1x. Kimi-Linear's KDA layer (per-channel gates): one
#: sequence of 32-4096 tokens 1.1-2.8x, two 2.0-2.2x, three to sixteen 1.1-1.2x; 2048 beside 32 decode rows
#: 2.8x, 256 beside 64 1.6x, 64 beside 64 0.94x. More than 16 long sequences were not measured. End to end,
#: Qwen3-Next's prompts of 8000 tokens one at a time 2.1x, of 1024 eight a step 1.16x; Kimi-Linear's of 8000
#: 1.46x.
CHUNKED_MAX_SEQUENCES = 16
CHUNKED_MIN_TOKENS = 32
CHUNKED_TOKENS_PER_SHORT = 2
#: Whether the short sequences of a call the chunked form takes run token by token in a launch of their own.
#: Off (kept for A/B runs), they run chunked too under the same bound of ``CHUNKED_TOKENS_PER_SHORT``, where
#: chunking them is slower than token by token (docs/BENCHMARKS.md).
SHORT_TOKEN_BY_TOKEN = True
#: Whether per-channel gates (KDA) take the chunked form by the same rule (else token by token).
PER_CHANNEL_CHUNKED = True

#: The chunked form's matrix products by the dtype of the call's inputs (``q``, ``k``, ``v``, named as
#: ``torch`` names it; kvforge/kernels/triton_gated_delta_rule.py ``_product``): "tf32x3" (three tf32 products a
#: product, float32's accuracy on the matrix units) for every dtype. The other form the kernels run,
#: "tf32-nearest" (one tf32 product of operands rounded to nearest), emulated over 1k-32k tokens
#: (docs/BENCHMARKS.md, "Gated delta rule prefill"), moves a bf16 model's states by 3.5-4.9e-4 (relative L2), a
#: sixth of what the bf16 rounding of its own inputs moves them (2.4-2.9e-3), an error that does not grow with
#: the sequence; on an H100 the states were 3.6e-4 off and the bf16 outputs 1.2-1.4e-3 (their storage rounding
#: 1.7e-3), and it ran Qwen3-Next's layer 1.26-1.36x faster than tf32x3 and Kimi-Linear's 0.96-1.08x (cut tf32:
#: 1.1-1.9x, three times the error). tf32x3 stays the default, where the chunked form keeps 1e-4 of the rule in
#: float64 for every dtype. (fp16 inputs hold tf32's 11 significant bits, so that yardstick does not carry over
#: to them.)
PRODUCT_PRECISION = {"float32": "tf32x3", "bfloat16": "tf32x3"}
#: The products of inputs of a dtype :data:`PRODUCT_PRECISION` does not name.
DEFAULT_PRODUCT_PRECISION = "tf32x3"


def product_precision(input_dtype: str) -> str:
    """The precision of the chunked form's products for inputs of ``input_dtype`` (``"bfloat16"``, ...)."""
    return PRODUCT_PRECISION.get(input_dtype, DEFAULT_PRODUCT_PRECISION)


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
        return chunk if tokens >= CHUNKED_MIN_TOKENS * num_seqs and num_seqs <= CHUNKED_MAX_SEQUENCES else None
    long = [n for n in lengths if n >= CHUNKED_MIN_TOKENS]
    short = sum(1 for n in lengths if 0 < n < CHUNKED_MIN_TOKENS)  # padding rows (no tokens) cost nothing
    if not 0 < len(long) <= CHUNKED_MAX_SEQUENCES or sum(long) < CHUNKED_TOKENS_PER_SHORT * short:
        return None
    return chunk


def chunked_from(lengths: Sequence[int] | None) -> int:
    """Where the chunked form runs a call, the tokens below which a sequence runs token by token in a launch
    of its own instead (0: every sequence chunked). Each short sequence costs the chunked form a chunk's passes
    over its state; token by token, short rows share one launch of small programs."""
    if not SHORT_TOKEN_BY_TOKEN or lengths is None or all(n == 0 or n >= CHUNKED_MIN_TOKENS for n in lengths):
        return 0
    return CHUNKED_MIN_TOKENS


def chunked_sequences(num_seqs: int, lengths: Sequence[int] | None, chunked_from_tokens: int) -> int:
    """The sequences the chunked launches run in a call (the others' programs return at once): those of at
    least ``chunked_from_tokens`` tokens (and at least one), every sequence where the lengths are not known."""
    if lengths is None:
        return num_seqs
    return sum(n >= max(chunked_from_tokens, 1) for n in lengths)


@dataclasses.dataclass(frozen=True)
class PrefillForm:
    """How a prefill call runs: ``chunk_size`` (None: token by token), ``chunked_from`` (the tokens below which
    a sequence runs token by token beside the chunked form; 0: none) and ``chunked_seqs`` (the sequences the
    chunked launches run, which pick their tile; None: counted from the call's lengths)."""

    chunk_size: int | None
    chunked_from: int = 0
    chunked_seqs: int | None = None


def prefill_form(num_seqs: int, tokens: int, per_channel: bool = False,
                 lengths: Sequence[int] | None = None) -> PrefillForm:
    """The route's whole answer for a prefill call (:func:`prefill_chunk`, :func:`chunked_from` and
    :func:`chunked_sequences`); host work over the call's lengths, which a caller running many layers over
    the same step asks once."""
    chunk = prefill_chunk(num_seqs, tokens, per_channel, lengths)
    if chunk is None:
        return PrefillForm(None)
    split = chunked_from(lengths)
    return PrefillForm(chunk, split, chunked_sequences(num_seqs, lengths, split))


def chunked_buffer_bytes(tokens: int, value_heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """The chunked form's float32 buffers for ``tokens`` tokens of ``value_heads`` heads: per token and head its
    ``W`` row (``key_dim``), ``U`` row (``value_dim``) and decayed ``q k^T`` row (``chunk``)."""
    return tokens * value_heads * (key_dim + value_dim + chunk) * 4
