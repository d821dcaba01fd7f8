"""The Triton MLA backend's implementation (CUDA): latent cache write + attention.

Decode-only steps run the absorbed form in latent space with the Triton
kernel (:mod:`kvforge.kernels.triton_mla_decode`). In a step with a prefill chunk
each sequence takes its own path (:func:`kvforge.attention.routing.mla.sequence_paths`,
under the engine argument ``mla_prefill_mode``): absorbed sequences (decoding ones,
short prefills) run every query token through the decode kernels
(:func:`per_token_metadata`); long prefills expand their cached latents to per-head
K/V in the model dtype for torch's fused attention
(:mod:`kvforge.attention.mla_prefill_sdpa`) or, forced for the whole step, in float32
with the PyTorch reference (:func:`kvforge.attention.mla_reference.mla_prefill`);
prefill steps run eagerly. The cache
write is a Triton kernel (no host sync, so decode steps can be CUDA graphs).
``query_dtype`` is the plan's per-layer decision: None / the model dtype, or
"fp8_e4m3" (declared at 1-16 heads per rank on e4m3 caches with 576-wide rows,
triton_mla_backend.py; the kernels round the query only where that pays, see
``triton_mla_decode``); it applies to decode steps (prefill chunks always use
the model-dtype query).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla_prefill_sdpa import mla_prefill_sdpa
from kvforge.attention.mla_reference import mla_prefill
from kvforge.attention.routing import mla as mla_routing
from kvforge.attention.routing.mla import ABSORBED_PREFILL_MAX_SEQ_LEN, PREFILL_MODES
from kvforge.kernels.triton_mla_cache_write import write_mla_cache
from kvforge.kernels.triton_mla_decode import mla_decode

__all__ = ["ABSORBED_PREFILL_MAX_SEQ_LEN", "PREFILL_MODES", "mla_attention", "mla_decode", "per_token_metadata",
           "sequence_paths", "write_mla_cache"]


def sequence_paths(meta: AttentionMetadata, mode: str) -> list[str]:
    """Each sequence's path in a step with a prefill chunk under the engine's MLA prefill ``mode``:
    "absorbed", "sdpa" or "expanded" (:func:`kvforge.attention.routing.mla.sequence_paths`, on the
    metadata's host lists)."""
    qsl, seq_lens = meta.host_lists()
    return mla_routing.sequence_paths(mode, [b - a for a, b in zip(qsl, qsl[1:])], seq_lens)


def per_token_metadata(meta: AttentionMetadata, num_tokens: int,
                       sequences: tuple[int, ...] | None = None) -> tuple[AttentionMetadata, np.ndarray]:
    """The step as decode queries, and the step's token index of each: query token ``j`` of sequence ``i``
    becomes a one-token sequence with sequence ``i``'s block-table row and length ``seq_lens[i] - query_len_i
    + j + 1`` (its causal prefix). ``sequences`` (None: all) picks whose tokens, in token order; tokens past
    ``query_start_loc[num_seqs]`` belong to no sequence. Built from the metadata's host lists (no device
    read-back when the runner provided them)."""
    qsl, seq_lens = meta.host_lists()
    total = qsl[-1] if seq_lens else 0
    if total > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {total} > num_tokens = {num_tokens}")
    qlens = np.diff(np.asarray(qsl, dtype=np.int64))
    owner = np.repeat(np.arange(len(seq_lens), dtype=np.int64), qlens)
    tokens = np.arange(total, dtype=np.int64)
    if sequences is not None:
        keep = np.isin(owner, np.asarray(sequences, dtype=np.int64))
        owner, tokens = owner[keep], tokens[keep]
    within = tokens - np.asarray(qsl[:-1], dtype=np.int64)[owner]
    lens = np.asarray(seq_lens, dtype=np.int64)[owner] - qlens[owner] + within + 1
    device = meta.seq_lens.device
    n = len(tokens)
    # non_blocking: a pageable host->device copy is staged at once and does not wait for the queued kernels
    # (a blocking copy would synchronize the stream, once per layer)
    owner_t = torch.from_numpy(owner).to(device, non_blocking=True)
    slots = (meta.slot_mapping[:total] if sequences is None
             else meta.slot_mapping.index_select(0, torch.from_numpy(tokens).to(device, non_blocking=True)))
    per = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=meta.block_tables.index_select(0, owner_t),
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
        host_query_start_loc=tuple(range(n + 1)),
        host_seq_lens=tuple(int(x) for x in lens),
    )
    return per, tokens


