"""Query dtype per layer is decided at planning time.

See docs/PLANNER.md, "The query dtype is part of the contract".
"""

import pytest

from kvforge.attention.mla_reference_backend import MLA_REFERENCE
from kvforge.attention.reference_backend import REFERENCE
from kvforge.errors import PlanError
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


# ---- the real CUDA MLA backend (triton_mla): the e4m3 query is declared at 1-16 heads per rank, opt-in ----
DECLARED = ("triton_mla declares an fp8_e4m3 query with fp8_e4m3 KV at 1-16 heads per rank; this layer has {h}: "
            "fp8_e4m3 dot (on sm_90 where a decode CTA gets >= 1024 tokens; elsewhere the model-dtype query runs, "
            "faster there)")
OPT_IN = ("triton_mla declares an fp8_e4m3 query here, opt-in only (--query-dtype fp8): its decode output error "
          "was 15x the model-dtype query's (2.0-2.6e-2 against 1.7-2.0e-3 relative L2) for a 1.09-1.14x "
          "kernel speed-up, and no model-level KLD has been measured (docs/BENCHMARKS.md); query stays bfloat16, KV "
          "dequant scale folded into the softmax scale")
ABOVE_16 = ("triton_mla accepts an fp8_e4m3 query only up to 16 heads per rank; this layer has 64: query stays "
            "bfloat16, KV dequant scale folded into the softmax scale")


def cuda_plan(preset, tp, **cache):
    spec = spec_from_hf_config(PRESETS[preset], name=preset, source="test")
    return resolve(spec, CacheConfig(**cache), ParallelConfig(tp), platform="cuda")


@pytest.mark.parametrize("preset,tp,heads", [
    ("deepseek-v2-lite", 1, 16),  # 16 heads
    ("deepseek-v3", 8, 16),       # 128 heads at TP8
    ("kimi-k2", 8, 8),            # 64 heads at TP8
])
def test_fp8_mla_plans_the_model_dtype_query_by_default_and_e4m3_when_asked(preset, tp, heads):
    """The e4m3 query is declared here, but the default (auto) plans bf16 and names the evidence; --query-dtype
    fp8 plans e4m3 with the declaration's reason."""
    auto = cuda_plan(preset, tp, kv_cache_dtype="fp8")
    assert {layer.backend for layer in auto.layers} == {"triton_mla"}
    assert {layer.heads_per_rank for layer in auto.layers} == {heads}
    assert {(layer.query_dtype, layer.query_dtype_reason) for layer in auto.layers} == {("bfloat16", OPT_IN)}
    model = cuda_plan(preset, tp, kv_cache_dtype="fp8", query_dtype="model")
    assert [layer.query_dtype for layer in model.layers] == [layer.query_dtype for layer in auto.layers]
    fp8 = cuda_plan(preset, tp, kv_cache_dtype="fp8", query_dtype="fp8")
    assert {(layer.query_dtype, layer.query_dtype_reason) for layer in fp8.layers} == \
        {("fp8_e4m3", "--query-dtype fp8: " + DECLARED.format(h=heads))}
    assert fp8.capacity == auto.capacity and fp8.block_size == auto.block_size  # the query is not stored


@pytest.mark.parametrize("preset,tp", [("deepseek-v3", 2), ("kimi-k2", 1)])
def test_triton_mla_above_16_heads_keeps_the_model_dtype_query(preset, tp):
    p = cuda_plan(preset, tp, kv_cache_dtype="fp8")
    assert {layer.heads_per_rank for layer in p.layers} == {64}
    assert {(layer.query_dtype, layer.query_dtype_reason) for layer in p.layers} == {("bfloat16", ABOVE_16)}


@pytest.mark.parametrize("preset,tp,kv,platform,why", [
    ("deepseek-v2-lite", 1, "bf16", "cuda", "layers 0..26 (27 layers): KV cache is bfloat16 (not quantized)"),
    ("deepseek-v3", 8, "fp8_e5m2", "cuda",
     "layers 0..60 (61 layers): triton_mla does not declare a quantized query for fp8_e5m2 KV"),
    ("deepseek-v3", 8, "fp8", "cpu",
     "layers 0..60 (61 layers): torch_mla_reference does not declare a quantized query for fp8_e4m3 KV"),
    ("deepseek-v3", 2, "fp8", "cuda",
     "layers 0..60 (61 layers): triton_mla accepts an fp8_e4m3 query only up to 16 heads per rank; this layer "
     "has 64"),
    ("llama-3.1-8b", 1, "fp8", "cuda",
     "layers 0..31 (32 layers): triton_paged does not declare a quantized query for fp8_e4m3 KV"),
])
def test_query_dtype_fp8_where_a_layer_cannot_take_it_is_a_plan_error(preset, tp, kv, platform, why):
    spec = spec_from_hf_config(PRESETS[preset], name=preset, source="test")
    with pytest.raises(PlanError) as err:
        resolve(spec, CacheConfig(kv_cache_dtype=kv, query_dtype="fp8"), ParallelConfig(tp), platform=platform)
    text = str(err.value)
    assert text.startswith("--query-dtype fp8: these layers cannot take a quantized (fp8) attention query:\n")
    assert f"\n  - {why}\n" in text
    assert "fix: drop --query-dtype fp8 (auto keeps the model-dtype query)" in text
    # a CPU plan points to the GPU backends; a CUDA plan has nothing to add
    assert ("this plan is for CPU: `kvforge plan --device cuda` plans the GPU backends" in text) == (platform == "cpu")


def test_query_dtype_fp8_skips_state_layers():
    """Kimi-Linear: MLA layers take the e4m3 query, the linear-attention (state) layers have no query."""
    p = cuda_plan("kimi-linear-48b-a3b", 2, kv_cache_dtype="fp8", query_dtype="fp8")  # 16 heads per rank
    kinds = {(layer.kind, layer.query_dtype) for layer in p.layers}
    assert kinds == {("mla", "fp8_e4m3"), ("state", "bfloat16")}


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
    with pytest.raises(ConfigError, match="--query-dtype must be one of auto, model, fp8, got 'e4m3'"):
        CacheConfig(kv_cache_dtype="fp8", query_dtype="e4m3")


@pytest.mark.parametrize("kv,needle", [
    ("bf16", "KV cache is bfloat16 (not quantized)"),
    ("fp8", "torch_mla_reference does not declare a quantized query for fp8_e4m3 KV"),
])
def test_engine_with_query_dtype_fp8_it_cannot_plan_fails_before_weights(tmp_path, monkeypatch, kv, needle):
    """``--query-dtype fp8`` over a bf16 cache, or on a backend that does not declare the fp8 query (the CPU
    MLA reference), stops the engine in the planner; the weights (a directory here) are never opened."""
    import json

    from kvforge import LLM

    cfg = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               q_lora_rank=None, vocab_size=256, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").mkdir()  # opening it as a file would raise IsADirectoryError

    def boom(*args, **kwargs):
        raise AssertionError("weights were opened before the plan was validated")

    monkeypatch.setattr("kvforge.weights.load_weights", boom)
    with pytest.raises(PlanError, match="--query-dtype fp8: these layers cannot take") as err:
        LLM(str(tmp_path), kv_cache_dtype=kv, query_dtype="fp8", progress=False, device="cpu",
            skip_tokenizer_init=True)
    assert needle in str(err.value)
