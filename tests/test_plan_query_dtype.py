"""Query dtype per layer is decided at planning time.

See docs/PLANNER.md, "The query dtype is part of the contract".
"""

import pytest

from kvforge.attention.mla_reference_backend import MLA_REFERENCE
from kvforge.attention.reference_backend import REFERENCE
from kvforge.planner.declaration import BackendDeclaration, QuantizedQuery
from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

MLA_FP8Q = BackendDeclaration(
    name="test_mla_fp8q", priority=5, layer_kinds=frozenset({"mla"}), platforms=frozenset({"cpu"}),
    kv_dtypes=frozenset({"bfloat16", "fp8_e4m3"}), head_sizes=frozenset({576}),
    block_sizes=REFERENCE.block_sizes, quantized_query=QuantizedQuery(frozenset({"fp8_e4m3"}), 16),
    index_limit=REFERENCE.index_limit,
)


def mla_plan(preset, kv, tp=8):
    spec = spec_from_hf_config(PRESETS[preset], name=preset, source="test")
    return resolve(spec, CacheConfig(kv_cache_dtype=kv), ParallelConfig(tp), backends=(MLA_FP8Q, MLA_REFERENCE, REFERENCE))


def test_128_heads_tp8_gets_fp8_query():
    p = mla_plan("deepseek-v3", "fp8")
    assert {layer.query_dtype for layer in p.layers} == {"fp8_e4m3"}
    assert all(layer.heads_per_rank == 16 and layer.backend == "test_mla_fp8q" for layer in p.layers)
    assert "16 heads per rank" in p.layers[0].query_dtype_reason


def test_64_heads_tp8_keeps_bf16_query_with_reason():
    p = mla_plan("kimi-k2", "fp8")
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}
    reason = p.layers[0].query_dtype_reason
    assert "only from 16 heads per rank" in reason and "this layer has 8" in reason


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_bf16_kv_gives_model_dtype_query(preset):
    p = mla_plan(preset, "bf16")
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}
    assert "not quantized" in p.layers[0].query_dtype_reason


def test_backend_without_declaration_never_gets_fp8_query():
    spec = spec_from_hf_config(PRESETS["deepseek-v3"], name="v3", source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(8), backends=(MLA_REFERENCE,))
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}
    assert p.layers[0].backend == "torch_mla_reference"
    assert "does not declare a quantized query" in p.layers[0].query_dtype_reason


def test_declaration_requires_explicit_quantized_query():
    # No defaults for capabilities: omitting quantized_query is a TypeError, not silent inheritance.
    with pytest.raises(TypeError):
        BackendDeclaration(name="x", priority=0, layer_kinds=frozenset({"mla"}), platforms=frozenset({"cpu"}),
                           kv_dtypes=frozenset({"fp8_e4m3"}), head_sizes=None, block_sizes=REFERENCE.block_sizes,
                           index_limit=REFERENCE.index_limit)


# ---- the real CUDA MLA backend (triton_mla): e4m3 query at 1-16 heads per rank (measured, see its declaration) ----
@pytest.mark.parametrize("preset,tp,heads,query,reason", [
    ("deepseek-v3", 8, 16, "fp8_e4m3",   # 128 heads at TP8
     "triton_mla declares an fp8_e4m3 query with fp8_e4m3 KV at 1-16 heads per rank; this layer has 16: fp8_e4m3 dot "
     "(on sm_90 where a decode CTA gets >= 4096 tokens; elsewhere the model-dtype query runs, faster there)"),
    ("kimi-k2", 8, 8, "fp8_e4m3",        # 64 heads at TP8
     "triton_mla declares an fp8_e4m3 query with fp8_e4m3 KV at 1-16 heads per rank; this layer has 8: fp8_e4m3 dot "
     "(on sm_90 where a decode CTA gets >= 4096 tokens; elsewhere the model-dtype query runs, faster there)"),
    ("deepseek-v3", 2, 64, "bfloat16",   # 128 heads at TP2
     "triton_mla accepts an fp8_e4m3 query only up to 16 heads per rank; this layer has 64: query stays bfloat16, "
     "KV dequant scale folded into the softmax scale"),
    ("kimi-k2", 1, 64, "bfloat16",
     "triton_mla accepts an fp8_e4m3 query only up to 16 heads per rank; this layer has 64: query stays bfloat16, "
     "KV dequant scale folded into the softmax scale"),
])
def test_triton_mla_query_dtype_on_cuda(preset, tp, heads, query, reason):
    spec = spec_from_hf_config(PRESETS[preset], name=preset, source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(tp), platform="cuda")
    assert {layer.backend for layer in p.layers} == {"triton_mla"}
    assert {layer.heads_per_rank for layer in p.layers} == {heads}
    assert {layer.query_dtype for layer in p.layers} == {query}
    assert p.layers[0].query_dtype_reason == reason


@pytest.mark.parametrize("kv", ["fp8_e5m2", "bf16"])
def test_triton_mla_keeps_the_model_dtype_query_off_e4m3(kv):
    spec = spec_from_hf_config(PRESETS["deepseek-v3"], name="deepseek-v3", source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype=kv), ParallelConfig(8), platform="cuda")
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}


def test_float32_model_keeps_its_query_even_where_fp8_is_declared():
    spec = spec_from_hf_config(PRESETS["kimi-k2"], name="kimi-k2", source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(1), backends=(MLA_FP8Q, MLA_REFERENCE, REFERENCE),
                model_dtype="float32")
    assert {layer.backend for layer in p.layers} == {"test_mla_fp8q"}
    assert {layer.query_dtype for layer in p.layers} == {"float32"}
    assert "quantizes the query only for bfloat16, float16 models; this model is float32" in \
        p.layers[0].query_dtype_reason


def test_triton_mla_keeps_the_model_dtype_query_at_other_mla_widths():
    """The e4m3 query is declared for 576-wide rows only (the kernels that make it pay take R 512 + P 64);
    a narrower MLA (the tiny test models: latent 32) keeps bf16, with the reason."""
    cfg = dict(PRESETS["deepseek-v3"], kv_lora_rank=32, qk_rope_head_dim=16)
    spec = spec_from_hf_config(cfg, name="narrow", source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(8), platform="cuda")
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}
    assert p.layers[0].query_dtype_reason.startswith(
        "triton_mla accepts an fp8_e4m3 query only for row width (kv_lora_rank + rope) 576; this layer has 48")


def test_query_dtype_model_keeps_the_model_dtype_where_a_quantized_query_is_declared():
    """``--query-dtype model``: the exact query even where the backend declares the e4m3 one, with the reason;
    a bad value fails when the config is built (before any weight is read)."""
    from kvforge.errors import ConfigError

    spec = spec_from_hf_config(PRESETS["deepseek-v3"], name="deepseek-v3", source="test")
    p = resolve(spec, CacheConfig(kv_cache_dtype="fp8", query_dtype="model"), ParallelConfig(8), platform="cuda")
    assert {layer.query_dtype for layer in p.layers} == {"bfloat16"}
    assert p.layers[0].query_dtype_reason == (
        "triton_mla declares an fp8_e4m3 query here, but --query-dtype model keeps bfloat16, KV dequant scale "
        "folded into the softmax scale")
    auto = resolve(spec, CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(8), platform="cuda")
    assert {layer.query_dtype for layer in auto.layers} == {"fp8_e4m3"}
    with pytest.raises(ConfigError, match="--query-dtype must be one of auto, model, got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8", query_dtype="fp8")
