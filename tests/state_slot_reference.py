"""The ``attn`` object of linear-attention hybrids for model tests without the engine.

:class:`StateSlotAttention` extends the paged reference (tests/paged_reference.py: full attention
``attn(layer, q, k, v)``) with

* ``attn.mla(...)``: MLA layers over a per-layer latent cache written with
  ``write_mla_cache`` and read by the reference ``mla_attention`` (same block tables);
* ``attn.short_conv(...)`` / ``attn.delta_rule(...)``: linear-attention layers over
  :class:`kvforge.attention.linear_state.LinearStates`, one state slot per sequence handed out
  from a shuffled free list (so slot lookups are exercised); a sequence's first chunk has no
  initial state (its slot holds random junk, which must not leak in).

``device``: where the caches, states and step metadata live (the model's device; on CUDA the state
operations run the Triton kernels). ``step(seq_ids, query_lens)`` declares the next forward's batch
and returns its positions;
``preempt(seq_id)`` drops a sequence (its slot goes back to the free list, its blocks are kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from paged_reference import PagedReferenceAttention

from kvforge.attention.linear_state import LinearStates, SlotBatch
from kvforge.attention.mla_reference import mla_attention, write_mla_cache


class StateSlotAttention(PagedReferenceAttention):
    def __init__(self, model, *, num_slots: int = 8, seed: int = 0, device="cpu", **kw):
        super().__init__(model, seed=seed, num_kv_heads=getattr(model, "num_kv_heads", 1), **kw)
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed + 1)
        self.states = LinearStates.allocate(model.linear_state_layouts(), num_slots, torch.float32, self.device)
        for t in [*self.states.conv.values(), *self.states.recurrent.values()]:
            t.copy_(torch.randn(t.shape, generator=gen))  # junk a fresh sequence must not read
        self.free_slots = torch.randperm(num_slots, generator=gen).tolist()
        self.slot_of: dict[int, int] = {}
        self.latent_caches: dict[int, torch.Tensor] = {}

    def step(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> torch.Tensor:
        has_state = [self.lens.get(s, 0) > 0 for s in seq_ids]
        for s in seq_ids:
            if s not in self.slot_of:
                self.slot_of[s] = self.free_slots.pop()
        positions = super().step(seq_ids, query_lens)
        meta = self.meta
        self.meta = dataclasses.replace(
            meta, query_start_loc=meta.query_start_loc.to(self.device), seq_lens=meta.seq_lens.to(self.device),
            block_tables=meta.block_tables.to(self.device), slot_mapping=meta.slot_mapping.to(self.device))
        self.states.set_batch(SlotBatch.build(query_lens, [self.slot_of[s] for s in seq_ids], has_state, self.device))
        return positions.to(self.device)

    def __call__(self, layer, q, k, v):
        if layer not in self.caches:
            self.caches[layer] = torch.zeros(self.num_blocks, 2, self.hkv, self.block_size, k.shape[-1], dtype=k.dtype,
                                             device=k.device)
        return super().__call__(layer, q, k, v)

    def preempt(self, seq_id: int) -> None:
        self.free_slots.append(self.slot_of.pop(seq_id))
        self.lens.pop(seq_id, None)
        self.tables.pop(seq_id, None)

    def short_conv(self, layer, x, weight, bias, activation="silu"):
        return self.states.short_conv(layer, x, weight, bias, activation)

    def delta_rule(self, layer, q, k, v, gates, **kw):
        return self.states.delta_rule(layer, q, k, v, gates, **kw)

    def mla(self, layer, q_nope, q_rope, latent, k_rope, w_uk, w_uv):
        cache = self.latent_caches.get(layer)
        if cache is None:
            width = latent.shape[-1] + k_rope.shape[-1]
            cache = self.latent_caches[layer] = torch.zeros(self.num_blocks, self.block_size, width,
                                                            dtype=latent.dtype, device=latent.device)
        write_mla_cache(latent, k_rope, cache, self.meta.slot_mapping)
        return mla_attention(q_nope, q_rope, cache, self.meta, None, self.model.softmax_scale, w_uk, w_uv)


@torch.no_grad()
def run_steps_on_device(model, attn: StateSlotAttention, steps) -> list[torch.Tensor]:
    """``run_steps`` with the token ids on ``attn.device``; logits come back to the CPU."""
    out = []
    for batch in steps:
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.long, device=attn.device)
        pos = attn.step([s for s, _ in batch], [len(toks) for _, toks in batch])
        out.append(model.compute_logits(model(ids, pos, attn)).cpu())
    return out
