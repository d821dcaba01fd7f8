"""The Triton MLA backend's implementation (CUDA): latent cache write + attention.

Decode-only steps run the absorbed form in latent space with the Triton
kernel (:mod:`kvforge.kernels.triton_mla_decode`); steps with a prefill chunk
run every query token through the decode kernels (:func:`per_token_metadata`)
when the step's prefilling sequences are short, else expand the cached latents to
per-head K/V in the model dtype for torch's fused attention
(:mod:`kvforge.attention.mla_prefill_sdpa`) or, forced, in float32 with the
PyTorch reference (:func:`kvforge.attention.mla_reference.mla_prefill`); prefill
steps run eagerly. The engine argument ``mla_prefill_mode`` chooses
(:data:`kvforge.attention.routing.mla.PREFILL_MODES`). The cache
write is a Triton kernel (no host sync, so decode steps can be CUDA graphs).
``query_dtype`` is the plan's per-layer decision: None / the model dtype, or
"fp8_e4m3" (declared at 1-16 heads per rank on e4m3 caches with 576-wide rows,
triton_mla_backend.py; the kernels round the query only where that pays, see
``triton_mla_decode``); it applies to decode steps (prefill chunks always use
the model-dtype query).
"""

from __future__ import annotations

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
           "prefill_path", "write_mla_cache"]


def prefill_path(meta: AttentionMetadata, mode: str) -> str:
    """How a step with a prefill chunk attends under the engine's MLA prefill ``mode``: "absorbed", "sdpa" or
    "expanded" (:func:`kvforge.attention.routing.mla.prefill_path`, on the metadata's host lists)."""
    if mode != "auto":
        return mode
    qsl, seq_lens = meta.host_lists()
    return mla_routing.prefill_path(mode, [b - a for a, b in zip(qsl, qsl[1:])], seq_lens)


def per_token_metadata(meta: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """The step as decode queries: query token ``j`` of sequence ``i`` becomes a one-token sequence with
    sequence ``i``'s block-table row and length ``seq_lens[i] - query_len_i + j + 1`` (its causal
    prefix). Token order is unchanged; tokens past ``query_start_loc[num_seqs]`` belong to no sequence.
    Built from the metadata's host lists (no device read-back when the runner provided them)."""
    qsl, seq_lens = meta.host_lists()
    total = qsl[-1] if seq_lens else 0
    if total > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {total} > num_tokens = {num_tokens}")
    qlens = np.diff(np.asarray(qsl, dtype=np.int64))
    owner = np.repeat(np.arange(len(seq_lens), dtype=np.int64), qlens)
    within = np.arange(total, dtype=np.int64) - np.asarray(qsl[:-1], dtype=np.int64)[owner]
    lens = np.asarray(seq_lens, dtype=np.int64)[owner] - qlens[owner] + within + 1
    device = meta.seq_lens.device
    # non_blocking: a pageable host->device copy is staged at once and does not wait for the queued kernels
    # (a blocking copy would synchronize the stream, once per layer)
    owner_t = torch.from_numpy(owner).to(device, non_blocking=True)
    return AttentionMetadata(
        query_start_loc=torch.arange(total + 1, dtype=torch.int32, device=device),
        seq_lens=torch.from_numpy(lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=meta.block_tables.index_select(0, owner_t),
        slot_mapping=meta.slot_mapping[:total],
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        block_size=meta.block_size,
        host_query_start_loc=tuple(range(total + 1)),
        host_seq_lens=tuple(int(x) for x in lens),
    )


#: The last step's per-token metadata (why global: one step's metadata object serves every MLA layer of
#: the step, 27 for DeepSeek-V2-Lite, and the per-token form costs host work and two copies; built once per
#: step). One entry, keyed by the identity of the step's metadata, which it holds so the id stays unique.
_LAST_PER_TOKEN: tuple[AttentionMetadata, int, AttentionMetadata] | None = None


def _per_token_for_step(meta: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    global _LAST_PER_TOKEN
    last = _LAST_PER_TOKEN
    if last is not None and last[0] is meta and last[1] == num_tokens:
        return last[2]
    per = per_token_metadata(meta, num_tokens)
    _LAST_PER_TOKEN = (meta, num_tokens, per)
    return per


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                  query_dtype: str | None = None, num_splits: int | None = None,
                  prefill_mode: str = "auto") -> torch.Tensor:
    """One MLA layer's attention for a step: ``[T, H, V]`` in ``q_nope.dtype`` (same contract as the reference).

    ``w_uk [H, Dn, R]`` is absorbed into the query (``q_latent = w_uk^T q_nope``)
    and ``w_uv [H, V, R]`` projects the latent output, both as batched matmuls in
    the model dtype. ``prefill_mode``: one of ``PREFILL_MODES`` (the engine's ``mla_prefill_mode``).
    """
    decode = meta.max_query_len <= 1
    path = "decode" if decode else prefill_path(meta, prefill_mode)
    if path in ("sdpa", "expanded"):
        expand = mla_prefill_sdpa if path == "sdpa" else mla_prefill
        return expand(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv)
    if not decode:  # absorbed: every query token as a decode query over its causal prefix
        meta = _per_token_for_step(meta, q_nope.shape[0])
        query_dtype = num_splits = None  # prefill keeps the model-dtype query (the plan's dtype is for decode)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [T, H, R]
    o_latent = torch.zeros_like(q_latent) if not decode else None  # padding tokens: zero rows
    o_latent = mla_decode(q_latent.contiguous(), q_rope, cache, meta, scale, softmax_scale,
                          query_dtype=query_dtype, num_splits=num_splits, out=o_latent)
    return torch.bmm(o_latent.transpose(0, 1), w_uv.to(q_nope.dtype).transpose(1, 2)).transpose(0, 1)
