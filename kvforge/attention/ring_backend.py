"""Declaration of the per-request ring used by the CsaRingTest architecture.

The ring (rows x row_bytes) must live inside ONE page of its layer. When a
16-token page already holds it, any block size is fine; otherwise the ring asks
for the smallest of 32, 64 and 128 tokens whose page holds it. Page-fit math
uses the unpadded page: padding is never room for the ring.
"""

from kvforge.planner.declaration import (
    INT64_MAX,
    BackendDeclaration,
    BlockSizes,
    IndexLimit,
    LayerContext,
    QuantizedQuery,
)

RING_CANDIDATE_BLOCK_SIZES = (32, 64, 128)


def ring_block_sizes(ctx: LayerContext) -> BlockSizes:
    needed = ctx.ring_rows * ctx.ring_row_bytes
    why = (f"the ring of layer {ctx.layer_index} needs {ctx.ring_rows} rows x {ctx.ring_row_bytes} bytes = "
           f"{needed} bytes inside one page of {ctx.token_bytes} bytes per token")
    if ctx.page_bytes(16) >= needed:
        return BlockSizes(multiple_of=1, why=why)
    fitting = tuple(b for b in RING_CANDIDATE_BLOCK_SIZES if ctx.page_bytes(b) >= needed)
    return BlockSizes(sizes=fitting, why=why)


RING = BackendDeclaration(
    name="csa_ring",
    priority=0,
    layer_kinds=frozenset({"ring"}),
    platforms=frozenset({"cpu", "cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=None,
    block_sizes=ring_block_sizes,
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "torch indexing (int64)"),
    implementation="kvforge.attention.backends.ring",
)
