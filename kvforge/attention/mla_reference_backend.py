"""Declaration of the PyTorch MLA reference backend (object: backends/mla_reference.py).

It takes MLA layers only (DeepSeek-V2/V3 latent caches laid out as
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``), on any device
torch supports, at any block size, in every KV dtype. The query always stays in
the model dtype: for fp8 caches the dequant scale is folded into the softmax
scale (and applied once to the latent output), so the declaration is
``QuantizedQuery.never()``. Offsets are computed by torch in int64.
"""

from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

MLA_REFERENCE = BackendDeclaration(
    name="torch_mla_reference",
    priority=1,
    layer_kinds=frozenset({"mla"}),
    platforms=frozenset({"cpu", "cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=None,
    block_sizes=BlockSizes.any(),
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "torch indexing (int64)"),
    implementation="kvforge.attention.backends.mla_reference",
)
