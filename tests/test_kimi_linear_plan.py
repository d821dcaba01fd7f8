"""The Kimi-Linear spec and plan: KDA state layers plus MLA latent layers, hand-computed from the preset."""

import pytest

from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

NAME = "kimi-linear-48b-a3b"


def plan(kv, **cache):
    spec = spec_from_hf_config(dict(PRESETS[NAME]), name=NAME, source="test")
    return resolve(spec, CacheConfig(kv_cache_dtype=kv, **cache), ParallelConfig(1))


def test_layers_follow_the_one_indexed_full_attention_list():
    p = plan("bf16")
    mla = [x.index for x in p.layers if x.kind == "mla"]
    assert mla == [3, 7, 11, 15, 19, 23, 26]  # full_attn_layers [4, 8, ..., 24, 27] counted from 1
    assert sum(x.kind == "state" for x in p.layers) == 20


@pytest.mark.parametrize("state_dtype,elem", [("auto", 4), ("model", 2)])
def test_fp8_latent_cache_gain_below_2x_exact(state_dtype, elem):
    L, mem = 32768, 40 * 2**30
    p8 = plan("fp8", kv_cache_memory=mem, max_model_len=L, state_dtype=state_dtype)
    p16 = plan("bf16", kv_cache_memory=mem, max_model_len=L, state_dtype=state_dtype)
    # 7 MLA layers x (kv_lora_rank 512 + rope 64) elements per token
    b16 = 7 * 576 * 2
    assert p16.bytes_per_token == b16 and p8.bytes_per_token == b16 // 2
    # 20 KDA layers; state = 32 heads x 128 x 128 + (4 - 1) x 3 x 32 x 128 (conv history of q, k, v)
    state = 20 * (32 * 128 * 128 + 3 * 3 * 32 * 128) * elem
    assert p8.state_bytes_per_sequence == p16.state_bytes_per_sequence == state == 11223040 * elem
    exact = (state + L * b16) / (state + L * b16 / 2)
    assert p8.max_concurrency / p16.max_concurrency == pytest.approx(exact, rel=1e-6)
    assert p8.concurrency_gain() == exact  # the same two integers divided (max_model_len fills whole blocks)
    assert f"= {exact:.4f}x" in p8.summary() and p8.to_dict()["concurrency_gain_vs_baseline"] == exact
    assert 1 < exact < 2
    want = "float32" if elem == 4 else "bfloat16"
    assert all(x.kv_dtype == want for x in p8.layers if x.kind == "state")  # the state is not quantized


def test_a_quantized_state_dtype_is_refused_with_the_choices():
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--state-dtype must be one of auto, model, float32, .* never quantized"):
        plan("fp8", state_dtype="fp8_e4m3")
    p = plan("fp8", state_dtype="float16")
    assert p.state_dtype == "float16" and {x.kv_dtype for x in p.layers if x.kind == "state"} == {"float16"}
