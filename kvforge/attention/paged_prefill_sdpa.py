"""Paged attention of a step whose long prefill chunks run through torch's fused attention.

:func:`routed_paged_attention` is what the Triton paged backend calls. The routing table
(:func:`kvforge.attention.routing.paged.sdpa_prefill_sequences`) names the sequences of the step that leave
the kernels; each of them runs here, one ``scaled_dot_product_attention`` per sequence (and KV-head group),
and the others run through :func:`kvforge.kernels.triton_paged_attention.paged_attention` as a batch of
their own: their query rows gathered, metadata rebuilt for them (``query_start_loc``, ``seq_lens``,
``block_tables``, ``slot_mapping`` and the host copies), outputs scattered back. The cache holds the step's
new rows before attention runs (the model runner writes them first), so a sequence's positions
``0 .. seq_len - 1`` are all in its blocks.

One sequence with query rows ``[a, b)`` and ``L = seq_len`` tokens: its K and V rows of positions
``0 .. L - 1`` are gathered from its blocks into ``[L, heads, D]`` (on CUDA one Triton kernel that also
dequantizes: fp8 rows times the per-KV-head ``k_scale`` / ``v_scale`` in float32, rounded once to the model
dtype), and its ``b - a`` queries attend causally, aligned to the end: query ``j`` sees keys ``0 .. L -
(b - a) + j``. With ``b - a == L`` (no cached prefix) that is ``is_causal=True``; with a prefix, the
lower-right mask ``torch.nn.attention.bias.causal_lower_right``.

What torch runs (torch 2.11 and 2.13 on CUDA, sm80 and later, bf16/fp16, head size <= 256, which the rule
guarantees): ``is_causal=True`` goes through the SDPA dispatcher, which takes the first usable backend of
``kvforge.attention.end_aligned_sdpa.SDPA_BACKENDS``: flash attention (FlashAttention-2), which reads the KV
heads as they are (``enable_gqa=True``). cuDNN's fused attention (faster on sm90, but it finalizes a plan for
every new shape) is first only with ``KVFORGE_SDPA_PREFILL_CUDNN`` set. ``benchmarks/bench_decode_attention.py --prefill-only`` prints the kernels
that ran. The lower-right mask dispatches in torch's ``CausalBias``: flash with its
own end-aligned causal mask when flash can run (GQA included), else the memory-efficient kernel with a
lower-right mask type, else the math path over a materialized mask. On CPU both run the math path or
torch's CPU flash kernel. Where flash cannot take the call (CPU; flash disabled), K and V are expanded to
the query heads and the query rows go in chunks, so that a fallback that materializes the scores holds at
most ``SDPA_SCORE_ELEMENTS`` of them; a fused kernel never does, and gets all rows in one call.

Memory: KV heads go in groups so that one call's gathered rows (with the float32 dequantization copy of
fp8 caches and the expansion to query heads where flash does not run) hold at most ``SDPA_KV_BYTES``; the
plan's activation reserve counts one call's rows and the compacted rest of the batch
(kvforge/planner/activations.py). Host work: the sequence lists come from the metadata's host copies
(the routing never reads a device tensor back); the rest's index arrays go to the device in one
non-blocking copy from pinned memory.

Invariant: each SDPA sequence's output equals float64 attention over the dequantized cache within the
model dtype's rounding of the dequantized K and V (caches of another dtype), of P and of the output (2^-9
relative each in bf16); the other sequences get exactly the kernels' output for their own batch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvforge.attention.end_aligned_sdpa import end_aligned_sdpa
from kvforge.attention.fp8 import FP8_DTYPES, storage_dtype_name
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import paged as paged_routing
from kvforge.env import ENV
from kvforge.kernels.optional_triton import HAS_TRITON
from kvforge.kernels.triton_gather_kv import gather_paged_kv
from kvforge.kernels.triton_paged_attention import paged_attention

__all__ = ["SDPA_KV_BYTES", "SDPA_SCORE_ELEMENTS", "routed_paged_attention"]

#: Bytes one call's gathered K and V may hold (:data:`kvforge.attention.routing.paged.SDPA_PREFILL_KV_BYTES`).
SDPA_KV_BYTES: int = paged_routing.SDPA_PREFILL_KV_BYTES
#: Scores per query-row chunk at most (heads x rows x keys) where flash does not take the call: 1 GiB of
#: float32 should torch fall back to its math path.
SDPA_SCORE_ELEMENTS: int = 1 << 28


def routed_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, softmax_scale: float,
                           sliding_window: int | None = None, *, num_splits: int | None = None,
                           kernel: str | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention of ``q [T, Hq, D]`` over ``kv_cache`` with
    :func:`~kvforge.kernels.triton_paged_attention.paged_attention`'s contract (output in ``q.dtype``; rows
    past ``query_start_loc[-1]`` unwritten), its long prefill chunks through torch's fused attention (module
    docstring). ``num_splits`` (a pinned count), ``kernel`` (a named kernel), ``sinks``: as there; any of the
    first two keeps every sequence on the kernels."""
    seqs = _sdpa_sequences(q, kv_cache, meta, sliding_window, num_splits, kernel, sinks)
    if not seqs:
        return paged_attention(q, kv_cache, meta, k_scale, v_scale, softmax_scale, sliding_window,
                               num_splits=num_splits, kernel=kernel, sinks=sinks)
    qsl, seq_lens = meta.host_lists()
    out = torch.empty_like(q)
    chosen = set(seqs)
    rest = [i for i in range(len(seq_lens)) if i not in chosen]
    if any(qsl[i + 1] > qsl[i] for i in rest):
        _attend_rest(q, kv_cache, meta, rest, out, k_scale, v_scale, softmax_scale, sliding_window,
                     num_splits=num_splits, kernel=kernel, sinks=sinks)
    hkv = kv_cache.shape[2]
    scales = _kv_scales(kv_cache, k_scale, v_scale, hkv)
    flash = _flash_takes(q, hkv)
    for i in seqs:
        a, b = qsl[i], qsl[i + 1]
        blocks = meta.block_tables[i, : -(-seq_lens[i] // meta.block_size)].to(torch.int64)
        _attend_sequence(q[a:b], kv_cache, blocks, seq_lens[i], scales, float(softmax_scale), out[a:b], flash)
    return out


def _sdpa_sequences(q, kv_cache, meta, window, num_splits, kernel, sinks) -> tuple[int, ...]:
    """The table's SDPA sequences; none without the host copies (reading them back would sync the step)."""
    if meta.host_query_start_loc is None or meta.host_seq_lens is None:
        return ()
    if not paged_routing.sdpa_prefill_takes(meta.max_query_len, meta.max_seq_len):
        return ()  # no query is long enough (every decode step): no per-sequence walk on this layer
    qsl, seq_lens = meta.host_query_start_loc, meta.host_seq_lens
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    enabled = kernel is None and not ENV.disable_sdpa_prefill
    return paged_routing.sdpa_prefill_sequences(qlens, list(seq_lens), int(window or 0), q.shape[-1],
                                                storage_dtype_name(q.dtype), sinks is not None, enabled,
                                                num_splits is not None)


#: The last step's sub-batch: (its metadata, the sequences, (sub-batch metadata, row indices)). Every layer of
#: a step gets the same metadata object, so the sub-batch is built once per step, not once per layer.
_last_sub_batch: tuple | None = None


def _attend_rest(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
                 out: torch.Tensor, *args, **kwargs) -> None:
    """Sequences ``seqs`` through the kernels as a batch of their own, their rows of ``out`` written (the
    gathered query and the batch's output die here, before the SDPA calls)."""
    global _last_sub_batch
    last = _last_sub_batch
    if last is not None and last[0] is meta and last[1] == seqs and last[2][1].device == q.device:
        sub, rows = last[2]
    else:
        qsl, seq_lens = meta.host_lists()
        sub, rows = _sub_batch(meta, seqs, qsl, seq_lens, q.device)
        _last_sub_batch = (meta, list(seqs), (sub, rows))
    out.index_copy_(0, rows, paged_attention(q.index_select(0, rows), kv_cache, sub, *args, **kwargs))


def _sub_batch(meta: AttentionMetadata, seqs: list[int], qsl: list[int], seq_lens: list[int],
               device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of sequences ``seqs`` as a batch of their own, and the indices of their query rows in
    the step (one host-to-device copy; the device tensors are gathered on the device)."""
    qlens = [qsl[i + 1] - qsl[i] for i in seqs]
    sub_qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(qlens, out=sub_qsl[1:])
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1], dtype=np.int64) for i in seqs])
    host = torch.from_numpy(np.concatenate([sub_qsl, np.asarray(seqs, dtype=np.int64), rows]))
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    n = len(seqs)
    seq_idx, row_idx = dev[n + 1:2 * n + 1], dev[2 * n + 1:]
    sub_lens = [seq_lens[i] for i in seqs]
    sub = AttentionMetadata(
        query_start_loc=dev[:n + 1].to(torch.int32), seq_lens=meta.seq_lens.index_select(0, seq_idx),
        block_tables=meta.block_tables.index_select(0, seq_idx), slot_mapping=meta.slot_mapping.index_select(0, row_idx),
        max_query_len=max(qlens), max_seq_len=max(sub_lens), block_size=meta.block_size,
        host_query_start_loc=tuple(int(x) for x in sub_qsl), host_seq_lens=tuple(sub_lens),
    )  # fmt: skip
    return sub, row_idx


def _kv_scales(kv_cache: torch.Tensor, k_scale, v_scale, hkv: int) -> torch.Tensor | None:
    """float32 ``[2, Hkv]`` (K and V scale per KV head) for fp8 caches, else None."""
    if kv_cache.dtype not in FP8_DTYPES:
        return None
    if k_scale is None or v_scale is None:
        raise ValueError("fp8 kv cache needs k_scale and v_scale")
    ks = k_scale.to(device=kv_cache.device, dtype=torch.float32).reshape(-1).expand(hkv)
    vs = v_scale.to(device=kv_cache.device, dtype=torch.float32).reshape(-1).expand(hkv)
    return torch.stack([ks, vs])


def _flash_takes(q: torch.Tensor, hkv: int) -> bool:
    """Whether torch's flash kernel takes this step's SDPA calls (asked once per device, dtype and head
    shape, with one-token probes)."""
    if q.device.type != "cuda":
        return False
    return _flash_takes_shape(q.device, q.dtype, q.shape[1], hkv, q.shape[2])


@functools.lru_cache(maxsize=64)
def _flash_takes_shape(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    probe_q = torch.empty((1, hq, 1, d), dtype=dtype, device=device)
    probe_kv = torch.empty((1, hkv, 1, d), dtype=dtype, device=device)
    params = torch.backends.cuda.SDPAParams(probe_q, probe_kv, probe_kv, None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params)


def _gather_kv(kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, heads: slice, dtype: torch.dtype,
               scales: torch.Tensor | None) -> torch.Tensor:
    """K and V of positions ``0 .. seq_len - 1``, KV heads ``heads``: ``[seq_len, 2, heads, D]`` in
    ``dtype`` (fp8 rows times their head's scale in float32, rounded once). On CUDA one Triton kernel reads
    the blocks and writes the rows (:func:`~kvforge.kernels.triton_gather_kv.gather_paged_kv`); elsewhere
    torch gathers whole blocks, then converts (the peak that
    :func:`~kvforge.attention.routing.paged.sdpa_prefill_kv_bytes_per_head` bounds)."""
    if kv_cache.is_cuda and HAS_TRITON:
        return gather_paged_kv(kv_cache, blocks, seq_len, heads, dtype, None if scales is None else scales[:, heads])
    _, two, _, bs, d = kv_cache.shape
    hc = heads.stop - heads.start
    # [blocks, 2, heads, bs, D] read token-major into [blocks, bs, 2, heads, D]: one gather kernel (fp8 bytes
    # as uint8: index support for fp8 dtypes varies by device and torch version).
    store = kv_cache.view(torch.uint8) if scales is not None else kv_cache
    rows = torch.empty((blocks.shape[0], bs, two, hc, d), dtype=store.dtype, device=kv_cache.device)
    torch.index_select(store[:, :, heads].permute(0, 3, 1, 2, 4), 0, blocks, out=rows)
    rows = rows.view(kv_cache.dtype).view(-1, two, hc, d)[:seq_len]
    if scales is not None:
        return rows.to(torch.float32).mul_(scales[:, heads, None]).to(dtype)
    return rows.to(dtype)


def _attend_sequence(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
                     scales: torch.Tensor | None, softmax_scale: float, out: torch.Tensor, flash: bool) -> None:
    """One sequence: ``q [n, Hq, D]`` (its query rows, the last ``n`` of ``seq_len`` positions) attends to
    its gathered context; the result goes to ``out [n, Hq, D]``."""
    n, hq, d = q.shape
    hkv = kv_cache.shape[2]
    group = hq // hkv
    expand = 1 if flash else group
    per_head = paged_routing.sdpa_prefill_kv_bytes_per_head(seq_len, d, storage_dtype_name(q.dtype),
                                                            storage_dtype_name(kv_cache.dtype), expand,
                                                            kv_cache.shape[3])
    heads_per_call = max(1, min(hkv, SDPA_KV_BYTES // per_head))
    for h0 in range(0, hkv, heads_per_call):
        heads = slice(h0, min(hkv, h0 + heads_per_call))
        q_heads = slice(heads.start * group, heads.stop * group)
        kv = _gather_kv(kv_cache, blocks, seq_len, heads, q.dtype, scales)
        if expand > 1:
            kv = kv.repeat_interleave(expand, dim=2)
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [heads, L, D]
        calls_heads = q_heads.stop - q_heads.start
        rows = n if flash else max(1, SDPA_SCORE_ELEMENTS // (calls_heads * seq_len))
        for r0 in range(0, n, rows):
            m = min(rows, n - r0)
            end = seq_len - n + r0 + m  # keys the chunk's last query sees
            qc = q[r0:r0 + m, q_heads].transpose(0, 1)[None]
            o = end_aligned_sdpa(qc, k[None, :, :end], v[None, :, :end], softmax_scale, expand < group)
            out[r0:r0 + m, q_heads] = o[0].transpose(0, 1)
