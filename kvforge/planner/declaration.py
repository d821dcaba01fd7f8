"""What an attention backend accepts, stated as plain data.

A declaration is a frozen dataclass with no defaults for the capabilities that
matter (layer kinds, KV dtypes, block sizes, quantized-query support, index
limit): a backend cannot inherit a capability it does not have, because there
is nothing to inherit from. The planner never routes a layer to a backend
whose declaration rejects it, and keeps every rejection reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class BlockSizes:
    """Block sizes a backend accepts: explicit sizes, or any multiple of ``multiple_of``.

    Exactly one of ``sizes`` / ``multiple_of`` is set. ``why`` explains the rule
    in messages (for example "the ring of layer 3 needs 7 rows of 1024 bytes").
    """

    sizes: tuple[int, ...] | None = None
    multiple_of: int | None = None
    why: str = ""

    def __post_init__(self):
        if (self.sizes is None) == (self.multiple_of is None):
            raise ValueError("BlockSizes needs exactly one of sizes= or multiple_of=")

    def accepts(self, block_size: int) -> bool:
        if self.sizes is not None:
            return block_size in self.sizes
        return block_size % self.multiple_of == 0

    def describe(self) -> str:
        if self.sizes is not None:
            text = "one of " + ", ".join(str(s) for s in self.sizes) if self.sizes else "no block size"
        elif self.multiple_of == 1:
            text = "any size"
        else:
            text = f"a multiple of {self.multiple_of}"
        return f"{text} ({self.why})" if self.why else text

    @staticmethod
    def any() -> BlockSizes:
        return BlockSizes(multiple_of=1)


@dataclass(frozen=True)
class QuantizedQuery:
    """When a backend consumes a quantized (fp8) query instead of the model dtype.

    Accepted only for KV dtypes in ``kv_dtypes``, ``min_heads_per_rank`` to
    ``max_heads_per_rank`` (None: no upper bound) query heads per rank, and
    models whose dtype is in ``model_dtypes`` (quantizing a float32 query is
    never what a float32 model asked for), and head sizes in ``head_sizes``
    (None: any; for MLA the row width kv_lora_rank + rope). ``QuantizedQuery.never()``
    is the explicit "model-dtype query only" declaration.
    """

    kv_dtypes: frozenset[str]
    min_heads_per_rank: int = 1
    model_dtypes: frozenset[str] = frozenset({"bfloat16", "float16"})
    max_heads_per_rank: int | None = None
    head_sizes: frozenset[int] | None = None
    #: Appended to the plan's reason where the rule accepts: what the backend does with the quantized query
    #: (e.g. where it still runs the model dtype), so the plan does not claim more than runs.
    note: str = ""
    #: Non-empty: the planner takes this quantized query only under ``--query-dtype fp8``, and this text (the
    #: evidence that decided it) is quoted in the plan's reason under ``--query-dtype auto``. Empty: ``auto``
    #: takes it wherever the rule accepts.
    opt_in: str = ""

    def accepts(self, kv_dtype: str, heads_per_rank: int, model_dtype: str = "bfloat16",
                head_size: int | None = None) -> bool:
        """``head_size`` None: not checked (callers that know it pass it; the planner always does)."""
        return (kv_dtype in self.kv_dtypes and heads_per_rank >= self.min_heads_per_rank
                and (self.max_heads_per_rank is None or heads_per_rank <= self.max_heads_per_rank)
                and model_dtype in self.model_dtypes
                and (self.head_sizes is None or head_size is None or head_size in self.head_sizes))

    def heads_range(self) -> str:
        """The accepted heads per rank in words: "from 16" or "at 1-16"."""
        if self.max_heads_per_rank is None:
            return f"from {self.min_heads_per_rank}"
        if self.max_heads_per_rank == self.min_heads_per_rank:
            return f"at {self.min_heads_per_rank}"
        return f"at {self.min_heads_per_rank}-{self.max_heads_per_rank}"

    @staticmethod
    def never() -> QuantizedQuery:
        return QuantizedQuery(kv_dtypes=frozenset(), min_heads_per_rank=0)


@dataclass(frozen=True)
class IndexLimit:
    """The widest offset a backend's index math can hold.

    ``quantity`` is "row_byte_offset" (the kernel computes slot * row_bytes in
    a ``max_value``-bounded integer) or "slot" (slot ids themselves are bounded).
    """

    quantity: str
    max_value: int
    description: str

    def max_slots(self, row_bytes: int) -> int:
        """Number of slots (0 .. n-1) whose offsets stay within ``max_value``."""
        if self.quantity == "row_byte_offset":
            return self.max_value // row_bytes + 1
        return self.max_value + 1


@dataclass(frozen=True)
class LayerContext:
    """What a block-size rule may depend on: the layer and its page geometry.

    ``token_bytes`` is the bytes one token occupies in this layer's page on
    one rank; ``ring_bytes_needed`` is set for ring layers (rows x row_bytes).
    """

    layer_index: int
    kind: str
    head_size: int
    heads_per_rank: int
    kv_heads_per_rank: int
    token_bytes: int
    ring_rows: int = 0
    ring_row_bytes: int = 0

    def page_bytes(self, block_size: int) -> int:
        """Unpadded page bytes at ``block_size`` (padding is never room for data)."""
        return block_size * self.token_bytes


BlockSizeRule = BlockSizes | Callable[[LayerContext], BlockSizes]


@dataclass(frozen=True)
class BackendDeclaration:
    """Everything the planner may know about a backend; no defaults for capabilities.

    head_sizes: None means any head size. page_padding_bytes: pages are padded
    up to a multiple of this many bytes (None = no padding). ``index_limit``
    bounds the offsets the backend computes. ``priority``: higher wins among
    accepting backends. ``sinks``: the backend adds a per-head sink logit to the
    softmax denominator (attention sinks); only backends that declare it get
    layers with sinks, so a backend without the field never serves one.
    """

    name: str
    priority: int
    layer_kinds: frozenset[str]
    platforms: frozenset[str]
    kv_dtypes: frozenset[str]
    head_sizes: frozenset[int] | None
    block_sizes: BlockSizeRule
    quantized_query: QuantizedQuery
    index_limit: IndexLimit
    page_padding_bytes: int | None = None
    sinks: bool = False
    implementation: str = ""  # "module:attr" of the implementation, imported lazily by the engine

    def block_sizes_for(self, ctx: LayerContext) -> BlockSizes:
        rule = self.block_sizes
        return rule if isinstance(rule, BlockSizes) else rule(ctx)

    def rejection(self, *, kind: str, platform: str, kv_dtype: str, head_size: int | None,
                  sinks: bool = False) -> str | None:
        """Why this backend cannot take a layer (``sinks``: the layer has attention sinks), or None when it can."""
        if kind not in self.layer_kinds:
            return f"layer kind {kind!r} not supported (supports {', '.join(sorted(self.layer_kinds))})"
        if sinks and not self.sinks:
            return "attention sinks not supported"
        if platform not in self.platforms:
            return f"platform {platform!r} not supported (supports {', '.join(sorted(self.platforms))})"
        if kv_dtype not in self.kv_dtypes:
            return f"KV dtype {kv_dtype} not supported (supports {', '.join(sorted(self.kv_dtypes))})"
        if self.head_sizes is not None and head_size is not None and head_size not in self.head_sizes:
            return f"head size {head_size} not supported (supports {', '.join(map(str, sorted(self.head_sizes)))})"
        return None

    def padded_page_bytes(self, unpadded: int) -> int:
        pad = self.page_padding_bytes
        if not pad:
            return unpadded
        return -(-unpadded // pad) * pad
