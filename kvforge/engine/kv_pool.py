"""The KV pool: one allocation per rank, exactly the bytes the plan states.

Layout: ``group_size`` page slots x ``num_blocks`` pages of ``page_bytes``.
The plan's attention KV-cache groups (full, sliding-window, MLA) share the
block ids ``0 .. num_blocks - 1``: a block id belongs to one group at a time
(kvforge/engine/block_manager.py) and then stands for its page in every slot.
The ``j``-th layer of a group owns page slot ``j`` and sees it as
``[num_blocks, 2, kv_heads, block_size, head_size]`` in its storage dtype
(the layout in kvforge.attention.metadata); an MLA layer (a plan whose one
group is of kind "mla") sees ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]`` (the layout in kvforge.attention.mla_reference) with one
per-tensor scale (``k_scales[l]`` of shape [1]). A group with fewer layers
than ``group_size`` leaves its last slots unused (the plan's padding layers).

A speculative proposer's layers (the plan's ``draft``: a draft model's) own
the slots after the target's layers of their group (``GroupPlan.draft_layers``)
and see them the same way: ``draft_kv_caches[l]`` etc. for proposer layer
``l``, wrapped for the proposer's model runner by :meth:`KVPool.draft_view`.
In a group of ``draft_layers_per_slot`` = r > 1, proposer layer ``j`` of the
group sees slice ``j % r`` of every page of slot ``j // r`` (a view whose
block stride is the whole page).
They share the target's block ids, so a sequence's block tables hold both.
Every byte offset is int64 (torch indexing); block ids are int32 in the block
tables.

Rings (CsaRingTest): after the attention pages come ``state_slots`` x
``num_rings`` pages of the ring group's page size; ``ring_pages[j]`` is the
uint8 ``[state_slots, page_bytes]`` view of the ring owned by layer
``ring_layers[j]``. A request holds one state slot while it runs.

Linear-attention state (Qwen3-Next, Kimi-Linear: a plan with a "state" group):
after the attention pages (and rings) come, per state layer in index order,
``state_slots`` conv states ``[W - 1, D]`` then ``state_slots`` recurrent
states ``[Hv, K, V]`` in the plan's state dtype, shaped by the model's
``linear_state_layouts()``; ``linear_states`` wraps them
(kvforge/attention/linear_state.py). Each layer's two views take exactly the
plan's ``state_bytes`` of that layer per slot; a running sequence holds one
slot (the same index in every layer). With speculative tokens, one float32
table of verify rows follows (``state_slots x (1 + k)`` rows, each holding every
state layer's ``token_input_elements`` side by side, in index order): exactly the
plan's ``verify_replay_bytes`` of every layer per slot.
"""

from __future__ import annotations

import torch

from kvforge.attention.linear_state import VERIFY_ROW_DTYPE, LinearStateLayout, LinearStates, VerifyRows
from kvforge.errors import ConfigError
from kvforge.host_copies import values_to_device
from kvforge.planner.kv_plan import KVPlan

TORCH_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


ATTENTION_GROUP_KINDS = ("full", "sliding", "mla")


