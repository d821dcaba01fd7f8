"""Declaration of the Triton paged-attention backend (CUDA; kvforge/kernels/).

Block sizes must be multiples of 16 (one tl.dot tile edge); the query is kept
in the model dtype and fp8 K/V are dequantized in registers with the K scale
folded into the softmax scale. Offsets are int64 inside the kernels.
"""

from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

TRITON_PAGED = BackendDeclaration(
    name="triton_paged",
    priority=10,
    layer_kinds=frozenset({"full", "sliding"}),
    platforms=frozenset({"cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=frozenset({64, 80, 96, 128, 192, 256}),
    block_sizes=BlockSizes(multiple_of=16, why="Triton tiles are 16 tokens tall"),
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    implementation="kvforge.attention.triton_impl",
)
