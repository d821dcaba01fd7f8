"""The KV pool: one allocation per rank, exactly the bytes the plan states.

Layout: ``group_size`` page slots x ``num_blocks`` pages of ``page_bytes``;
layer ``j`` of the attention group owns page slot ``j`` and sees it as
``[num_blocks, 2, kv_heads, block_size, head_size]`` in its storage dtype
(the layout in kvforge.attention.metadata); an MLA layer (a plan whose one
group is of kind "mla") sees ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]`` (the layout in kvforge.attention.mla_reference) with one
per-tensor scale (``k_scales[l]`` of shape [1]). Every byte offset is int64
(torch indexing); block ids are int32 in the block tables.

Rings (CsaRingTest): after the attention pages come ``state_slots`` x
``num_rings`` pages of the ring group's page size; ``ring_pages[j]`` is the
uint8 ``[state_slots, page_bytes]`` view of the ring owned by layer
``ring_layers[j]``. A request holds one state slot while it runs.
"""

from __future__ import annotations

import torch

from kvforge.errors import ConfigError
from kvforge.planner.kv_plan import KVPlan

TORCH_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class KVPool:
    """Owns the KV buffer and the per-layer views and fp8 scales.

    Invariants: ``buffer.numel() == num_blocks * group_size * page_bytes +
    state_slots * state_bytes_per_sequence`` (the plan's figures; the second
    term only for rings); each view's bytes equal ``num_blocks * page_bytes``;
    ``k_scales[l]`` / ``v_scales[l]`` are float32 [kv_heads_per_rank].
    """

    def __init__(self, plan: KVPlan, device: torch.device):
        groups = [g for g in plan.groups if g.kind in ("full", "sliding", "mla")]
        rings = [g for g in plan.groups if g.kind == "ring"]
        other = [g for g in plan.groups if g.kind not in ("full", "sliding", "mla", "ring")]
        if len(groups) != 1 or other:
            kinds = ", ".join(sorted({g.kind for g in plan.groups}))
            raise ConfigError(
                f"the engine runs models with one attention KV group; {plan.architecture} has groups of kind(s) "
                f"{kinds} ({len(plan.groups)} groups). `kvforge plan` supports it; serving it is not built yet"
            )
        if plan.num_blocks is None:
            raise ConfigError("the plan has no capacity (no KV memory was given)")
        group = groups[0]
        self.plan = plan
        self.group = group
        self.num_blocks = plan.num_blocks
        self.block_size = plan.block_size
        self.page_bytes = group.page_bytes
        if group.page_bytes != group.page_bytes_unpadded:
            raise ConfigError("padded pages are not supported by the engine's pool yet")
        attention_bytes = self.num_blocks * plan.group_size * self.page_bytes
        self.state_slots = (plan.capacity.state_slots or 0) if rings else 0
        ring_bytes = self.state_slots * sum(g.page_bytes for g in rings)
        if rings and ring_bytes != self.state_slots * plan.state_bytes_per_sequence:
            raise ConfigError("ring pages do not add up to the plan's state bytes per sequence")
        nbytes = attention_bytes + ring_bytes
        # CUDA: zero-filled (one memset), so a read of a never-written page (CUDA-graph padding rows read
        # block 0) sees finite numbers; CPU keeps torch.empty (pages are written before they are read).
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.buffer = alloc(nbytes, dtype=torch.uint8, device=device)
        self.kv_caches: list[torch.Tensor] = []
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        per_layer = self.num_blocks * self.page_bytes
        for slot, layer_index in enumerate(group.layers):
            layer = plan.layers[layer_index]
            dtype = TORCH_KV_DTYPES[layer.kv_dtype]
            head = layer.head_size
            raw = self.buffer[slot * per_layer:(slot + 1) * per_layer]
            if layer.kind == "mla":  # one row per token: [latent | k_rope] (kvforge/attention/mla_reference.py)
                view = raw.view(dtype).view(self.num_blocks, self.block_size, head)
            else:
                view = raw.view(dtype).view(self.num_blocks, 2, layer.kv_heads_per_rank, self.block_size, head)
            self.kv_caches.append(view)
            self.k_scales.append(torch.ones(layer.kv_heads_per_rank, dtype=torch.float32, device=device))
            self.v_scales.append(torch.ones(layer.kv_heads_per_rank, dtype=torch.float32, device=device))
        self.ring_layers = [g.layers[0] for g in rings]
        self.ring_pages: list[torch.Tensor] = []
        offset = attention_bytes
        for g in rings:
            size = self.state_slots * g.page_bytes
            self.ring_pages.append(self.buffer[offset:offset + size].view(self.state_slots, g.page_bytes))
            offset += size
        self.ring_page_bytes_unpadded = rings[0].page_bytes_unpadded if rings else 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every layer."""
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64).t().contiguous()
        if self.buffer.device.type == "cuda":
            idx = idx.pin_memory().to(self.buffer.device, non_blocking=True)  # no host sync
        src, dst = idx[0], idx[1]
        for cache in self.kv_caches:
            cache[dst] = cache[src]
