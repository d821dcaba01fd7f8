"""A draft model in the plan: its groups, its share of the KV memory and the concurrency it costs, checked
against bytes computed by hand from the configs; and the draft checks made before any weight."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.errors import ConfigError, PlanError
from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

# A 2-layer Llama of Llama-3.1-8B's vocabulary: 4 KV heads of 64, so 2 x 4 x (64 + 64) elements per token.
SMALL_DRAFT = dict(PRESETS["llama-3.1-8b"], hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=512, head_dim=64)


def spec(config, name):
    return spec_from_hf_config(dict(config), name=name, source="test")


@pytest.mark.parametrize("kv, elem", [("auto", 2), ("fp8", 1)])
def test_draft_groups_and_capacity(kv, elem):
    L, block, memory = 8192, 16, 6 * 10**9
    target_per_seq = (L // block) * block * 32 * 8 * (128 + 128) * elem  # 32 layers, 8 KV heads of 128
    draft_per_seq = (L // block) * block * 2 * 4 * (64 + 64) * elem
    cache = CacheConfig(kv_cache_dtype=kv, max_model_len=L, kv_cache_memory=memory)
    alone = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), cache)
    plan = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), cache, draft_spec=spec(SMALL_DRAFT, "small"))
    assert alone.capacity.bytes_per_sequence == target_per_seq
    assert plan.capacity.bytes_per_sequence == target_per_seq
    assert plan.draft.capacity.bytes_per_sequence == draft_per_seq
    assert [g.layers for g in plan.draft.groups] == [(0, 1)] and plan.draft.groups[0].kind == "full"
    # The memory splits so both pools hold the same number of full-length sequences.
    assert plan.capacity.kv_cache_memory + plan.draft.capacity.kv_cache_memory == memory
    expected = memory / (target_per_seq + draft_per_seq)
    assert plan.max_concurrency == pytest.approx(expected, rel=1e-4)
    assert plan.draft.max_concurrency == pytest.approx(expected, rel=1e-4)
    assert alone.max_concurrency == pytest.approx(memory / target_per_seq, rel=1e-4)
    assert plan.num_blocks == plan.capacity.kv_cache_memory // (32 * block * 8 * 256 * elem)
    assert plan.draft.num_blocks == plan.draft.capacity.kv_cache_memory // (2 * block * 4 * 128 * elem)
    text = plan.summary()
    assert "draft small" in text and f"{draft_per_seq:,} bytes per sequence" in text
    assert f"without the draft {memory / target_per_seq:.2f}" in text
    if kv == "fp8":  # the model-dtype baseline carries the draft too: the gain is like for like
        assert plan.baseline.bytes_per_sequence == 2 * target_per_seq


def test_gpu_memory_pays_the_draft_weights():
    cache = CacheConfig(max_model_len=8192, gpu_memory=80 * 2**30, gpu_memory_utilization=0.9)
    target = spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b")
    alone = resolve(target, cache)
    plan = resolve(target, cache, draft_spec=spec(SMALL_DRAFT, "small"))
    total = plan.capacity.kv_cache_memory + plan.draft.capacity.kv_cache_memory
    assert total == alone.capacity.kv_cache_memory - plan.draft.weights_bytes_per_rank


def test_plan_cli_shows_the_draft_groups(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_DRAFT))
    cfg = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert main(["plan", "llama-3.1-8b", "--max-model-len", "8192", "--kv-cache-memory", "6000000000",
                 "--speculative-config", cfg]) == 0
    out = capsys.readouterr().out
    assert "draft:full" in out and "speculative draft" in out
    assert main(["plan", "llama-3.1-8b", "--max-model-len", "8192", "--kv-cache-memory", "6000000000", "--json",
                 "--speculative-config", cfg]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["draft"]["groups"][0]["layers"] == [0, 1]
    assert d["draft"]["bytes_per_sequence"] == 512 * 16 * 2 * 4 * 128 * 2


@pytest.mark.parametrize("over, message", [
    (dict(vocab_size=32000), "vocabulary of 32000 tokens but the target llama-3.1-8b has 128256"),
    (dict(bos_token_id=1), "bos_token_id 1 but the target llama-3.1-8b has 128000"),
    (dict(max_position_embeddings=4096), "max_position_embeddings 4096, below --max-model-len 8192"),
])
def test_bad_draft_is_refused(over, message):
    with pytest.raises(ConfigError) as e:
        resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), CacheConfig(max_model_len=8192),
                draft_spec=spec(dict(SMALL_DRAFT, **over), "small"))
    assert message in str(e.value)


def test_linear_attention_draft_is_refused():
    target = spec(dict(PRESETS["qwen3-next-80b-a3b"], num_hidden_layers=4), "qwen3-next")
    draft = spec(PRESETS["qwen3-next-80b-a3b"], "qwen3-next-draft")
    with pytest.raises(ConfigError, match="keeps linear-attention state"):
        resolve(target, CacheConfig(max_model_len=4096), draft_spec=draft)


def test_a_draft_plan_error_names_the_draft():
    # 3 KV heads cannot be split over 2 ranks nor replicated: the draft's own plan fails, and says whose.
    with pytest.raises(PlanError, match="draft model small: --tensor-parallel-size 2 and num_key_value_heads 3"):
        resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), CacheConfig(max_model_len=8192), ParallelConfig(2),
                draft_spec=spec(dict(SMALL_DRAFT, num_attention_heads=6, num_key_value_heads=3), "small"))
