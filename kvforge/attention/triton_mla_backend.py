"""Declaration of the Triton MLA backend (CUDA; object: backends/triton_mla.py).

MLA layers only, latent rows ``[kv_lora_rank + qk_rope_head_dim]`` per token, every KV dtype, any block
size (the decode kernels gather rows per token through the block table), int64 offsets.

Query dtype: the e4m3 query is declared exactly where the routing table
(:data:`kvforge.attention.routing.mla.QUANTIZED_QUERY`) says the warp-specialized kernel can run its fp8
score product: e4m3 caches, 1-16 heads per rank, 576-wide rows (kv_lora_rank 512 + rope 64), bf16/fp16
models. Where that kernel does not take a decode call (fewer tokens per CTA, the Gluon gate closed) the
model-dtype query runs, so the e4m3 query bounds the rounding rather than promising it; the plan's reason
says so (``QuantizedQuery.note``). Everywhere else the model-dtype query is declared. The e4m3 query is
opt-in (``QuantizedQuery.opt_in``): the planner takes it only under ``--query-dtype fp8``.
"""

from kvforge.attention.routing.mla import QUANTIZED_QUERY
from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

TRITON_MLA = BackendDeclaration(
    name="triton_mla",
    priority=10,
    layer_kinds=frozenset({"mla"}),
    platforms=frozenset({"cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=None,
    block_sizes=BlockSizes.any(),
    quantized_query=QuantizedQuery(
        QUANTIZED_QUERY.kv_dtypes, min_heads_per_rank=1, max_heads_per_rank=QUANTIZED_QUERY.max_heads,
        model_dtypes=QUANTIZED_QUERY.model_dtypes, head_sizes=QUANTIZED_QUERY.row_widths, note=QUANTIZED_QUERY.note,
        opt_in=QUANTIZED_QUERY.opt_in,
    ),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    implementation="kvforge.attention.backends.triton_mla",
)