@dataclass(frozen=True)
class _PrefillStep:
    """How one step with a prefill chunk attends: ``expand`` (None, "sdpa" or "expanded") for the sequences
    in ``expanded``; the rest through the decode kernels as ``per_token`` queries at the step's token indices
    ``tokens`` (None: the step's every token, in order; ``per_token`` None: no absorbed sequence)."""

    expand: str | None
    expanded: tuple[int, ...]
    per_token: AttentionMetadata | None
    tokens: torch.Tensor | None


#: The last step's plan (why global: one step's metadata object serves every MLA layer of the step, 27 for
#: DeepSeek-V2-Lite, and the per-token form costs host work and two copies; built once per step). One entry,
#: keyed by the identity of the step's metadata, which it holds so the id stays unique.
_LAST_STEP: tuple[AttentionMetadata, int, str, _PrefillStep] | None = None


def _prefill_step(meta: AttentionMetadata, num_tokens: int, mode: str) -> _PrefillStep:
    global _LAST_STEP
    last = _LAST_STEP
    if last is not None and last[0] is meta and last[1] == num_tokens and last[2] == mode:
        return last[3]
    paths = sequence_paths(meta, mode)
    expanded = tuple(i for i, p in enumerate(paths) if p != "absorbed")
    absorbed = tuple(i for i, p in enumerate(paths) if p == "absorbed")
    per = tokens = None
    if absorbed:
        per, index = per_token_metadata(meta, num_tokens, None if not expanded else absorbed)
        if len(index) == 0:  # the absorbed sequences have no token this step
            per = None
        elif expanded:
            tokens = torch.from_numpy(index).to(meta.seq_lens.device, non_blocking=True)
    step = _PrefillStep(paths[expanded[0]] if expanded else None, expanded, per, tokens)
    _LAST_STEP = (meta, num_tokens, mode, step)
    return step


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                  query_dtype: str | None = None, num_splits: int | None = None,
                  prefill_mode: str = "auto") -> torch.Tensor:
    """One MLA layer's attention for a step: ``[T, H, V]`` in ``q_nope.dtype`` (same contract as the reference).

    ``w_uk [H, Dn, R]`` is absorbed into the query (``q_latent = w_uk^T q_nope``)
    and ``w_uv [H, V, R]`` projects the latent output, both as batched matmuls in
    the model dtype. ``prefill_mode``: one of ``PREFILL_MODES`` (the engine's ``mla_prefill_mode``).
    """
    if meta.max_query_len <= 1:
        return _absorbed(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv, query_dtype, num_splits)
    step = _prefill_step(meta, q_nope.shape[0], prefill_mode)
    if step.expand == "expanded":  # the float32 reference takes the whole step
        return mla_prefill(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv)
    if step.expand is None:  # every query token as a decode query over its causal prefix; padding rows zero
        n = step.per_token.num_seqs if step.per_token is not None else 0
        if 0 < n == q_nope.shape[0]:  # no padding rows: the decode output is the step's
            return _absorbed(q_nope, q_rope, cache, step.per_token, scale, softmax_scale, w_uk, w_uv)
        out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
        if n:
            out[:n] = _absorbed(q_nope[:n], q_rope[:n], cache, step.per_token, scale, softmax_scale, w_uk, w_uv)
        return out
    out = mla_prefill_sdpa(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv, sequences=step.expanded)
    if step.per_token is not None:
        rows = _absorbed(q_nope.index_select(0, step.tokens), q_rope.index_select(0, step.tokens), cache,
                         step.per_token, scale, softmax_scale, w_uk, w_uv)
        out.index_copy_(0, step.tokens, rows)
    return out


def _absorbed(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv, query_dtype=None, num_splits=None):
    """Decode queries (one per row of ``meta``) in latent space: ``[rows, H, V]``, contiguous. The plan's query
    dtype and split count apply to decode steps; prefill tokens keep the model-dtype query (both None).

    Both per-head products write the token-major layout directly (``out=`` a head-major view of a
    ``[rows, H, ·]`` tensor; cuBLAS takes the row stride ``H x width``), so neither the decode kernel's query
    nor the output projection's input is copied into shape."""
    rows, heads, dtype = q_nope.shape[0], q_nope.shape[1], q_nope.dtype
    q_latent = torch.empty(rows, heads, w_uk.shape[2], dtype=dtype, device=q_nope.device)
    torch.bmm(q_nope.transpose(0, 1), w_uk.to(dtype), out=q_latent.transpose(0, 1))
    o_latent = mla_decode(q_latent, q_rope, cache, meta, scale, softmax_scale,
                          query_dtype=query_dtype, num_splits=num_splits)
    out = torch.empty(rows, heads, w_uv.shape[1], dtype=dtype, device=q_nope.device)
    torch.bmm(o_latent.transpose(0, 1), w_uv.to(dtype).transpose(1, 2), out=out.transpose(0, 1))
    return out
