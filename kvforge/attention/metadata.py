"""The per-step contract between the model runner and every attention backend.

One engine step runs a flat batch of ``num_tokens`` new tokens that belong to
``num_seqs`` sequences (prefill chunks and decode tokens mixed). Sequence ``i``
owns the query tokens ``query_start_loc[i]:query_start_loc[i+1]``; after this
step its context holds ``seq_lens[i]`` tokens, so its new tokens sit at
positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``. A query token at
position ``p`` attends causally to positions ``max(0, p - window + 1) .. p``
(``window`` = None means unbounded).

KV cache layout of one full/sliding attention layer (a view into the pool):

    kv_cache: Tensor[num_blocks, 2, num_kv_heads, block_size, head_dim]
              index 0 of dim 1 is K, 1 is V; dtype = storage dtype
              (model dtype, torch.float8_e4m3fn or torch.float8_e5m2)

KV-cache groups: the layers of one group share block ids and a page layout;
a step has one ``block_tables`` and one ``slot_mapping`` per group (the rest
is common), so one AttentionMetadata per group, and each layer is handed its
group's. In a sliding-window group, table entries wholly before a sequence's
window may be 0 (their blocks were freed and may hold another sequence's
tokens): a backend may read such entries (block 0 is in range) but must mask
their keys, NaN included, as it masks every key outside the window.

Token ``p`` of sequence ``i`` lives in block ``block_tables[i, p // block_size]``
at offset ``p % block_size``. Its *slot* is ``block * block_size + offset``;
``slot_mapping[t]`` is the slot that new token ``t`` writes to, or -1 to skip
(padding). Block ids are int32; byte offsets must be computed in int64.

FP8: stored value = saturate(x / scale) cast to the fp8 format, where scale is
``k_scale[h]`` / ``v_scale[h]`` (float32, shape [num_kv_heads]; per-tensor
scales are the same value repeated). Dequantized value = stored * scale.
Backends fold ``k_scale`` into the softmax scale and ``v_scale`` into the output.

Decode order (optional): ``decode_order`` is int32 [num_seqs], a permutation
of ``0 .. num_seqs - 1`` listing the sequences longest context first. Decode
kernels that launch one program per (KV head, sequence) hand out sequences in
this order, so the longest programs start first and the grid's last wave holds
the short ones (longest-processing-time-first): on a batch of mixed context
lengths the tail no longer waits on one long sequence that started last. Any
permutation is correct. Without split-K the values do not depend on it; with
split-K the fp8 warp kernel sizes its chunks by the order's first sequence, so
the split boundaries (and the last bits of the merge) follow the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a backend needs about one step's batch (see module docstring).

    Invariants: ``query_start_loc`` is int32 [num_seqs + 1], starts at 0 and is
    non-decreasing; ``seq_lens`` is int32 [num_seqs] with
    ``seq_lens[i] >= query_len_i``; ``block_tables`` is int32
    [num_seqs, max_blocks_per_seq] (unused entries are arbitrary);
    ``slot_mapping`` is int64 [num_tokens]. ``max_query_len`` and
    ``max_seq_len`` are host ints so kernels can size grids without a sync.
    ``host_query_start_loc`` / ``host_seq_lens`` (optional): the same values
    as Python ints, filled by the model runner from its host step, so the
    PyTorch reference paths that loop over sequences never read a device
    tensor back (a sync per layer); when absent, :meth:`host_lists` reads them.
    ``decode_order`` (optional, decode steps): int32 [num_seqs], the
    sequences longest context first (module docstring, "Decode order").
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    host_query_start_loc: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None
    decode_order: torch.Tensor | None = None

    @staticmethod
    def longest_first(seq_lens: np.ndarray, size: int | None = None) -> np.ndarray:
        """int32 [size] (default ``len(seq_lens)``): the indices of ``seq_lens`` longest first (ties in index
        order), then ``len(seq_lens) .. size - 1`` (padding rows) in order; the ``decode_order`` contract."""
        n = seq_lens.shape[0]
        order = np.arange(n if size is None else size, dtype=np.int32)
        order[:n] = np.argsort(-seq_lens.astype(np.int64), kind="stable")
        return order

    def host_lists(self) -> tuple[list[int], list[int]]:
        """(query_start_loc, seq_lens) as Python lists: the host copies when given, else read back."""
        if self.host_query_start_loc is not None and self.host_seq_lens is not None:
            return list(self.host_query_start_loc), list(self.host_seq_lens)
        return self.query_start_loc.tolist(), self.seq_lens.tolist()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
