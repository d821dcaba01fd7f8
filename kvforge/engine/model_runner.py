"""ModelRunner: turns a scheduler step into tensors, runs the model, returns logits.

The attention callable handed to the model writes each layer's new K/V into
its paged cache (quantizing when the plan says fp8) and runs the layer's
planned backend over the block tables. Nothing here decides a KV question:
backends, dtypes, block size and scales all come from the plan.
"""

from __future__ import annotations

import importlib

import torch

from kvforge.attention.fp8 import compute_scales, is_fp8
from kvforge.attention.metadata import AttentionMetadata
from kvforge.engine.kv_pool import KVPool
from kvforge.planner.kv_plan import KVPlan
from kvforge.planner.registry import builtin_backends


class ModelRunner:
    """Runs ``model`` over the KV pool. ``calibrate``: set fp8 scales from the
    first batch's K/V (amax / format max), else keep the default 1.0; every
    scale is multiplied by ``scale_multiplier`` (a diagnostic, default 1)."""

    def __init__(self, model, pool: KVPool, plan: KVPlan, device: torch.device, *, calibrate: bool = False,
                 scale_multiplier: float = 1.0):
        self.model = model
        self.pool = pool
        self.plan = plan
        self.device = device
        self.block_size = plan.block_size
        impls = {d.name: d.implementation for d in builtin_backends()}
        self.impls = [importlib.import_module(impls[layer.backend]) for layer in plan.layers]
        self.windows = [model.sliding_window(i) for i in range(len(plan.layers))]
        self.softmax_scale = model.softmax_scale
        self.scale_scheme = plan.layers[0].scale_scheme or "per_tensor"
        self.needs_calibration = calibrate and any(is_fp8(c.dtype) for c in pool.kv_caches)
        self.scale_multiplier = scale_multiplier
        if scale_multiplier != 1.0:
            for s in pool.k_scales + pool.v_scales:
                s.mul_(scale_multiplier)
        self._meta: AttentionMetadata | None = None

    # ---- inputs ---------------------------------------------------------------
    def prepare(self, chunks: list[tuple[list[int], int, list[int]]]):
        """chunks: per sequence (new token ids, start position, block table).

        Returns (input_ids, positions, metadata). Positions of sequence i's new
        tokens are start .. start + n - 1; its context after the step is start + n.
        """
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        max_blocks = max(len(c[2]) for c in chunks)
        tables = torch.zeros((len(chunks), max(max_blocks, 1)), dtype=torch.int32)
        for i, (tokens, start, table) in enumerate(chunks):
            n = len(tokens)
            ids.extend(tokens)
            p = list(range(start, start + n))
            pos.extend(p)
            slots.extend(table[q // bs] * bs + q % bs for q in p)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(len(c[0]) for c in chunks),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta)

    # ---- attention ------------------------------------------------------------
    def _attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool, impl, meta = self.pool, self.impls[layer], self._meta
        cache = pool.kv_caches[layer]
        if self.needs_calibration:
            self._calibrate(layer, k, v)
        impl.write_kv_cache(k, v, cache, meta.slot_mapping, pool.k_scales[layer], pool.v_scales[layer])
        return impl.paged_attention(q, cache, meta, pool.k_scales[layer], pool.v_scales[layer],
                                    self.softmax_scale, self.windows[layer])

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        dtype = self.pool.kv_caches[layer].dtype
        ks = compute_scales(k, scheme=self.scale_scheme, dtype=dtype)
        vs = compute_scales(v, scheme=self.scale_scheme, dtype=dtype)
        n = self.pool.k_scales[layer].numel()
        self.pool.k_scales[layer].copy_(ks.float().reshape(-1).expand(n) * self.scale_multiplier)
        self.pool.v_scales[layer].copy_(vs.float().reshape(-1).expand(n) * self.scale_multiplier)
        if layer == len(self.pool.kv_caches) - 1:
            self.needs_calibration = False

    # ---- forward --------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks, logits_rows: list[int] | None) -> torch.Tensor:
        """Run one step; return float32 logits for ``logits_rows`` (flat token
        indices), or for every token when ``logits_rows`` is None."""
        input_ids, positions, self._meta = self.prepare(chunks)
        try:
            hidden = self.model(input_ids, positions, self._attn)
        finally:
            meta, self._meta = self._meta, None
        del meta
        if logits_rows is not None:
            hidden = hidden[torch.tensor(logits_rows, dtype=torch.long, device=hidden.device)]
        return self.model.compute_logits(hidden)
