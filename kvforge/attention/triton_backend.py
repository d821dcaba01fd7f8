"""Declaration of the Triton paged-attention backend (CUDA; object: backends/triton_paged.py).

The values mirror the constants the kernel module states about itself
(``kvforge.kernels.triton_paged_attention``: ``SUPPORTED_HEAD_SIZES``,
``BLOCK_SIZE_MULTIPLE``, ``ACCEPTS_QUANTIZED_QUERY``); they are written out
here because the planner must not import torch, and tests/test_routing_tables.py
checks that both agree, and that the routing table's kernels
(:mod:`kvforge.attention.routing.paged`) stay inside this declaration. Block sizes must be
multiples of 16 (one tl.dot tile edge); the query is kept in the model dtype
and fp8 K/V are dequantized in registers with the K scale folded into the
softmax scale. fp32 caches run with IEEE fp32 dots (correct, untuned).
Sliding windows and attention sinks (one logit per query head in the
softmax denominator) are served; sinks on the tl.dot kernel only, which
the routing table picks for every layer with sinks.
Offsets are int64 inside the kernels.
"""

from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

TRITON_PAGED = BackendDeclaration(
    name="triton_paged",
    priority=10,
    layer_kinds=frozenset({"full", "sliding"}),
    platforms=frozenset({"cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=frozenset({32, 48, 64, 80, 96, 112, 128, 160, 192, 256}),
    block_sizes=BlockSizes(multiple_of=16, why="Triton tiles are 16 tokens tall"),
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    sinks=True,
    implementation="kvforge.attention.backends.triton_paged",
)
