"""Declaration of the Triton MLA backend (CUDA; implementation: triton_mla.py).

MLA layers only, latent rows ``[kv_lora_rank + qk_rope_head_dim]`` per token,
every KV dtype, any block size (the decode kernel gathers rows per token
through the block table), int64 offsets.

Query dtype: the model dtype only (``QuantizedQuery.never()``). The kernels
have an fp8-query regime (fp8 query, fp8 x fp8 dot for ``Q C^T``, the tl.dot
kernel), and it was declared from 64 heads per rank while it beat the
model-dtype query on the tl.dot kernel (1.2-1.57x at 64 and 128 heads, H200,
2026-11-29). Since then the model-dtype query runs the Hopper wgmma kernel
(``gluon_mla_decode``), and on the H200 it is faster than the fp8 query at 64
and 128 heads per rank at every batch measured up to 32 (1.10-1.86x; eighth
session, docs/BENCHMARKS.md section 6); the fp8 query won only at 128 heads x
batch 128 x 16k, by 4%. An fp8 query also costs accuracy (up to 1.4e-2 of
max|ref| against 2.5e-3). So nothing is declared: the regime is kept and
tested as a kernel capability, and a declaration returns only with a kernel
that is measured faster (an fp8 x fp8 wgmma score product, docs/MLA.md).
Caveat: where the wgmma kernel is gated off (other GPUs, other Triton
versions, ``KVFORGE_DISABLE_GLUON=1``) the tl.dot comparison above still holds;
the planner does not know the device's kernels, so it keeps the choice that
is right on the measured default.
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
    quantized_query=QuantizedQuery.never(),
    index_limit=IndexLimit("row_byte_offset", INT64_MAX, "int64 offsets in the kernels"),
    implementation="kvforge.attention.triton_mla",
)
