"""Declaration of the PyTorch reference backend (object: backends/torch_reference.py).

It runs full, sliding and state layers (MLA layers go to
mla_reference_backend.py) on any device torch supports, at any block size, in
every KV dtype, with attention sinks, and always takes a model-dtype query
(the fp8 dequant scale is folded into the softmax scale). Offsets are computed by torch in int64.
"""

from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

REFERENCE = BackendDeclaration(
    name="torch_reference",
    priority=0,
    layer_kinds=frozenset({"full", "sliding", "state"}),
    platforms=frozenset({"cpu", "cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=None,
    block_sizes=BlockSizes.any(),
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "torch indexing (int64)"),
    sinks=True,
    implementation="kvforge.attention.backends.torch_reference",
)
