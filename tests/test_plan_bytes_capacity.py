"""Exact bytes per token and capacity, hand-computed from published configs."""

import pytest

from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS


def spec(name, **over):
    return spec_from_hf_config(dict(PRESETS[name], **over), name=name, source="test")


def plan(name, kv="auto", tp=1, **cache):
    over = cache.pop("config", {})
    return resolve(spec(name, **over), CacheConfig(kv_cache_dtype=kv, **cache), ParallelConfig(tp))


# Llama-3.1-8B: 32 layers x 8 KV heads x (128 K + 128 V) elements per token.
@pytest.mark.parametrize("tp,kv,expected", [
    (1, "bf16", 32 * 8 * 256 * 2),   # 131072
    (2, "bf16", 32 * 4 * 256 * 2),   # 65536
    (8, "bf16", 32 * 1 * 256 * 2),   # 16384
    (1, "fp8", 32 * 8 * 256 * 1),    # 65536
    (2, "fp8", 32 * 4 * 256 * 1),
    (8, "fp8", 32 * 1 * 256 * 1),    # 8192
])
def test_llama31_8b_bytes_per_token(tp, kv, expected):
    p = plan("llama-3.1-8b", kv, tp)
    assert p.bytes_per_token == expected
    assert all(layer.bytes_per_token == expected // 32 for layer in p.layers)
    assert p.state_bytes_per_sequence == 0


def test_fewer_kv_heads_than_ranks_replicates_one_head():
    # csa-ring-test: 4 KV heads, head 192; at TP8 every rank holds 1 replicated head.
    p = plan("csa-ring-test", "bf16", 8)
    assert {layer.kv_heads_per_rank for layer in p.layers} == {1}
    assert p.bytes_per_token == 4 * 1 * (192 + 192) * 2  # 3072
    assert any("replicated" in w for w in p.warnings)
    # Llama-3.1-8B (8 KV heads) at TP 16 would replicate too, but 32 heads / 16 = 2 per rank.
    p16 = plan("llama-3.1-8b", "bf16", 16)
    assert p16.layers[0].kv_heads_per_rank == 1 and p16.bytes_per_token == 32 * 256 * 2


def test_block_size_above_max_model_len_warns_with_the_idle_share():
    """A block longer than any sequence can never fill: the plan says how much of each block stays empty.
    The default block size under a short max_model_len is not the user's choice and draws no warning."""
    p = plan("llama-3.1-8b", "bf16", block_size=1024, max_model_len=256)
    hits = [w for w in p.warnings if "--block-size 1024 exceeds max model len 256" in w]
    assert len(hits) == 1 and "75.0% of every block stays empty" in hits[0]
    assert not any("exceeds max model len" in w for w in plan("llama-3.1-8b", "bf16", block_size=256,
                                                                max_model_len=256).warnings)
    assert not any("exceeds max model len" in w for w in plan("llama-3.1-8b", "bf16", max_model_len=8).warnings)


@pytest.mark.parametrize("tp", [1, 8])
def test_deepseek_v3_mla_same_on_every_rank(tp):
    # 61 MLA layers x (512 latent + 64 rope); latent replicated: TP does not divide it.
    assert plan("deepseek-v3", "bf16", tp).bytes_per_token == 61 * 576 * 2  # 70272
    assert plan("deepseek-v3", "fp8", tp).bytes_per_token == 61 * 576  # 35136


def test_llama_capacity_exact():
    mem = 8 * 2**30
    p = plan("llama-3.1-8b", "fp8", 1, kv_cache_memory=mem, max_model_len=8192)
    block_bytes = 32 * 16 * 8 * 256  # 32 layers x one 16-token fp8 page
    assert p.num_blocks == mem // block_bytes == 8192
    assert p.capacity_tokens == 8192 * 16
    assert p.max_concurrency == pytest.approx(mem / (8192 // 16 * block_bytes))
    assert p.baseline.capacity_tokens == (mem // (2 * block_bytes)) * 16
    assert p.to_dict()["capacity_gain_vs_baseline"] == 2.0


@pytest.mark.parametrize("state_dtype,elem", [("auto", 4), ("model", 2)])
def test_hybrid_linear_attention_gain_below_2x_exact(state_dtype, elem):
    """The state is float32 by default (2 bytes with --state-dtype model for this bf16 model), never fp8:
    fp8 halves only the full layers' bytes, so the gain is the exact ratio of bytes per sequence."""
    L = 4096
    mem = 40 * 2**30
    p8 = plan("qwen3-next-80b-a3b", "fp8", 1, kv_cache_memory=mem, max_model_len=L, state_dtype=state_dtype)
    p16 = plan("qwen3-next-80b-a3b", "bf16", 1, kv_cache_memory=mem, max_model_len=L, state_dtype=state_dtype)
    # 12 full layers (every 4th of 48) x 2 KV heads x (256 + 256) elements per token
    b16 = 12 * 2 * 512 * 2
    assert p16.bytes_per_token == b16 == 24576 and p8.bytes_per_token == b16 // 2
    # 36 Gated-DeltaNet layers; state = 32 x 128 x 128 + (4 - 1) x (2 x 16 x 128 + 32 x 128) elements
    state = 36 * (32 * 128 * 128 + 3 * (2 * 2048 + 4096)) * elem
    assert p8.state_bytes_per_sequence == p16.state_bytes_per_sequence == state == 19759104 * elem
    assert {x.kv_dtype for x in p8.layers if x.kind == "state"} == {"float32" if elem == 4 else "bfloat16"}
    assert p8.state_dtype == ("float32" if elem == 4 else "bfloat16") and "--state-dtype" in p8.state_dtype_reason
    exact = (state + L * b16) / (state + L * b16 / 2)  # 1.3891... (float32 state), 1.5602... (bf16 state)
    assert p8.max_concurrency / p16.max_concurrency == pytest.approx(exact, rel=1e-6)
    assert p8.concurrency_gain() == exact  # the same two integers divided (max_model_len fills whole blocks)
    assert f"= {exact:.4f}x" in p8.summary() and p8.to_dict()["concurrency_gain_vs_baseline"] == exact
    assert exact < 2
    gain = p8.capacity_tokens / p16.capacity_tokens
    assert gain == pytest.approx(exact, rel=0.02) and gain < 1.6
    assert p8.baseline.capacity_tokens == p16.capacity_tokens


def test_weights_per_rank_and_fit():
    p = plan("llama-3.1-8b", "bf16", 2)
    assert p.num_parameters == pytest.approx(8.03e9, rel=0.01)
    assert p.weights_bytes_per_rank == -(-p.num_parameters * 2 // 2)
    from kvforge.errors import PlanError

    with pytest.raises(PlanError, match="weights need .* GiB per rank"):
        plan("llama-3.1-70b", "bf16", 1, gpu_memory=141 * 10**9)
    ok = plan("llama-3.1-70b", "fp8", 2, gpu_memory=141 * 10**9, max_model_len=8192)
    # The device's usable memory less the weights and the activations of one step (exact: integer bytes).
    assert ok.capacity.kv_cache_memory == int(141e9 * 0.9) - ok.weights_bytes_per_rank - ok.activations.bytes


def test_too_little_memory_names_a_fix_that_can_work():
    """Memory for half a sequence: the fix offers a shorter --max-model-len (half of it) or the bytes one
    sequence needs. Memory for a few tokens: a max-model-len of a handful of tokens is no fix, so only the
    memory is named."""
    from kvforge.errors import PlanError
    from kvforge.planner.api import plan

    need = plan("llama-3.1-8b", max_model_len=4096, kv_cache_memory=1 << 40).capacity.bytes_per_sequence
    with pytest.raises(PlanError, match=r"lower --max-model-len to at most 2048 or give at least "
                                        rf"{need} bytes per rank"):
        plan("llama-3.1-8b", max_model_len=4096, kv_cache_memory=need // 2)
    with pytest.raises(PlanError, match=rf"fix: give at least {need} bytes per rank") as err:
        plan("llama-3.1-8b", max_model_len=4096, kv_cache_memory=1024)
    assert "lower --max-model-len" not in str(err.value)


@pytest.mark.parametrize("model, memory", [("llama-3.1-8b", 256 << 20), ("gemma-3-1b", 40 * 10**6),
                                           ("gemma-3-1b", 300 * 10**6), ("gpt-oss-20b", 300 * 10**6),
                                           ("qwen3-next-80b-a3b", 300 * 10**6)])
def test_the_suggested_max_model_len_is_the_longest_that_plans(model, memory):
    """The fix's --max-model-len plans at that memory and one token more does not (sliding windows and a
    prefill chunk's extra window blocks included: a length scaled by the memory's share overshot)."""
    import re

    from kvforge.errors import PlanError
    from kvforge.planner.api import plan

    with pytest.raises(PlanError) as err:
        plan(model, device="cuda", kv_cache_memory=memory)
    longest = int(re.search(r"lower --max-model-len to at most (\d+)", str(err.value)).group(1))
    assert plan(model, device="cuda", kv_cache_memory=memory, max_model_len=longest).capacity.max_concurrency >= 1
    with pytest.raises(PlanError):
        plan(model, device="cuda", kv_cache_memory=memory, max_model_len=longest + 1)
