"""Declaration of the Triton MLA backend (CUDA; implementation: triton_mla.py).

MLA layers only, latent rows ``[kv_lora_rank + qk_rope_head_dim]`` per token,
every KV dtype, any block size (the decode kernel gathers rows per token
through the block table), int64 offsets.

Query dtype: e4m3 at 1-16 heads per rank over an e4m3 cache, for rows of 576
(kv_lora_rank 512 + rope 64: DeepSeek-V2/V3, Kimi-K2) in bf16/fp16 models; the
model dtype everywhere else. Where the e4m3 query is declared, the decode
runs the warp-specialized kernel's fp8 x fp8 ``wgmma`` score product
(``gluon_mla_decode_ws``, query rounded to e4m3 per token and head) whenever a
CTA gets at least 4096 tokens: on the H200 that was 1.05-1.19x faster than the
same kernel with the model-dtype query, 1.16-1.39x the wgmma kernel, and
reached 83-91% of the copy bandwidth at 16 heads, 86-92% at 8 (batch 32-128 x
64k; tenth session, docs/BENCHMARKS.md section 6), at 3.1e-2 to 4.9e-2 of
max|ref| against 2.5e-3 to 6.8e-3 with the model-dtype query (bound 2^-4).
At fewer tokens a CTA, and wherever the Gluon kernels are gated off (other
GPUs, other Triton versions, ``KVFORGE_DISABLE_GLUON=1``), the model-dtype
query runs (``triton_mla_decode.mla_decode``): faster there, and exact. So the
e4m3 query is an upper bound on the rounding, not a promise of it; the plan's
reason says so (``QuantizedQuery.note``). Above 16 heads nothing is declared:
the fp8 query there would run the tl.dot kernel, which the wgmma kernel's
model-dtype query beats at 64 and 128 heads (1.10-1.86x, eighth session).
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
    quantized_query=QuantizedQuery(
        frozenset({"fp8_e4m3"}), min_heads_per_rank=1, max_heads_per_rank=16, head_sizes=frozenset({576}),
        note="on sm_90 where a decode CTA gets >= 4096 tokens; elsewhere the model-dtype query runs, faster there",
    ),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    implementation="kvforge.attention.triton_mla",
)