class KVPool:
    """Owns the KV buffer and the per-layer views and fp8 scales.

    Invariants: ``buffer.numel() == num_blocks * group_size * page_bytes +
    state_slots * state_bytes_per_sequence`` (the plan's figures; the second
    term only for rings and state layers); each view's bytes equal ``num_blocks * page_bytes``;
    ``kv_caches[l]`` / ``k_scales[l]`` / ``v_scales[l]`` belong to layer ``l``
    (scales float32 [kv_heads_per_rank]; None for a state layer); ``layer_group[l]`` is the index of
    layer ``l``'s group in ``groups``, whose windows are ``group_windows``.
    """

    def __init__(self, plan: KVPlan, device: torch.device,
                 state_layouts: dict[int, LinearStateLayout] | None = None):
        groups = [g for g in plan.groups if g.kind in ATTENTION_GROUP_KINDS]
        rings = [g for g in plan.groups if g.kind == "ring"]
        state_layers = [x.index for x in plan.layers if x.kind == "state"]
        other = [g for g in plan.groups if g.kind not in ATTENTION_GROUP_KINDS + ("ring", "state")]
        if not groups or other:
            kinds = ", ".join(sorted({g.kind for g in plan.groups}))
            raise ConfigError(
                f"the engine runs attention KV-cache groups (full, sliding, MLA); {plan.architecture} has groups "
                f"of kind(s) {kinds} ({len(plan.groups)} groups). `kvforge plan` supports it; serving it is not "
                f"built yet"
            )
        if plan.num_blocks is None:
            raise ConfigError("the plan has no capacity (no KV memory was given)")
        sizes = sorted({g.block_size for g in groups})
        if len(sizes) > 1:
            raise ConfigError(f"the plan's KV-cache groups have different block sizes {sizes} (layer types with "
                              f"different bytes per token); the engine's pool needs one block size")
        if any(g.page_bytes != g.page_bytes_unpadded for g in groups):
            raise ConfigError("padded pages are not supported by the engine's pool yet")
        self.plan = plan
        self.groups = tuple(groups)
        self.group = groups[0]
        self.num_blocks = plan.num_blocks
        self.block_size = sizes[0]
        self.page_bytes = groups[0].page_bytes
        self.group_windows = tuple(g.sliding_window if g.kind == "sliding" else None for g in groups)
        self.layer_group: list[int] = [0] * len(plan.layers)
        draft_layers = plan.draft.layers if plan.draft is not None else ()
        draft_position = {layer.index: i for i, layer in enumerate(draft_layers)}
        self.draft_layer_group: list[int] = [0] * len(draft_layers)
        for gi, g in enumerate(groups):
            for layer_index in g.layers:
                self.layer_group[layer_index] = gi
            for layer_index in g.draft_layers:
                self.draft_layer_group[draft_position[layer_index]] = gi
        attention_bytes = self.num_blocks * plan.group_size * self.page_bytes
        self.state_slots = (plan.capacity.state_slots or 0) if rings or state_layers else 0
        ring_bytes = self.state_slots * sum(g.page_bytes for g in rings)
        if rings and ring_bytes != self.state_slots * plan.state_bytes_per_sequence:
            raise ConfigError("ring pages do not add up to the plan's state bytes per sequence")
        state_dtype = TORCH_KV_DTYPES[plan.state_dtype] if state_layers else None
        if state_layers:
            _check_state_layouts(plan, state_layers, state_layouts, state_dtype)
        linear_bytes = self.state_slots * sum(plan.layers[i].state_bytes + plan.layers[i].verify_replay_bytes
                                              for i in state_layers)
        nbytes = attention_bytes + ring_bytes + linear_bytes
        # CUDA: zero-filled (one memset), so a read of a never-written page (CUDA-graph padding rows read
        # block 0) sees finite numbers; CPU keeps torch.empty (pages are written before they are read).
        alloc = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        try:
            self.buffer = alloc(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            from kvforge.engine.device_memory import pool_allocation_error

            raise pool_allocation_error(nbytes, torch.device(device), exc) from exc
        # [slot, block, page bytes]: block b of every slot (copy-on-write copies a block in all of them).
        self.pages = self.buffer[:attention_bytes].view(plan.group_size, self.num_blocks, self.page_bytes)
        self.kv_caches: list[torch.Tensor] = [None] * len(plan.layers)
        self.k_scales: list[torch.Tensor] = [None] * len(plan.layers)
        self.v_scales: list[torch.Tensor] = [None] * len(plan.layers)
        self.draft_kv_caches: list[torch.Tensor] = [None] * len(draft_layers)
        self.draft_k_scales: list[torch.Tensor] = [None] * len(draft_layers)
        self.draft_v_scales: list[torch.Tensor] = [None] * len(draft_layers)
        for g in groups:
            r = g.draft_layers_per_slot
            # (slot, its slice of how many, layer, position, where its views go)
            owners = [(slot, 0, 1, plan.layers[i], i, self.kv_caches, self.k_scales, self.v_scales)
                      for slot, i in enumerate(g.layers)]
            owners += [(len(g.layers) + j // r, j % r, r, draft_layers[draft_position[i]], draft_position[i],
                        self.draft_kv_caches, self.draft_k_scales, self.draft_v_scales)
                       for j, i in enumerate(g.draft_layers)]
            for slot, part, parts, layer, position, caches, k_scales, v_scales in owners:
                caches[position] = self._page_view(slot, layer, part, parts)
                k_scales[position] = torch.ones(layer.kv_heads_per_rank, dtype=torch.float32, device=device)
                v_scales[position] = torch.ones(layer.kv_heads_per_rank, dtype=torch.float32, device=device)
        missing = [i for i, c in enumerate(self.kv_caches) if c is None and plan.layers[i].kind != "state"]
        missing += [f"draft {layer.index}" for layer, c in zip(draft_layers, self.draft_kv_caches) if c is None]
        if missing:  # pragma: no cover - every non-state layer is in a group, state groups are refused above
            raise ConfigError(f"layers {missing} are in no attention KV-cache group of the plan")
        self.ring_layers = [g.layers[0] for g in rings]
        self.ring_pages: list[torch.Tensor] = []
        offset = attention_bytes
        for g in rings:
            size = self.state_slots * g.page_bytes
            self.ring_pages.append(self.buffer[offset:offset + size].view(self.state_slots, g.page_bytes))
            offset += size
        self.ring_page_bytes_unpadded = rings[0].page_bytes_unpadded if rings else 0
        #: The conv and recurrent state slots of every linear-attention layer (None without state layers).
        self.linear_states: LinearStates | None = None
        if state_layers:
            conv, recurrent = {}, {}
            for i in state_layers:
                lay = state_layouts[i]
                for shape, into in ((lay.conv_shape, conv), (lay.recurrent_shape, recurrent)):
                    size = self.state_slots * _numel(shape) * state_dtype.itemsize
                    raw = self.buffer[offset:offset + size]
                    if offset % state_dtype.itemsize:  # pragma: no cover - pages are whole multiples of 4 bytes
                        raise ConfigError(f"state slots start at byte {offset}, not aligned to {state_dtype}")
                    into[i] = raw.view(state_dtype).view(self.state_slots, *shape)
                    offset += size
            # Every layer's verify rows in one table, a row of every layer's inputs per (slot, row): a replay
            # gathers its rows once for all layers.
            verify = {}
            rows = plan.num_speculative_tokens + 1
            size = sum(plan.layers[i].verify_replay_bytes for i in state_layers) * self.state_slots
            if size:
                table = self.buffer[offset:offset + size].view(VERIFY_ROW_DTYPE).view(self.state_slots * rows, -1)
                column = 0
                for i in state_layers:
                    verify[i] = VerifyRows(table, state_layouts[i], rows, column)
                    column = verify[i].end
                if column != table.shape[1]:
                    raise ConfigError(f"verify rows take {column} columns of a {table.shape[1]}-column table")
                offset += size
            self.linear_states = LinearStates(conv, recurrent, verify or None)

    def _page_view(self, slot: int, layer, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Page slot ``slot`` as ``layer`` (a LayerPlan) sees it: its cache layout in its storage dtype. With
        ``parts`` > 1 the layer owns slice ``part`` of ``parts`` equal slices of every page of the slot: a view
        whose block stride is the whole page (backends index caches by their strides)."""
        dtype = TORCH_KV_DTYPES[layer.kv_dtype]
        if parts == 1:
            raw = self.pages[slot].view(-1)
            if layer.kind == "mla":  # one row per token: [latent | k_rope] (kvforge/attention/mla_reference.py)
                return raw.view(dtype).view(self.num_blocks, self.block_size, layer.head_size)
            return raw.view(dtype).view(self.num_blocks, 2, layer.kv_heads_per_rank, self.block_size,
                                        layer.head_size)
        size = self.page_bytes // parts
        raw = self.pages[slot][:, part * size:(part + 1) * size]  # [num_blocks, size], rows a page apart
        return raw.view(dtype).unflatten(1, (2, layer.kv_heads_per_rank, self.block_size, layer.head_size))

    def draft_view(self) -> DraftPoolView:
        """The proposer's layers of this pool, shaped as a model runner over them takes a pool."""
        if self.plan.draft is None:
            raise ConfigError("the plan has no speculative proposer layers (plan.draft)")
        return DraftPoolView(self)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def release(self) -> None:
        """Drop the buffer and every view of it (the memory goes back to the allocator once no caller
        holds a view); ``nbytes`` is 0 afterwards. Idempotent."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.buffer.device)
        self.pages = self.buffer
        self.kv_caches, self.k_scales, self.v_scales, self.ring_pages = [], [], [], []
        self.linear_states = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every page slot (so in every layer)."""
        if not pairs:
            return
        src, dst = values_to_device(list(zip(*pairs)), self.buffer.device)
        self.pages[:, dst] = self.pages[:, src]


class DraftPoolView:
    """The proposer's page slots of a :class:`KVPool` under the names a model runner reads (``kv_caches[l]``
    etc. for proposer layer ``l``; the pool's groups and block size). No rings or state slots: a proposer's
    layers are paged. ``release`` drops the view's references; the pool owns the memory."""

    ring_layers: list = []
    ring_pages: list = []
    ring_page_bytes_unpadded = 0
    state_slots = 0
    linear_states = None

    def __init__(self, pool: KVPool):
        self.kv_caches, self.k_scales, self.v_scales = pool.draft_kv_caches, pool.draft_k_scales, pool.draft_v_scales
        self.layer_group = pool.draft_layer_group
        self.groups, self.group_windows = pool.groups, pool.group_windows
        self.num_blocks, self.block_size = pool.num_blocks, pool.block_size

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def release(self) -> None:
        self.kv_caches, self.k_scales, self.v_scales = [], [], []


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_state_layouts(plan: KVPlan, state_layers: list[int], layouts, dtype: torch.dtype) -> None:
    """Every state layer of the plan has the model's layout, of exactly its planned bytes per slot."""
    if layouts is None or set(layouts) != set(state_layers):
        have = sorted(layouts or ())
        raise ConfigError(f"the plan has linear-attention state layers {state_layers} but the model reports state "
                          f"layouts for layers {have} (its linear_state_layouts()); the spec and the model disagree")
    for i in state_layers:
        got = layouts[i].elements * dtype.itemsize
        if got != plan.layers[i].state_bytes:
            raise ConfigError(f"layer {i}: the model's state takes {got} bytes per sequence in {dtype} but the plan "
                              f"planned {plan.layers[i].state_bytes}; the spec's state elements disagree with the "
                              f"model's layout")
        replay = plan.layers[i].verify_replay_bytes
        want = (plan.num_speculative_tokens + 1) * layouts[i].token_input_elements * VERIFY_ROW_DTYPE.itemsize
        if replay and replay != want:
            raise ConfigError(f"layer {i}: the model's verify rows take {want} bytes per sequence but the plan "
                              f"planned {replay}; the spec's token input elements disagree with the model's layout")
