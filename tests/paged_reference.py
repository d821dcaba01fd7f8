"""A small paged KV cache driven by the reference attention, for model tests without the engine.

``PagedReferenceAttention(model)`` is the ``attn(layer, q, k, v)`` callable a
model's forward takes: each layer has its own ``[num_blocks, 2, Hkv, block, D]``
cache; all layers share one block table per sequence (blocks are handed out in
a shuffled order so table lookups are exercised, and never freed: correctness
does not need freeing). The window and sinks of each layer come from the model
(``sliding_window(i)``, ``attention_sinks(i)`` when it has one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import paged_attention, write_kv_cache


class PagedReferenceAttention:
    def __init__(self, model, *, block_size: int = 8, num_blocks: int = 256, seed: int = 0,
                 num_kv_heads: int | None = None):
        self.model = model
        self.block_size = block_size
        self.hkv = num_kv_heads or model.num_kv_heads
        self.caches: dict[int, torch.Tensor] = {}
        self.num_blocks = num_blocks
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.meta: AttentionMetadata | None = None

    def step(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> torch.Tensor:
        """Declare the next forward's batch; returns the positions of its flat tokens."""
        bs = self.block_size
        qsl, seq_lens, slots, pos = [0], [], [], []
        for s, n in zip(seq_ids, query_lens):
            start = self.lens.get(s, 0)
            end = start + n
            table = self.tables.setdefault(s, [])
            while len(table) * bs < end:
                table.append(self.free.pop())
            for p in range(start, end):
                slots.append(table[p // bs] * bs + p % bs)
                pos.append(p)
            self.lens[s] = end
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        width = max(len(self.tables[s]) for s in seq_ids)
        tables = torch.zeros(len(seq_ids), width, dtype=torch.int32)
        for i, s in enumerate(seq_ids):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=bs,
        )
        return torch.tensor(pos, dtype=torch.long)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.caches.get(layer)
        if cache is None:
            cache = torch.zeros(self.num_blocks, 2, self.hkv, self.block_size, k.shape[-1], dtype=k.dtype)
            self.caches[layer] = cache
        write_kv_cache(k, v, cache, self.meta.slot_mapping, None, None)
        sinks_of = getattr(self.model, "attention_sinks", None)
        sinks = sinks_of(layer) if sinks_of is not None else None
        return paged_attention(q, cache, self.meta, None, None, self.model.softmax_scale,
                               self.model.sliding_window(layer), sinks=sinks)


@torch.no_grad()
def run_steps(model, attn: PagedReferenceAttention, steps) -> list[torch.Tensor]:
    """``steps``: a list of ``[(seq_id, token ids), ...]`` batches; logits ``[tokens, vocab]`` of every step."""
    out = []
    for batch in steps:
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.long)
        pos = attn.step([s for s, _ in batch], [len(toks) for _, toks in batch])
        out.append(model.compute_logits(model(ids, pos, attn)))
    return out
