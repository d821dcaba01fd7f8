"""The resolver: every KV-cache decision, made once, before any weight is read.

``resolve(spec, cache, parallel, platform, backends)`` applies the rules of
docs/PLANNER.md in order: heads per rank, a backend per layer, the query dtype per layer,
the block size, groups and page sizes, capacity, index widths. It raises
PlanError (naming the constraint, the numbers and the fix) when no plan works.
It imports nothing heavy: a 100-layer plan takes a few milliseconds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from kvforge.errors import PlanError
from kvforge.kv_dtypes import BYTES_PER_ELEMENT, is_quantized
from kvforge.planner.activations import ActivationReserve, activation_reserve
from kvforge.planner.declaration import BackendDeclaration, BlockSizes, LayerContext
from kvforge.planner.fitted_len import fit_max_model_len
from kvforge.planner.groups import LayerType, choose_grouping, sliding_window_blocks
from kvforge.planner.inputs import AUTO_MAX_MODEL_LEN, CacheConfig, ParallelConfig, check_platform
from kvforge.planner.kv_plan import Capacity, DraftPlan, GroupPlan, IndexCheck, KVPlan, LayerPlan
from kvforge.planner.proposer_layers import ProposerLayers
from kvforge.planner.query_dtype import plan_query_dtypes
from kvforge.spec.layers import AttentionLayerSpec, MLALayerSpec, StateLayerSpec
from kvforge.spec.model_spec import ModelSpec

logger = logging.getLogger("kvforge.plan")

DEFAULT_BLOCK_SIZE = 16
GROWING_KINDS = ("full", "mla")


@dataclass(frozen=True)
class _Layer:
    spec: object
    kind: str
    heads_per_rank: int
    kv_heads_per_rank: int
    head_size: int | None
    kv_dtype: str
    token_bytes: int
    state_bytes: int
    backend: BackendDeclaration


def _heads_per_rank(layer, tp: int) -> tuple[int, int]:
    """Rule 1: query heads split; KV heads split, or replicated when fewer than ranks. A PlanError says which
    count ``tp`` does not divide; :func:`_check_tp_split` adds the sizes that split the whole model."""
    if isinstance(layer, StateLayerSpec):
        for key, count in layer.split_heads:
            if count % tp:
                raise PlanError(
                    f"--tensor-parallel-size {tp} does not divide {key} {count} (linear-attention layer "
                    f"{layer.index}): each rank holds an equal share of the heads and of their state"
                )
        return 0, 0
    heads = layer.num_heads
    if heads % tp:
        raise PlanError(
            f"--tensor-parallel-size {tp} does not divide num_attention_heads {heads} (layer {layer.index}): "
            f"each rank holds an equal share of the heads"
        )
    if isinstance(layer, MLALayerSpec):
        return heads // tp, 1  # the latent is replicated on every rank
    kv = layer.num_kv_heads
    if kv % tp == 0:
        return heads // tp, kv // tp
    if tp % kv == 0:
        return heads // tp, 1
    raise PlanError(
        f"--tensor-parallel-size {tp} and num_key_value_heads {kv} (layer {layer.index}) do not divide each other: "
        f"KV heads can be split ({kv} % TP == 0) or replicated (TP % {kv} == 0)"
    )


def _splits_whole_model(spec: ModelSpec, tp: int) -> bool:
    """Whether ``tp`` ranks can split every layer's heads and every size of ``spec.tp_split_sizes``."""
    if any(size % tp for _, size in spec.tp_split_sizes):
        return False
    try:
        for layer in spec.layers:
            _heads_per_rank(layer, tp)
    except PlanError:
        return False
    return True


def tp_sizes_that_work(spec: ModelSpec, limit: int | None = None) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that split the whole model (heads, MLP and experts); without
    ``limit``, all of them (each divides the query heads of every attention layer)."""
    if limit is None:
        heads = [ls.num_heads for ls in spec.layers if not isinstance(ls, StateLayerSpec)]
        limit = min(heads) if heads else max((n for ls in spec.layers for _, n in ls.split_heads), default=1)
    return [tp for tp in range(1, limit + 1) if _splits_whole_model(spec, tp)]


def _check_tp_split(spec: ModelSpec, tp: int, whose: str = "") -> list[tuple[int, int]]:
    """PlanError where ``tp`` ranks cannot split ``spec`` (its heads, then its MLP and experts; ``whose``
    prefixes the message, naming a draft model), naming the sizes that split all of it; else each layer's
    (heads, KV heads) per rank."""
    try:
        per_rank = [_heads_per_rank(layer, tp) for layer in spec.layers]
    except PlanError as exc:
        raise PlanError(f"{whose}{exc}; TP sizes that split this whole model: {_sizes_text(spec)}") from None
    for name, size in spec.tp_split_sizes:
        if size % tp:
            raise PlanError(f"{whose}--tensor-parallel-size {tp} does not divide {name} {size}: each rank holds an "
                            f"equal share of it; TP sizes that split this whole model: {_sizes_text(spec)}")
    return per_rank


def _sizes_text(spec: ModelSpec) -> str:
    return ", ".join(map(str, tp_sizes_that_work(spec)))


def _layer_geometry(layer, kv_heads_rank: int, kv_dtype: str, tp: int) -> tuple[int | None, int, int]:
    """(head size seen by the backend, bytes per token on one rank, state bytes per sequence)."""
    elem = BYTES_PER_ELEMENT[kv_dtype]
    if isinstance(layer, AttentionLayerSpec):
        return layer.head_dim_k, kv_heads_rank * (layer.head_dim_k + layer.head_dim_v) * elem, 0
    if isinstance(layer, MLALayerSpec):
        return layer.kv_lora_rank + layer.qk_rope_head_dim, (layer.kv_lora_rank + layer.qk_rope_head_dim) * elem, 0
    split = layer.tp_divisible_elements // tp
    rest = layer.state_elements - layer.tp_divisible_elements
    return None, 0, (split + rest) * elem  # kv_dtype: the plan's state dtype


STATE_DTYPE = "float32"
#: Verify rows of linear-attention layers are kept in float32: the exact values the step's kernels read.
VERIFY_REPLAY_BYTES_PER_ELEMENT = 4


def verify_replay_bytes(layer, num_speculative_tokens: int, tp: int) -> int:
    """Per sequence and state layer: the inputs of a verify step's ``1 + k`` rows on one rank, kept so the
    accepted rows can be replayed onto the state (docs/LINEAR_ATTENTION.md); 0 without speculation."""
    if not num_speculative_tokens or not isinstance(layer, StateLayerSpec):
        return 0
    return (num_speculative_tokens + 1) * (layer.token_input_elements // tp) * VERIFY_REPLAY_BYTES_PER_ELEMENT


def state_dtype(choice: str, model_dtype: str) -> tuple[str, str]:
    """The storage dtype of linear-attention state slots and why (``choice``: ``--state-dtype``).

    "auto" keeps float32 whatever the model dtype: the recurrent state is an accumulator the delta rule
    rewrites at every token, so a 16-bit slot would round it once per decode step (an error that grows
    with the generated length) where transformers and the kernels keep it in float32; the conv history
    (a few percent of the state) shares the slot's dtype. The price is twice the state bytes of a
    16-bit model, which the plan's capacity counts. The state is never quantized."""
    if choice == "auto" and model_dtype == STATE_DTYPE:
        return STATE_DTYPE, "--state-dtype auto: float32, the model dtype"
    if choice == "auto":
        return STATE_DTYPE, (f"--state-dtype auto: the recurrent state is rewritten every token, so a {model_dtype} "
                             f"slot would round it once per decode step (transformers keeps it in float32 too); "
                             f"--state-dtype model halves the state bytes")
    if choice == "model":
        return model_dtype, (f"--state-dtype model: the model dtype, the recurrent state rounded to {model_dtype} "
                             f"after every step")
    return choice, f"--state-dtype {choice}"


