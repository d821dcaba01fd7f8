"""Declaration of the Triton MLA backend (CUDA; implementation: triton_mla.py).

MLA layers only, latent rows ``[kv_lora_rank + qk_rope_head_dim]`` per token,
every KV dtype, any block size (the decode kernel gathers rows per token
through the block table), int64 offsets. The quantized-query regime (fp8 query,
fp8 x fp8 dot for ``Q C^T``) is declared only for e4m3 caches and only from the
head count per rank where it was measured both correct and faster than the
model-dtype query (docs/MLA.md; ``benchmarks/bench_mla_decode.py``, H200,
2026-11-29): at 64 and 128 heads per rank it is 1.2-1.57x faster than the bf16
query over the same fp8 cache (the dots dominate there), at 8, 16 and 32 heads
it is 2-4% slower (memory-bound; quantizing the query is pure overhead), and
its error stays within 1.4e-2 of max|ref| (worst over the declaration walk;
2.8e-3 .. 1.3e-2 at 8, 16 and 128 heads; tests/test_triton_mla.py). Hence
``min_heads_per_rank=64``, for 16-bit models only (the default
``model_dtypes``). The quantized query is a decode-only regime: prefill
expands the latents with the model-dtype query.
"""

from kvforge.planner.declaration import INT64_MAX, BackendDeclaration, BlockSizes, IndexLimit, QuantizedQuery

TRITON_MLA = BackendDeclaration(
    name="triton_mla",
    priority=10,
    layer_kinds=frozenset({"mla"}),
    platforms=frozenset({"cuda"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"}),
    head_sizes=None,
    block_sizes=BlockSizes.any(),
    quantized_query=QuantizedQuery(kv_dtypes=frozenset({"fp8_e4m3"}), min_heads_per_rank=64),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    implementation="kvforge.attention.triton_mla",
)
