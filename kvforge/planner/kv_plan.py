"""KVPlan: the resolver's output. Printable, JSON-serializable, torch-free.

All byte figures are per rank. ``to_dict`` gives a stable JSON shape (field
order fixed by the dataclasses); ``summary`` a few lines for logs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from kvforge.planner.activations import ActivationReserve


@dataclass(frozen=True)
class LayerPlan:
    """One layer on one rank. ``bytes_per_token``: the bytes each token of a sequence adds to the layer, 0 where
    the layer's bytes are per sequence instead: state layers (``state_bytes``) and every sliding-window layer
    (its window's blocks, at most the window or max-model-len, in the plan's fixed bytes per sequence)."""

    index: int
    kind: str
    backend: str
    kv_dtype: str
    query_dtype: str
    query_dtype_reason: str
    heads_per_rank: int
    kv_heads_per_rank: int
    head_size: int | None
    bytes_per_token: int
    scale_scheme: str | None
    sliding_window: int | None = None
    state_bytes: int = 0
    sinks: bool = False  # the layer adds one sink logit per query head to its softmax denominator
    #: State layers with speculative decoding: per sequence, the float32 inputs of the 1 + k rows of a verify
    #: step, kept to replay the accepted rows onto the state (part of ``state_bytes_per_sequence``).
    verify_replay_bytes: int = 0


@dataclass(frozen=True)
class GroupPlan:
    """Layers sharing one page layout and one block table.

    ``padding_layers``: page slots of this group that no layer uses (hybrid
    models split each layer type into groups of the same size).
    ``sliding_window``: the window of a "sliding" group (None otherwise).
    ``draft_layers``: layers of the speculative proposer (a draft model's layer
    indices) in this group; their page slots follow the target's ``layers``, so
    slot ``len(layers) + j`` belongs to ``draft_layers[j]``. A group of the
    proposer's own has no target ``layers``; when its pages are a whole fraction
    of the pool's, ``draft_layers_per_slot`` (r) of them share a page slot:
    ``draft_layers[j]`` owns bytes ``(j % r) * page_bytes / r`` onwards of each
    page of slot ``j // r``.
    """

    kind: str
    layers: tuple[int, ...]
    block_size: int
    page_bytes: int
    page_bytes_unpadded: int
    padding_layers: int
    kv_dtype: str
    backend: str
    sliding_window: int | None = None
    draft_layers: tuple[int, ...] = ()
    draft_layers_per_slot: int = 1


@dataclass(frozen=True)
class IndexCheck:
    backend: str
    layers: tuple[int, ...]
    quantity: str
    row_bytes: int
    max_slots: int
    planned_slots: int | None
    ok: bool


def format_concurrency(value: float) -> str:
    """A concurrency to two decimals, rounded down: 4.9995 sequences read 4.99, never 5.00."""
    return f"{math.floor(value * 100 + 1e-6) / 100:.2f}"  # the figure has 4 decimals; 1e-6 absorbs float error


@dataclass(frozen=True)
class Capacity:
    """How many tokens fit. Null figures when no memory was given.

    ``num_blocks``: block ids of the KV pool, shared by every attention group
    (a block id spans one page in each of the plan's ``group_size`` slots).
    ``max_concurrency``: sequences of ``max_model_len`` tokens the pool holds
    at once: each takes ``ceil(max_model_len / block_size)`` block ids in every
    full / MLA group, its window's block ids in every sliding group (as many as
    a decode step holds, ``kvforge.planner.groups.sliding_window_blocks``) and
    its state slot (floored to 4 decimals: never more than fit).
    ``capacity_tokens``: the most tokens the full / MLA groups hold at once, over
    any number (``capacity_sequences``) of sequences of at most ``max_model_len``
    tokens, each holding its whole window in every sliding group and a state slot
    where the model has them (all of the pool's blocks without sliding groups or
    state; without full groups, the tokens of ``int(max_concurrency)`` sequences of
    ``max_model_len``). A larger pool never shows fewer.
    """

    kv_cache_dtype: str
    bytes_per_token: int
    kv_cache_memory: int | None
    num_blocks: int | None
    capacity_tokens: int | None
    max_concurrency: float | None
    state_slots: int | None
    #: Bytes one sequence of ``max_model_len`` tokens takes (its block ids' pages and its state slot): the
    #: divisor of ``max_concurrency``, so the ratio of two plans' figures is their exact concurrency gain.
    bytes_per_sequence: int | None = None
    #: Bytes the sliding-window groups hold beyond their windows while one sequence of ``max_model_len``
    #: computes a chunk of the step budget: the memory holds at least ``bytes_per_sequence + chunk_bytes``.
    chunk_bytes: int | None = None
    #: The sequences holding ``capacity_tokens``.
    capacity_sequences: int | None = None


@dataclass(frozen=True)
class DraftPlan:
    """The speculative proposer's layers in the target's plan (a draft model, or extra layers such as an MTP
    layer): planned by the target's rules, placed in the target's groups (``GroupPlan.draft_layers``) and
    paid from the same pool. ``capacity_without`` is the target's plan without them, from the same device
    memory: with ``--kv-cache-memory`` the same KV memory, with ``--gpu-memory`` that memory less the target's
    weights only (the proposer's weights come out of the KV memory too), so the difference to the plan's
    ``capacity`` is everything the proposer costs."""

    model: str
    architecture: str
    layers: tuple[LayerPlan, ...]
    bytes_per_token: int
    weights_bytes_per_rank: int
    num_parameters: int
    capacity_without: Capacity
    index_checks: tuple[IndexCheck, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVPlan:
    model: str
    architecture: str
    platform: str
    model_dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    block_size_reason: str
    max_model_len: int
    num_speculative_tokens: int
    #: The target's layers' bytes per token on one rank (the sum of ``LayerPlan.bytes_per_token``); the pool
    #: pays ``capacity.bytes_per_token``, which adds a proposer's layers (JSON ``pool_bytes_per_token``).
    bytes_per_token: int
    state_bytes_per_sequence: int
    layers: tuple[LayerPlan, ...]
    groups: tuple[GroupPlan, ...]
    group_size: int
    padding_layers: int
    worst_case_waste_pct: float
    capacity: Capacity
    baseline: Capacity | None
    weights_bytes_per_rank: int
    num_parameters: int
    index_checks: tuple[IndexCheck, ...]
    warnings: tuple[str, ...]
    scale_source: str | None
    #: Whether a request may resume from cached blocks of an earlier one, and why (or why not).
    prefix_caching: bool = True
    prefix_caching_reason: str = ""
    #: Storage dtype of the state slots of linear-attention layers (None without state layers), and why.
    state_dtype: str | None = None
    state_dtype_reason: str = ""
    #: The speculative proposer's layers (method draft_model; method mtp: the checkpoint's MTP layer), in the
    #: groups and pool above: ``capacity``
    #: counts them; ``draft.capacity_without`` is the target alone.
    draft: DraftPlan | None = None
    #: The bytes a step of ``max_num_batched_tokens`` tokens needs for its activations on one rank, set
    #: aside before the KV memory when that is derived from the device (kvforge/planner/activations.py).
    activations: ActivationReserve | None = None
    #: Where ``max_model_len`` came from: --max-model-len, the model's context length, or the fitted length
    #: of --max-model-len auto (kvforge/planner/fitted_len.py).
    max_model_len_reason: str = ""

    @property
    def num_blocks(self) -> int | None:
        return self.capacity.num_blocks

    @property
    def capacity_tokens(self) -> int | None:
        return self.capacity.capacity_tokens

    @property
    def capacity_sequences(self) -> int | None:
        return self.capacity.capacity_sequences

    @property
    def max_concurrency(self) -> float | None:
        return self.capacity.max_concurrency

    def concurrency_gain(self) -> float | None:
        """Exact max-concurrency ratio to the baseline (model-dtype KV) plan: its bytes per sequence over
        this plan's. Below 2x for fp8 whenever a sequence also holds bytes fp8 does not halve (state slots,
        or block ids of a layout fp8 does not shrink); None without a baseline or capacity."""
        base = self.baseline
        if base is None or not base.bytes_per_sequence or not self.capacity.bytes_per_sequence:
            return None
        return base.bytes_per_sequence / self.capacity.bytes_per_sequence

    def draft_runner_plan(self) -> KVPlan:
        """The plan as the proposer's model runner reads it: the proposer's layers (``draft.layers``, indices of
        its own) over this plan's groups, block size and pool."""
        if self.draft is None:
            raise ValueError("the plan has no speculative proposer layers (draft)")
        return replace(self, model=self.draft.model, architecture=self.draft.architecture, layers=self.draft.layers,
                       draft=None)

    def draft_groups(self) -> list[tuple[int, GroupPlan]]:
        """(index, group) of every group holding proposer layers."""
        return [(i, g) for i, g in enumerate(self.groups) if g.draft_layers]

    def draft_explanation(self) -> str | None:
        """Where the proposer's layers sit and what they cost, in one line (None without a draft)."""
        draft = self.draft
        if draft is None:
            return None
        placed = "; ".join(_placement(i, g) for i, g in self.draft_groups())
        text = f"draft {draft.model}: {placed}; {draft.bytes_per_token:,} bytes/token beside the target's " \
               f"{self.bytes_per_token:,}; weights {draft.weights_bytes_per_rank / 2**30:.2f} GiB per rank " \
               f"({draft.num_parameters:,} parameters) beside the target's"
        cap, alone = self.capacity, draft.capacity_without
        if cap.bytes_per_sequence is None or alone.bytes_per_sequence is None:
            return text
        return (f"{text}; a sequence of {self.max_model_len} tokens takes {cap.bytes_per_sequence:,} bytes "
                f"(without the draft {alone.bytes_per_sequence:,}): {cap.num_blocks:,} blocks = "
                f"{cap.capacity_tokens:,} tokens, max concurrency {format_concurrency(cap.max_concurrency)} (without the "
                f"draft {alone.num_blocks:,} blocks = {alone.capacity_tokens:,} tokens, "
                f"{format_concurrency(alone.max_concurrency)})")

    def fixed_bytes_text(self) -> str:
        """The per-sequence bytes that do not grow with its tokens, by what holds them."""
        state = sum(layer.state_bytes for layer in self.layers if layer.kind == "state")
        rest = self.state_bytes_per_sequence - state  # the sliding groups' window blocks (and rings' pages)
        parts = []
        if state:
            parts.append(f"linear-attention state {state:,}")
        if rest > 0 and any(layer.kind == "sliding" for layer in self.layers):
            parts.append(f"sliding windows {rest:,}")
        elif rest > 0 and parts:
            parts.append(f"other {rest:,}")
        return f"{self.state_bytes_per_sequence:,}" + (f" ({', '.join(parts)})" if parts else "")

    def capacity_text(self) -> str:
        """``capacity_tokens`` in words: "N tokens", and where windows or state slots bound it, for how many
        sequences (the full groups' tokens beside those sequences' windows)."""
        cap = self.capacity
        text = f"{cap.capacity_tokens:,} tokens"
        if self.state_bytes_per_sequence and cap.capacity_sequences:
            beside = " beside their windows" if any(g.kind == "sliding" for g in self.groups) else ""
            text += f" in {cap.capacity_sequences:,} sequence{'s' * (cap.capacity_sequences != 1)}{beside}"
        return text

    def backends(self) -> list[str]:
        return sorted({layer.backend for layer in self.layers})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["draft"] = self.draft.to_dict() if self.draft is not None else None
        if self.draft is not None:
            d["draft"]["explanation"] = self.draft_explanation()
        cap = d.pop("capacity")
        # The pool's bytes per token (the target's layers and a proposer's): beside the baseline's, which
        # counts the same layers; the plan's own "bytes_per_token" is the target's layers alone.
        d["pool_bytes_per_token"] = cap["bytes_per_token"]
        if d["baseline"] is not None:
            d["baseline"]["pool_bytes_per_token"] = d["baseline"].pop("bytes_per_token")
        d["num_blocks"] = cap["num_blocks"]
        d["capacity_tokens"] = cap["capacity_tokens"]
        d["capacity_sequences"] = cap["capacity_sequences"]
        d["max_concurrency"] = cap["max_concurrency"]
        d["state_slots"] = cap["state_slots"]
        d["kv_cache_memory"] = cap["kv_cache_memory"]
        d["bytes_per_sequence"] = cap["bytes_per_sequence"]
        d["chunk_bytes"] = cap["chunk_bytes"]
        d["concurrency_gain_vs_baseline"] = self.concurrency_gain()
        if self.baseline is not None and self.capacity.capacity_tokens and self.baseline.capacity_tokens:
            d["capacity_gain_vs_baseline"] = round(self.capacity.capacity_tokens / self.baseline.capacity_tokens, 4)
        else:
            d["capacity_gain_vs_baseline"] = None
        return d

    def verify_replay_bytes_per_sequence(self) -> int:
        """Bytes of a sequence's state slot that keep a verify step's inputs (0 without speculation)."""
        return sum(layer.verify_replay_bytes for layer in self.layers)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        qd = sorted({(layer.query_dtype) for layer in self.layers if layer.kind != "state"})
        lines = [
            f"KV plan for {self.model} ({self.architecture}) on {self.platform}, TP={self.tensor_parallel_size}",
            f"  layers: {', '.join(f'{n} {k}' for k, n in kinds.items())}; backends: {', '.join(self.backends())}",
            f"  KV dtype {self.kv_cache_dtype} (scales: {self.scale_source or 'n/a'}), query dtype {', '.join(qd)}, "
            f"block size {self.block_size} ({self.block_size_reason})",
            f"  {self.bytes_per_token} bytes/token/rank, "
            + (f"{self.fixed_bytes_text()} fixed bytes/sequence, " if self.state_bytes_per_sequence else "")
            + f"max model len {self.max_model_len}"
            + (f" ({self.max_model_len_reason})" if self.max_model_len_reason.startswith("auto") else ""),
        ]
        if self.activations is not None:
            lines.append(f"  activations: {self.activations.describe()}")
        cap = self.capacity
        if cap.num_blocks is not None:
            line = (f"  {cap.num_blocks} blocks: {self.capacity_text()}, max concurrency "
                    f"{format_concurrency(cap.max_concurrency)} at {self.max_model_len} tokens")
            if self.baseline is not None and self.baseline.capacity_tokens:
                gain = cap.capacity_tokens / self.baseline.capacity_tokens
                line += f" ({gain:.2f}x the {self.baseline.kv_cache_dtype} KV capacity of {self.baseline.capacity_tokens})"
                exact = self.concurrency_gain()
                if exact is not None and self.state_bytes_per_sequence:
                    line += (f"; concurrency gain exactly {self.baseline.bytes_per_sequence} / "
                             f"{cap.bytes_per_sequence} = {exact:.4f}x bytes per sequence")
            lines.append(line)
        if self.state_dtype is not None:
            lines.append(f"  state dtype {self.state_dtype}: {self.state_dtype_reason}")
        replay = self.verify_replay_bytes_per_sequence()
        if replay:
            lines.append(f"  {replay} of the state bytes/sequence: verify rows kept to roll linear-attention state "
                         f"back to the accepted tokens ({self.num_speculative_tokens + 1} rows per layer, float32)")
        if self.draft is not None:
            lines.append(f"  {self.draft_explanation()}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)


def _listing(indices) -> str:
    indices = list(indices)
    if len(indices) > 4:
        return f"{indices[0]}..{indices[-1]} ({len(indices)})"
    return ", ".join(map(str, indices))


def _placement(index: int, group: GroupPlan) -> str:
    """Where a group's proposer layers sit: joining the target's layers, or a group of their own."""
    many = len(group.draft_layers) > 1
    who = f"layers {_listing(group.draft_layers)}" if many else f"layer {group.draft_layers[0]}"
    if group.layers:
        return f"{who} join{'' if many else 's'} group {index} ({group.kind}, target layers {_listing(group.layers)})"
    packed = (f", {group.draft_layers_per_slot} per page slot" if group.draft_layers_per_slot > 1 else "")
    return f"{who} form{'' if many else 's'} group {index} ({group.kind}{packed}) of their own"