def _pick_backend(kind: str, platform: str, kv_dtype: str, head_size: int | None,
                  backends: tuple[BackendDeclaration, ...], what: str, sinks: bool = False) -> BackendDeclaration:
    """Rule 2: the highest-priority backend whose declaration accepts the layer."""
    rejections = []
    for decl in sorted(backends, key=lambda d: -d.priority):
        why = decl.rejection(kind=kind, platform=platform, kv_dtype=kv_dtype, head_size=head_size, sinks=sinks)
        if why is None:
            return decl
        rejections.append(f"  - {decl.name}: {why}")
    listing = "\n".join(rejections) or "  (no backends registered)"
    raise PlanError(f"no attention backend accepts {what} (kind {kind}, KV dtype {kv_dtype}, head size "
                    f"{head_size}, platform {platform}):\n{listing}\nfix: choose another --kv-cache-dtype or --device")


def _violations(block_size: int, constraints) -> list[tuple[BackendDeclaration, LayerContext, BlockSizes]]:
    return [(d, c, r) for d, c, r in constraints if not r.accepts(block_size)]


def _candidates(constraints) -> list[int]:
    sizes = {DEFAULT_BLOCK_SIZE * k for k in range(1, 257)}
    for _, _, rule in constraints:
        if rule.sizes:
            sizes.update(rule.sizes)
    return sorted(s for s in sizes if s >= DEFAULT_BLOCK_SIZE)


def _smallest_working(constraints) -> int | None:
    for b in _candidates(constraints):
        if not _violations(b, constraints):
            return b
    return None


def _violation_text(block_size: int, decl: BackendDeclaration, ctx: LayerContext, rule: BlockSizes) -> str:
    if ctx.kind == "ring":
        page = ctx.page_bytes(block_size)
        needed = ctx.ring_rows * ctx.ring_row_bytes
        return (f"{decl.name}: the ring of layer {ctx.layer_index} needs {ctx.ring_rows} rows x "
                f"{ctx.ring_row_bytes} bytes = {needed} bytes, but one page at block size {block_size} holds "
                f"{page} bytes ({block_size} tokens x {ctx.kv_heads_per_rank} KV head(s) x "
                f"{ctx.token_bytes // max(ctx.kv_heads_per_rank, 1)} bytes) = {page // ctx.ring_row_bytes} rows "
                f"(page padding is not room for the ring)")
    return f"{decl.name} (layer {ctx.layer_index}, {ctx.kind}) needs block size {rule.describe()}"


def _collapse(block_size: int, violations) -> list[str]:
    """One line per distinct violation; identical ones on several layers are merged."""
    merged: dict[str, list[int]] = {}
    for decl, ctx, rule in violations:
        text = _violation_text(block_size, decl, ctx, rule).replace(f"layer {ctx.layer_index}", "layer {L}")
        merged.setdefault(text, []).append(ctx.layer_index)
    return [t.replace("layer {L}", f"layer{'s' if len(ix) > 1 else ''} {_ranges(ix)}") for t, ix in merged.items()]


def _negotiate_block_size(user_block: int | None, constraints) -> tuple[int, str]:
    """Rule 4: validate a user block size, or keep 16, or take the smallest size all accept."""
    if user_block is not None:
        bad = _violations(user_block, constraints)
        if bad:
            fix = _smallest_working(constraints)
            details = "\n".join(f"  - {t}" for t in _collapse(user_block, bad))
            more = ""
            fix_text = (f"use --block-size {fix} (the smallest size that works) or omit --block-size"
                        if fix else "no block size satisfies every backend; change --kv-cache-dtype or TP")
            raise PlanError(f"--block-size {user_block} cannot work:\n{details}{more}\nfix: {fix_text}")
        return user_block, f"set by --block-size {user_block}"
    bad16 = _violations(DEFAULT_BLOCK_SIZE, constraints)
    if not bad16:
        return DEFAULT_BLOCK_SIZE, f"default {DEFAULT_BLOCK_SIZE}: every backend accepts it"
    chosen = _smallest_working(constraints)
    if chosen is None:
        details = "\n".join(f"  - {t}" for t in _collapse(DEFAULT_BLOCK_SIZE, bad16))
        raise PlanError(f"no block size satisfies every backend:\n{details}\nfix: change --kv-cache-dtype or TP")
    forcing = sorted({d.name for d, _, _ in bad16})
    message = f"Setting kv cache block size to {chosen} for {'/'.join(forcing)} backend(s)."
    logger.info(message)
    reasons = "; ".join(_collapse(DEFAULT_BLOCK_SIZE, bad16))
    return chosen, f"{message} At 16: {reasons}"


def _type_key(layer: _Layer) -> tuple:
    """The page layout of a paged layer: layers of one key can share a group's block table and pages."""
    return (layer.kind, getattr(layer.spec, "sliding_window", None), layer.token_bytes, layer.kv_dtype,
            layer.backend.name)


def _build_groups(layers: list[_Layer], block_size: int, spec: ModelSpec, rings_rows: int,
                  proposer: list[_Layer] = (), proposer_name: str = ""):
    types: dict[tuple, tuple[list[_Layer], list[_Layer]]] = {}
    for layer in layers:
        if layer.kind != "state":
            types.setdefault(_type_key(layer), ([], []))[0].append(layer)
    for layer in proposer:
        types.setdefault(_type_key(layer), ([], []))[1].append(layer)
    layer_types = [
        LayerType(kind=k[0], layers=tuple(x.spec.index for x in t), token_bytes=k[2],
                  padded_page_bytes_at_base=(t or d)[0].backend.padded_page_bytes(block_size * k[2]),
                  kv_dtype=k[3], backend=k[4], draft_layers=tuple(x.spec.index for x in d))
        for k, (t, d) in types.items()
    ]
    target_pages = {t.padded_page_bytes_at_base for t in layer_types if t.layers}
    page = max((t.padded_page_bytes_at_base for t in layer_types), default=0)
    if proposer:
        layer_types, page = _fit_proposer_pages(layer_types, target_pages, block_size, proposer_name)
    grouping = choose_grouping(layer_types)
    groups: list[GroupPlan] = []
    by_index = {x.spec.index: x for x in layers}
    by_draft_index = {x.spec.index: x for x in proposer}
    for t, chunk, draft_chunk, pad in grouping.groups:
        unpadded = block_size * t.token_bytes
        group_block = block_size
        if t.padded_page_bytes_at_base < page:
            factor = max(1, page // unpadded)
            group_block = block_size * factor
            unpadded = group_block * t.token_bytes
        first = by_index[chunk[0]] if chunk else by_draft_index[draft_chunk[0]]
        window = getattr(first.spec, "sliding_window", None) if t.kind == "sliding" else None
        if t.layers_per_slot > 1:
            unpadded = page  # the slot's pages are sliced among its proposer layers
        groups.append(GroupPlan(t.kind, chunk, group_block, page, unpadded, pad, t.kv_dtype, t.backend, window,
                                draft_chunk, t.layers_per_slot))
    state_layers = [x for x in layers if x.kind == "state"]
    if state_layers:
        per = max(x.state_bytes for x in state_layers)
        groups.append(GroupPlan("state", tuple(x.spec.index for x in state_layers), 1, per, per, 0,
                                state_layers[0].kv_dtype, state_layers[0].backend.name))
    for ring in spec.rings:
        owner = by_index[ring.layer_index]
        unpadded = block_size * owner.token_bytes
        groups.append(GroupPlan("ring", (ring.layer_index,), block_size, owner.backend.padded_page_bytes(unpadded),
                                unpadded, 0, owner.kv_dtype, "csa_ring"))
    return tuple(groups), grouping


#: Proposer layer kinds whose caches may be a slice of each page (their backends index a cache by its strides).
PACKABLE_KINDS = ("full", "sliding")


def _fit_proposer_pages(layer_types: list[LayerType], target_pages: set[int], block_size: int,
                        name: str) -> tuple[list[LayerType], int]:
    """The layer types with the proposer's own fitted to the pool's page, and that page size.

    A block id spans one page per slot, all of the pool's size. A proposer type of its own with exactly that
    page takes slots like the target's layers; one whose page is a whole fraction ``1/r`` of it (full or
    sliding attention) puts ``r`` layers in each slot, each on a slice of every page; anything else (a
    larger page, a ratio that is not whole, an MLA latent of another width) raises PlanError naming the
    numbers and the fix."""
    if not target_pages:
        return layer_types, max(t.padded_page_bytes_at_base for t in layer_types)
    page = max(target_pages)
    fitted = []
    for t in layer_types:
        own = t.padded_page_bytes_at_base
        if t.layers or own == page:
            fitted.append(t)
            continue
        if t.kind in PACKABLE_KINDS and own < page and page % own == 0:
            fitted.append(replace(t, layers_per_slot=page // own, padded_page_bytes_at_base=page))
            continue
        raise PlanError(
            f"draft model {name}: layer{'s' if len(t.draft_layers) > 1 else ''} {_ranges(t.draft_layers)} "
            f"({t.kind}, {t.token_bytes} bytes per token, KV dtype {t.kv_dtype}, backend {t.backend}) match no "
            f"group of the target, and their page of {block_size} tokens is {own} bytes where the target's pool "
            f"pages are {page} bytes: the proposer's KV lives in the target's pool, whose page slots take a "
            f"layer's page of exactly that size or (full and sliding attention) a whole fraction of it; fix: use "
            f"a draft whose attention layers have the target's KV heads x head size (or MLA latent width), or a "
            f"whole fraction of it, or method ngram")
    return fitted, page


def _block_id_bytes(groups: tuple[GroupPlan, ...], group_size: int) -> int:
    """Bytes behind one block id: its page in each of the ``group_size`` slots."""
    paged = [g for g in groups if g.kind in GROWING_KINDS or g.kind == "sliding"]
    return group_size * (paged[0].page_bytes if paged else 0)


def _window_blocks(groups: tuple[GroupPlan, ...], max_model_len: int) -> int:
    """Block ids one sequence of ``max_model_len`` tokens holds in the sliding groups (a decode step;
    never more than its own blocks): what kvforge/engine/block_manager.py keeps of each window."""
    return sum(min(math.ceil(max_model_len / g.block_size), sliding_window_blocks(g.sliding_window, g.block_size))
               for g in groups if g.kind == "sliding")


def _bytes_per_sequence(groups: tuple[GroupPlan, ...], group_size: int, slot_state_bytes: int,
                        max_model_len: int) -> int:
    """Bytes one sequence of ``max_model_len`` tokens takes: its block ids in every growing group and its
    window's in every sliding group (one page per slot of the group size each), plus its state slot."""
    growing_blocks = sum(math.ceil(max_model_len / g.block_size) for g in groups if g.kind in GROWING_KINDS)
    return (growing_blocks + _window_blocks(groups, max_model_len)) * _block_id_bytes(groups, group_size) \
        + slot_state_bytes


#: Below this many tokens a shorter --max-model-len is no useful fix for too little KV memory.
MIN_SUGGESTED_MODEL_LEN = 64


def _chunk_blocks(groups: tuple[GroupPlan, ...], max_model_len: int, chunk_tokens: int) -> int:
    """Block ids the sliding groups hold beyond their decode windows while one sequence of ``max_model_len``
    computes a chunk of ``chunk_tokens`` tokens (``sliding_window_blocks`` of the chunk less that of one
    token, never more than the sequence's own blocks): what the scheduler charges a request on top of
    its windows (kvforge/engine/scheduler.py, ``max_blocks_needed``)."""
    total = 0
    for g in groups:
        if g.kind == "sliding":
            own = math.ceil(max_model_len / g.block_size)
            total += (min(own, sliding_window_blocks(g.sliding_window, g.block_size, chunk_tokens))
                      - min(own, sliding_window_blocks(g.sliding_window, g.block_size)))
    return total


def _longest_fitting_len(groups: tuple[GroupPlan, ...], group_size: int, slot_state_bytes: int, max_model_len: int,
                         memory: int, chunk_tokens: int) -> int:
    """The longest sequence (at most ``max_model_len``) that ``memory`` holds while it decodes and while it
    computes a chunk of ``chunk_tokens`` (0: none): the bytes of one sequence grow with its length, block by
    block and window by window, so the search halves the range. A --max-model-len at most this passes both
    checks of :func:`_capacity`."""
    block_id_bytes = _block_id_bytes(groups, group_size)

    def fits(length: int) -> bool:
        chunk = min(chunk_tokens, max(1, length - 1))
        return (_bytes_per_sequence(groups, group_size, slot_state_bytes, length)
                + _chunk_blocks(groups, length, chunk) * block_id_bytes) <= memory

    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shorter_len_fix(groups: tuple[GroupPlan, ...], group_size: int, slot_state_bytes: int, max_model_len: int,
                     memory: int, chunk_tokens: int) -> str:
    """"lower --max-model-len to at most N or ..." where a useful N fits, else ""."""
    shorter = _longest_fitting_len(groups, group_size, slot_state_bytes, max_model_len, memory, chunk_tokens)
    return f"lower --max-model-len to at most {shorter} or " if shorter >= MIN_SUGGESTED_MODEL_LEN else ""


#: The max model len of a model whose config names no context length.
DEFAULT_MAX_MODEL_LEN = 4096


def planned_max_model_len(spec: ModelSpec, flag: int | str | None) -> int:
    """The plan's max model len: ``--max-model-len`` when given, else the model's context length; at least 2
    (one prompt token and one generated). For ``auto`` the model's context length, the most it can plan."""
    if flag == AUTO_MAX_MODEL_LEN:
        flag = None
    length = flag or spec.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
    if length < 2:
        source = f"--max-model-len {length}" if flag else f"the model's context length ({length}, from its config)"
        raise PlanError(f"{source}: a sequence needs at least 2 tokens (a prompt token and one "
                        f"generated token); use --max-model-len 2 or more")
    return length


def _capacity(kv_dtype: str, groups: tuple[GroupPlan, ...], group_size: int, bytes_per_token: int,
              slot_state_bytes: int, max_model_len: int, memory: int | None, chunk_tokens: int = 1,
              device_fix: str = "") -> Capacity:
    """Rule 6: blocks, tokens and concurrency at max-model-len from the engine's own accounting.

    A block id covers one page in each of ``group_size`` page slots and is
    taken by one group. A sequence of L tokens takes ceil(L / block) block ids
    in every growing (full / MLA) group, its window's block ids in every
    sliding group (``_window_blocks``), and ``slot_state_bytes`` outside the
    block pool (state layers, rings: one slot per sequence). The memory must also
    hold one such sequence while it computes a chunk of ``chunk_tokens`` (the step
    budget): its windows plus ``_chunk_blocks``; else the scheduler would refuse a
    request of max-model-len that the plan promised. ``device_fix``: the utilization that would hold one such
    sequence, named in that refusal where the memory is a share of the device.
    """
    if memory is None:
        return Capacity(kv_dtype, bytes_per_token, None, None, None, None, None)
    growing = [g for g in groups if g.kind in GROWING_KINDS]
    block_id_bytes = _block_id_bytes(groups, group_size)
    window_blocks = _window_blocks(groups, max_model_len)
    per_seq = _bytes_per_sequence(groups, group_size, slot_state_bytes, max_model_len)
    if per_seq == 0:
        return Capacity(kv_dtype, bytes_per_token, memory, 0, 0, None, None, 0)
    concurrency = memory / per_seq
    chunk_bytes = _chunk_blocks(groups, max_model_len, chunk_tokens) * block_id_bytes
    if concurrency < 1:
        fix = (_shorter_len_fix(groups, group_size, slot_state_bytes, max_model_len, memory, chunk_tokens)
               + (f"raise {device_fix}, or " if device_fix else "")
               + f"give at least {per_seq + chunk_bytes} bytes per rank (--kv-cache-memory; on a GPU also "
                 f"--gpu-memory-utilization)")
        raise PlanError(
            f"the KV cache memory ({memory} bytes per rank) holds less than one sequence of --max-model-len "
            f"{max_model_len} ({per_seq} bytes each"
            + (f", {per_seq + chunk_bytes} while it computes a prefill chunk of {chunk_tokens} tokens" if chunk_bytes
               else "") + f"); fix: {fix}"
        )
    if memory < per_seq + chunk_bytes:
        raise PlanError(
            f"the KV cache memory ({memory} bytes per rank) holds one sequence of --max-model-len {max_model_len} "
            f"({per_seq} bytes) only while it decodes: computing a chunk of {chunk_tokens} tokens, its "
            f"sliding-window groups hold {chunk_bytes} bytes more (the window plus the chunk), so a request of that "
            f"length would be refused; fix: "
            + _shorter_len_fix(groups, group_size, slot_state_bytes, max_model_len, memory, chunk_tokens)
            + (f"raise {device_fix}, or " if device_fix else "")
            + f"give at least {per_seq + chunk_bytes} bytes per rank, or lower --max-num-batched-tokens (the chunk)"
        )
    slots = int(concurrency) if slot_state_bytes else None
    pool = memory - (slots or 0) * slot_state_bytes
    num_blocks = pool // block_id_bytes if block_id_bytes else 0
    if growing:
        tokens, sequences = _growing_tokens(num_blocks, window_blocks, len(growing), growing[0].block_size,
                                            max_model_len, slots)
    else:
        tokens, sequences = int(concurrency) * max_model_len, int(concurrency)
    return Capacity(kv_dtype, bytes_per_token, memory, num_blocks, tokens, math.floor(concurrency * 10**4) / 10**4,
                    slots, per_seq, chunk_bytes, sequences)


def _growing_tokens(num_blocks: int, window_blocks: int, num_growing: int, block_size: int, max_model_len: int,
                    max_sequences: int | None) -> tuple[int, int]:
    """(the most tokens the growing groups hold at once, the sequences holding them): over every count ``k``
    of sequences of at most ``max_model_len`` tokens (at most ``max_sequences`` where each needs a state
    slot), each holding its whole window in the sliding groups (``window_blocks``), the most tokens the
    block ids left to each growing group take. Nondecreasing in ``num_blocks``: no larger pool shows fewer."""
    full_blocks, rest = divmod(max_model_len, block_size)  # a longest sequence: full blocks, then ``rest``

    def held(k: int) -> int:
        blocks = (num_blocks - k * window_blocks) // num_growing  # per growing group, for k sequences
        if blocks < 0:
            return -1
        if blocks >= k * (full_blocks + (rest > 0)):
            return k * max_model_len
        if blocks <= k * full_blocks:
            return blocks * block_size
        return k * full_blocks * block_size + (blocks - k * full_blocks) * rest

    if window_blocks:
        most = num_blocks // window_blocks
    else:  # without windows more sequences never hold less: enough to take every block
        most = num_blocks // num_growing // max(full_blocks, 1) + 1
    if max_sequences is not None:
        most = min(most, max_sequences)
    if most < 1:
        return 0, 0
    # held(k) rises (whole sequences) up to k1 and falls (every block full) from k2; between, a step of
    # ``num_growing`` sequences changes it by the same amount, so each residue class peaks at an end.
    whole = num_growing * (full_blocks + (rest > 0)) + window_blocks
    k1 = num_blocks // whole
    full = num_growing * full_blocks + window_blocks
    k2 = (num_blocks - num_growing) // full + 1 if full else most
    ends = [1, most, *range(k1 - 1, k1 + num_growing + 2), *range(k2 - num_growing - 1, k2 + 2)]
    best = max((k for k in ends if 1 <= k <= most), key=lambda k: (held(k), -k))
    return held(best), best


def _prefix_caching(groups: tuple[GroupPlan, ...], state_slots: int | None = None,
                    max_num_seqs: int | None = None) -> tuple[bool, str]:
    """Rule 8: a prefix-cache hit resumes a request from cached blocks, which must hold everything the
    skipped tokens left behind. Paged groups do (a sliding group needs only its window's blocks); a state
    layer's state at the hit point is a snapshot kept in a state slot no request holds
    (kvforge/engine/state_prefix.py), so where ``state_slots`` (the capacity's; None: unknown) are no more
    than ``max_num_seqs``, a full engine keeps none; a ring's rows at the hit point are kept nowhere, so those models
    cannot cache."""
    kinds = {g.kind for g in groups}
    if "ring" in kinds:
        return False, ("off: a request's ring holds rows of its last tokens, which a cached prefix would "
                       "skip writing")
    if "state" in kinds:
        return True, ("on: paged groups resume from the blocks of the cached prefix, state layers from a "
                      "snapshot of their state at its last block; a prompt's prefill stores one at its last "
                      "block boundary before the final token, where cached requests branch and every "
                      "--state-snapshot-interval tokens (inside the step that passes it, and where a "
                      "chunk ends on a block boundary) and they are kept in state slots no running request "
                      "holds (none reserved), least recently used evicted first"
                      + _snapshot_room(state_slots, max_num_seqs))
    if "sliding" in kinds:
        return True, ("on: full groups resume from every block of the cached prefix, sliding-window groups "
                      "from the blocks inside the window of its end")
    return True, "on: every group resumes from the blocks of the cached prefix"


def _snapshot_room(state_slots: int | None, max_num_seqs: int | None) -> str:
    """What the plan's state slots leave for snapshots beside ``max_num_seqs`` running requests."""
    if state_slots is None or max_num_seqs is None:
        return ""
    if state_slots > max_num_seqs:
        return (f"; at most {max_num_seqs} running requests (--max-num-seqs) leave {state_slots - max_num_seqs} of "
                f"the {state_slots} state slots for snapshots")
    capped = f" (running requests capped at {state_slots})" if max_num_seqs > state_slots else ""
    return (f"; the {state_slots} state slots are no more than --max-num-seqs {max_num_seqs}{capped}, so a full "
            f"engine keeps no snapshot (they are kept only while fewer than {state_slots} requests run): set "
            f"--max-num-seqs below {state_slots}, or give the KV cache more memory")


#: The smallest normal and the largest finite value of each fp8 KV dtype (e4m3 in its fn variant).
FP8_NORMAL_RANGE: dict[str, tuple[str, str]] = {"fp8_e4m3": ("2^-6", "448"), "fp8_e5m2": ("2^-14", "57344")}


def _scale_source(spec: ModelSpec, cache: CacheConfig, quantized: bool) -> tuple[str | None, list[str]]:
    if not quantized:
        return None, []
    if cache.calculate_kv_scales:
        return "calibrate", []
    qcfg = spec.hf_config.get("quantization_config") or {}
    if isinstance(qcfg, dict) and qcfg.get("kv_cache_scheme"):
        return "checkpoint", []
    low, high = FP8_NORMAL_RANGE.get(cache.kv_cache_dtype, FP8_NORMAL_RANGE["fp8_e4m3"])
    return "default", [
        f"no KV-cache scales in the checkpoint: using the default scale 1.0 for K and V, so their values are "
        f"stored as they are in {cache.kv_cache_dtype}: those below its smallest normal ({low}) keep fewer "
        f"significant bits and those above {high} saturate; pass --calculate-kv-scales to calibrate each layer's "
        f"scales on the first batch"
    ]


def step_token_budget(cache: CacheConfig, platform: str, max_model_len: int | None = None) -> int:
    """Tokens one step computes: ``--max-num-batched-tokens``, else the platform's default raised to
    ``--max-num-seqs`` (the engine's rule, kvforge/config.py); without chunked prefill at least
    ``max_model_len`` (a whole prompt in one step; kvforge/engine/config_checks.py schedules it so)."""
    if cache.max_num_batched_tokens is not None:
        budget = cache.max_num_batched_tokens
    else:
        from kvforge.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

        budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS[platform], cache.max_num_seqs)
    if not cache.enable_chunked_prefill and max_model_len is not None:
        budget = max(budget, max_model_len)
    return budget


def _utilization_fix(needed: int, gpu_memory: int, joiner: str) -> str:
    """``joiner`` + "--gpu-memory-utilization to U or more", U the smallest share of the device in hundredths that
    leaves more than ``needed`` bytes; "" where no share of at most 1 does."""
    hundredths = needed * 100 // gpu_memory + 1
    while hundredths <= 100 and int(gpu_memory * (hundredths / 100)) <= needed:  # as the flag's value is read
        hundredths += 1
    if hundredths > 100:
        return ""
    return f"{joiner}--gpu-memory-utilization to {hundredths / 100:.2f} or more"


def _memory(cache: CacheConfig, weights: int, reserve: ActivationReserve, warnings: list[str],
            weights_dtype: str = "", one_sequence: int = 0) -> int | None:
    """KV bytes per rank: ``--kv-cache-memory``, else the device's usable memory less the weights and the
    activation reserve (PlanError when they do not fit, naming the flag to lower; ``weights_dtype``, the
    dtype the weights were counted in, is named there). A utilization a refusal names also holds
    ``one_sequence``, the KV bytes of one sequence of max-model-len (:func:`_capacity`'s least memory), so
    the plan at that value goes through."""
    gib = 2**30
    if cache.kv_cache_memory is not None:
        need = weights + cache.kv_cache_memory + reserve.bytes
        if cache.gpu_memory is not None and need > cache.gpu_memory:
            warnings.append(
                f"weights {weights / gib:.2f} GiB + --kv-cache-memory {cache.kv_cache_memory / gib:.2f} GiB + "
                f"activations {reserve.describe()} = {need / gib:.2f} GiB exceed the device's "
                f"{cache.gpu_memory / gib:.2f} GiB: a full step may run out of memory; lower --kv-cache-memory "
                f"or --max-num-batched-tokens")
        return cache.kv_cache_memory
    if cache.gpu_memory is None:
        return None
    usable = int(cache.gpu_memory * cache.gpu_memory_utilization)
    if weights >= usable:
        raise PlanError(
            f"weights need {weights / gib:.2f} GiB per rank{f' (in {weights_dtype})' if weights_dtype else ''} "
            f"but --gpu-memory {cache.gpu_memory / gib:.2f} GiB x "
            f"--gpu-memory-utilization {cache.gpu_memory_utilization} = {usable / gib:.2f} GiB; fix: raise "
            f"--tensor-parallel-size{_utilization_fix(weights + reserve.bytes + one_sequence, cache.gpu_memory, ', or ')}"
            f", or use a smaller model"
        )
    if weights + reserve.bytes >= usable:
        raise PlanError(
            f"weights {weights / gib:.2f} GiB per rank + activations {reserve.describe()} leave no KV memory in "
            f"--gpu-memory {cache.gpu_memory / gib:.2f} GiB x --gpu-memory-utilization "
            f"{cache.gpu_memory_utilization} = {usable / gib:.2f} GiB; fix: lower --max-num-batched-tokens "
            f"(the activations grow with it), or raise --tensor-parallel-size"
            f"{_utilization_fix(weights + reserve.bytes + one_sequence, cache.gpu_memory, ' or ')}"
        )
    return usable - weights - reserve.bytes


def resolve(spec: ModelSpec, cache: CacheConfig | None = None, parallel: ParallelConfig | None = None,
            platform: str = "cpu", backends: tuple[BackendDeclaration, ...] | None = None,
            model_dtype: str | None = None, _baseline: bool = True, draft_spec: ModelSpec | None = None,
            proposer_layers: ProposerLayers | None = None) -> KVPlan:
    """Decide every KV-cache question for ``spec``; raise PlanError if no plan works.

    ``proposer_layers``: a speculative proposer's layers (kvforge/planner/proposer_layers.py), planned by
    the same rules and placed in the target's groups and pool (the plan's ``draft``); ``draft_spec``: a
    draft model, checked against the target (vocabulary, length, rollback) and planned as its layers."""
    cache = cache or CacheConfig()
    parallel = parallel or ParallelConfig()
    platform = check_platform(platform)
    if backends is None:
        from kvforge.planner.registry import builtin_backends

        backends = builtin_backends()
    backends = tuple(backends)
    tp = parallel.tensor_parallel_size
    model_dtype = model_dtype or spec.model_dtype
    kv_dtype = model_dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype
    warnings: list[str] = []

    if cache.max_model_len == AUTO_MAX_MODEL_LEN:
        longest, whose = planned_max_model_len(spec, None), "the model's context length"
        if draft_spec is not None and draft_spec.max_position_embeddings \
                and draft_spec.max_position_embeddings < longest:
            longest, whose = draft_spec.max_position_embeddings, f"the draft model {draft_spec.name}'s context length"

        def plan_at(length: int, final: bool) -> KVPlan:
            return resolve(spec, replace(cache, max_model_len=length), parallel, platform, backends,
                           model_dtype, _baseline=_baseline and final, draft_spec=draft_spec,
                           proposer_layers=proposer_layers)

        return fit_max_model_len(longest, plan_at, whose)
    max_len = planned_max_model_len(spec, cache.max_model_len)
    if cache.max_model_len is not None:
        len_reason = "--max-model-len"
    elif spec.max_position_embeddings:
        len_reason = "the model's context length (max_position_embeddings)"
    else:
        len_reason = f"the model's config names no context length: {DEFAULT_MAX_MODEL_LEN}"
    if draft_spec is not None:
        from kvforge.speculative.support import check_draft_model

        if proposer_layers is not None:
            raise ValueError("resolve: give draft_spec or proposer_layers, not both")
        check_draft_model(spec, draft_spec, max_len)
        proposer_layers = ProposerLayers.of_draft_model(draft_spec)
    if spec.max_position_embeddings and max_len > spec.max_position_embeddings:
        raise PlanError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                        f"{spec.max_position_embeddings}; fix: use --max-model-len <= {spec.max_position_embeddings}")

    has_state = any(isinstance(ls, StateLayerSpec) for ls in spec.layers)
    slot_dtype, slot_dtype_reason = state_dtype(cache.state_dtype, model_dtype) if has_state else (None, "")
    layers: list[_Layer] = []
    per_rank = _check_tp_split(spec, tp)
    if draft_spec is not None:
        _check_tp_split(draft_spec, tp, f"draft model {draft_spec.name}: ")
    for ls, (heads_rank, kv_rank) in zip(spec.layers, per_rank):
        layer_kv = slot_dtype if isinstance(ls, StateLayerSpec) else kv_dtype
        head_size, token_bytes, state_bytes = _layer_geometry(ls, kv_rank, layer_kv, tp)
        decl = _pick_backend(ls.kind, platform, layer_kv, head_size, backends, f"layer {ls.index}",
                             sinks=getattr(ls, "sinks", False))
        layers.append(_Layer(ls, ls.kind, heads_rank, kv_rank, head_size, layer_kv, token_bytes, state_bytes, decl))
    proposer = _proposer_layers(proposer_layers, tp, kv_dtype, platform, backends) if proposer_layers else []
    uncut = [ls.index for ls in spec.layers if getattr(ls, "sliding_window", None) and ls.sliding_window >= max_len]
    if uncut:
        window = max(spec.layers[i].sliding_window for i in uncut)
        warnings.append(f"sliding window {window} >= --max-model-len {max_len} (layers {_ranges(uncut)}): the window "
                        f"never cuts, so these layers keep every token like full layers (capacity counts "
                        f"{max_len} tokens for each)")
    for ls in spec.layers:
        if isinstance(ls, AttentionLayerSpec) and ls.num_kv_heads < tp:
            warnings.append(f"num_key_value_heads {ls.num_kv_heads} < tensor-parallel-size {tp}: each rank holds "
                            f"1 replicated KV head ({tp // ls.num_kv_heads} copies of each)")
            break

    # Rule 4 constraints: one per (backend, layer), plus each ring's backend.
    constraints = []
    contexts: dict[int, LayerContext] = {}
    for is_target, layer in [(True, x) for x in layers] + [(False, x) for x in proposer]:
        if layer.kind == "state":
            continue
        ctx = LayerContext(layer.spec.index, layer.kind, layer.head_size or 0, layer.heads_per_rank,
                           layer.kv_heads_per_rank, layer.token_bytes)
        if is_target:
            contexts[layer.spec.index] = ctx
        constraints.append((layer.backend, ctx, layer.backend.block_sizes_for(ctx)))
    ring_rows = 0
    for ring in spec.rings:
        owner = contexts[ring.layer_index]
        ring_rows = ring.rows(cache.num_speculative_tokens)
        ring_ctx = LayerContext(ring.layer_index, "ring", owner.head_size, owner.heads_per_rank,
                                owner.kv_heads_per_rank, owner.token_bytes, ring_rows, ring.row_bytes)
        decl = _pick_backend("ring", platform, kv_dtype, None, backends, f"the ring of layer {ring.layer_index}")
        constraints.append((decl, ring_ctx, decl.block_sizes_for(ring_ctx)))
    block_size, block_reason = _negotiate_block_size(cache.block_size, constraints)
    if cache.block_size is not None and block_size > max_len:
        idle = 1 - max_len / block_size
        warnings.append(f"--block-size {block_size} exceeds max model len {max_len}: a sequence fills at most "
                        f"{max_len} of a block's {block_size} token slots, so {idle:.1%} of every block stays "
                        f"empty; a block size <= {max_len} (default {DEFAULT_BLOCK_SIZE}) leaves that memory to "
                        f"other sequences")

    quantized = is_quantized(kv_dtype)
    scheme = cache.kv_scale_scheme if quantized else None
    layer_plans = _layer_plans(layers, model_dtype, cache.query_dtype, platform, scheme,
                               cache.num_speculative_tokens, tp)
    if quantized and scheme == "per_head" and any(x.kind == "mla" for x in layers + proposer):
        warnings.append("MLA latent caches have no KV heads: per-head scales fall back to per-tensor for MLA layers")

    groups, grouping = _build_groups(layers, block_size, spec, ring_rows, proposer,
                                     proposer_layers.name if proposer_layers else "")
    bytes_per_token = sum(x.token_bytes for x in layers if x.kind in GROWING_KINDS)
    # Per-sequence constant bytes: state-layer and ring slots, plus the block ids of the sliding windows.
    slot_state = sum(x.state_bytes + x.verify_replay_bytes for x in layer_plans if x.kind == "state")
    slot_state += sum(g.page_bytes for g in groups if g.kind == "ring")
    state_per_seq = slot_state + _window_blocks(groups, max_len) * _block_id_bytes(groups, grouping.group_size)
    if grouping.padding_layers:
        warnings.append(f"{grouping.padding_layers} padding layer slot(s) in groups of {grouping.group_size}: "
                        f"worst-case waste {grouping.waste_pct:.1f}% of KV memory")

    weights = math.ceil(spec.num_parameters * BYTES_PER_ELEMENT[model_dtype] / tp)
    draft_weights = (math.ceil(proposer_layers.num_parameters * BYTES_PER_ELEMENT[model_dtype] / tp)
                     if proposer_layers else 0)
    step_tokens = step_token_budget(cache, platform, max_len)
    reserve = activation_reserve(spec, step_tokens, cache.max_num_seqs,
                                 num_speculative_tokens=cache.num_speculative_tokens, tensor_parallel_size=tp,
                                 model_dtype=model_dtype, platform=platform, max_model_len=max_len,
                                 kv_dtype=kv_dtype)
    chunk_tokens = max(1, min(step_tokens, max_len - 1))
    one_sequence = (_bytes_per_sequence(groups, grouping.group_size, slot_state, max_len)
                    + _chunk_blocks(groups, max_len, chunk_tokens) * _block_id_bytes(groups, grouping.group_size))
    memory = _memory(cache, weights + draft_weights, reserve, warnings, str(model_dtype), one_sequence)
    device_fix = ""
    if cache.kv_cache_memory is None and cache.gpu_memory is not None:
        device_fix = _utilization_fix(weights + draft_weights + reserve.bytes + one_sequence, cache.gpu_memory, "")
    capacity = _capacity(kv_dtype, groups, grouping.group_size,
                         bytes_per_token + sum(x.token_bytes for x in proposer), slot_state, max_len, memory,
                         chunk_tokens=chunk_tokens, device_fix=device_fix)

    baseline = None
    if _baseline and kv_dtype != model_dtype:
        try:
            base_plan = resolve(spec, CacheConfig(**{**cache.__dict__, "kv_cache_dtype": model_dtype,
                                                     "query_dtype": "model"}), parallel,
                                platform, backends, model_dtype, _baseline=False, proposer_layers=proposer_layers)
            baseline = base_plan.capacity
        except PlanError as exc:
            warnings.append(f"no {model_dtype} baseline plan: {str(exc).splitlines()[0]}")

    index_checks = _index_checks(layers, block_size, capacity, max_len)
    draft_checks = _index_checks(proposer, block_size, capacity, max_len)
    for whose, check in [("", c) for c in index_checks] + [("draft", c) for c in draft_checks]:
        if not check.ok:
            planned = check.planned_slots
            limit_bytes = check.max_slots * check.row_bytes
            decl = next(x.backend for x in layers + proposer if x.backend.name == check.backend)
            whose = f"draft model {proposer_layers.name}: " if whose else ""
            raise PlanError(
                f"{whose}index overflow: {check.backend} computes {check.quantity} with {decl.index_limit.description} "
                f"(max {decl.index_limit.max_value}); with {check.row_bytes}-byte rows it can address "
                f"{check.max_slots} slots (= {decl.index_limit.max_value + 1} / {check.row_bytes}) but the plan has "
                f"{planned} slots ({planned // block_size} blocks x {block_size}) in layers "
                f"{_ranges(check.layers)}; fix: lower the KV memory so at most {check.max_slots} slots "
                f"(~{limit_bytes} bytes per layer) are allocated, or use a backend with 64-bit offsets"
            )

    draft = None
    if proposer_layers is not None:
        alone = resolve(spec, cache, parallel, platform, backends, model_dtype, _baseline=False)
        draft = DraftPlan(
            model=proposer_layers.name, architecture=proposer_layers.architecture,
            layers=tuple(_layer_plans(proposer, model_dtype, cache.query_dtype, platform, scheme, 0, tp)),
            bytes_per_token=sum(x.token_bytes for x in proposer), weights_bytes_per_rank=draft_weights,
            num_parameters=proposer_layers.num_parameters, capacity_without=alone.capacity,
            index_checks=tuple(draft_checks))
    prefix_ok, prefix_reason = _prefix_caching(groups, capacity.state_slots, cache.max_num_seqs)
    scale_source, scale_warnings = _scale_source(spec, cache, quantized)
    warnings.extend(scale_warnings)
    return KVPlan(
        model=spec.name, architecture=spec.architecture, platform=platform, model_dtype=model_dtype,
        kv_cache_dtype=kv_dtype, tensor_parallel_size=tp, block_size=block_size, block_size_reason=block_reason,
        max_model_len=max_len, num_speculative_tokens=cache.num_speculative_tokens,
        bytes_per_token=bytes_per_token, state_bytes_per_sequence=state_per_seq, layers=tuple(layer_plans),
        groups=groups, group_size=grouping.group_size, padding_layers=grouping.padding_layers,
        worst_case_waste_pct=round(grouping.waste_pct, 2), capacity=capacity, baseline=baseline,
        weights_bytes_per_rank=weights, num_parameters=spec.num_parameters, index_checks=tuple(index_checks),
        warnings=tuple(warnings), scale_source=scale_source,
        prefix_caching=prefix_ok, prefix_caching_reason=prefix_reason,
        state_dtype=slot_dtype, state_dtype_reason=slot_dtype_reason, draft=draft, activations=reserve,
        max_model_len_reason=len_reason,
    )


def _proposer_layers(proposer: ProposerLayers, tp: int, kv_dtype: str, platform: str,
                     backends: tuple[BackendDeclaration, ...]) -> list[_Layer]:
    """The proposer's layers by the target's rules 1 and 2 (heads per rank, a backend) in the target's KV
    dtype; errors name the proposer. Only paged layers: their KV must roll back with the target's."""
    out = []
    for ls in proposer.layers:
        if isinstance(ls, StateLayerSpec):
            raise PlanError(f"draft model {proposer.name}: layer {ls.index} keeps linear-attention state, which "
                            f"cannot roll back rejected proposals; use a draft of attention layers only")
        try:
            heads_rank, kv_rank = _heads_per_rank(ls, tp)
            head_size, token_bytes, _ = _layer_geometry(ls, kv_rank, kv_dtype, tp)
            decl = _pick_backend(ls.kind, platform, kv_dtype, head_size, backends, f"layer {ls.index}",
                                 sinks=getattr(ls, "sinks", False))
        except PlanError as exc:
            raise PlanError(f"draft model {proposer.name}: {exc}") from None
        out.append(_Layer(ls, ls.kind, heads_rank, kv_rank, head_size, kv_dtype, token_bytes, 0, decl))
    return out


def _layer_plans(layers: list[_Layer], model_dtype: str, query_dtype: str, platform: str, scheme: str | None,
                 num_speculative_tokens: int, tp: int) -> list[LayerPlan]:
    """Rule 3 (query dtype) and the LayerPlan of each layer."""
    plans = []
    for layer, (qd, why) in zip(layers, plan_query_dtypes(layers, model_dtype, query_dtype, _ranges, platform),
                                strict=True):
        layer_scheme = scheme
        if layer.kind == "mla" and scheme == "per_head":
            layer_scheme = "per_tensor"
        if layer.kind == "state":
            layer_scheme = None
        plans.append(LayerPlan(
            index=layer.spec.index, kind=layer.kind, backend=layer.backend.name, kv_dtype=layer.kv_dtype,
            query_dtype=qd, query_dtype_reason=why, heads_per_rank=layer.heads_per_rank,
            kv_heads_per_rank=layer.kv_heads_per_rank, head_size=layer.head_size,
            bytes_per_token=layer.token_bytes if layer.kind in GROWING_KINDS else 0, scale_scheme=layer_scheme,
            sliding_window=getattr(layer.spec, "sliding_window", None), state_bytes=layer.state_bytes,
            sinks=getattr(layer.spec, "sinks", False),
            verify_replay_bytes=verify_replay_bytes(layer.spec, num_speculative_tokens, tp),
        ))
    return plans


def _ranges(indices) -> str:
    indices = sorted(indices)
    if len(indices) > 4:
        return f"{indices[0]}..{indices[-1]} ({len(indices)} layers)"
    return ", ".join(map(str, indices))


def _index_checks(layers: list[_Layer], block_size: int, capacity: Capacity, max_len: int) -> list[IndexCheck]:
    """Rule 7: the largest slot each backend will address vs what it can address."""
    planned = capacity.num_blocks * block_size if capacity.num_blocks is not None else None
    if planned is None:
        planned = math.ceil(max_len / block_size) * block_size  # at least one full-length sequence
    by_key: dict[tuple[str, int], list[int]] = {}
    decls = {}
    for layer in layers:
        if layer.kind == "state" or layer.token_bytes == 0:
            continue
        by_key.setdefault((layer.backend.name, layer.token_bytes), []).append(layer.spec.index)
        decls[layer.backend.name] = layer.backend
    checks = []
    for (name, row_bytes), idx in by_key.items():
        limit = decls[name].index_limit
        max_slots = limit.max_slots(row_bytes)
        checks.append(IndexCheck(name, tuple(idx), limit.quantity, row_bytes, max_slots, planned, planned <= max_slots))
    return checks
