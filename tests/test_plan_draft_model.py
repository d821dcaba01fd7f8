"""A draft model in the plan: its layers in the target's groups and pool and the capacity they cost, checked
against bytes computed by hand from the configs; and the draft checks made before any weight."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvforge.cli import main
from kvforge.errors import ConfigError, PlanError
from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.proposer_layers import ProposerLayers
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

# A 2-layer Llama of Llama-3.1-8B's vocabulary and KV geometry (8 KV heads of 128): its layers join the
# target's full-attention group.
SMALL_DRAFT = dict(PRESETS["llama-3.1-8b"], hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=8, intermediate_size=512, head_dim=128)
L, BLOCK, MEMORY = 8192, 16, 6 * 10**9
PAGE = BLOCK * 8 * (128 + 128) * 2  # one layer's page of 16 tokens: 8 KV heads x (K 128 + V 128) bf16


def spec(config, name):
    return spec_from_hf_config(dict(config), name=name, source="test")


@pytest.mark.parametrize("kv, elem", [("auto", 2), ("fp8", 1)])
def test_draft_layers_join_the_target_group(kv, elem):
    page = PAGE * elem // 2
    per_seq = (L // BLOCK) * (32 + 2) * page  # every block id spans 32 target + 2 draft page slots
    alone_per_seq = (L // BLOCK) * 32 * page
    cache = CacheConfig(kv_cache_dtype=kv, max_model_len=L, kv_cache_memory=MEMORY)
    alone = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), cache)
    plan = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), cache, draft_spec=spec(SMALL_DRAFT, "small"))
    assert [(g.layers, g.draft_layers) for g in plan.groups] == [(tuple(range(32)), (0, 1))]
    assert plan.group_size == 34 and plan.padding_layers == 0 and plan.groups[0].page_bytes == page
    assert plan.capacity.bytes_per_sequence == per_seq
    assert plan.num_blocks == MEMORY // (34 * page)
    assert plan.capacity_tokens == plan.num_blocks * BLOCK
    assert plan.max_concurrency == pytest.approx(MEMORY / per_seq, rel=1e-4)
    # Without the draft: the target's plan alone, from the same memory.
    assert plan.draft.capacity_without == alone.capacity
    assert alone.capacity.bytes_per_sequence == alone_per_seq and alone.num_blocks == MEMORY // (32 * page)
    assert plan.draft.bytes_per_token == 2 * 8 * 256 * elem and plan.bytes_per_token == 32 * 8 * 256 * elem
    assert [x.index for x in plan.draft.layers] == [0, 1] and plan.draft.layers[0].kv_dtype == plan.kv_cache_dtype
    text = plan.summary()
    assert "draft small: layers 0, 1 join group 0 (full, target layers 0..31 (32))" in text
    assert f"takes {per_seq:,} bytes (without the draft {alone_per_seq:,})" in text
    if kv == "fp8":  # the model-dtype baseline carries the draft too: the gain is like for like
        assert plan.baseline.bytes_per_sequence == 2 * per_seq


def test_draft_layers_of_their_own_layout_form_groups_of_the_pool_page():
    # Sliding-window draft layers of the target's KV geometry: a type of their own, with the pool's page. Group
    # sizes between 2 and 32 for types of 32 and 2 layers: 2 wastes no slot (16 full groups + 1 sliding).
    draft = dict(SMALL_DRAFT, sliding_window=1024, layer_types=["sliding_attention"] * 2)
    plan = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"),
                   CacheConfig(max_model_len=L, kv_cache_memory=MEMORY), draft_spec=spec(draft, "small"))
    assert plan.group_size == 2 and len(plan.groups) == 17
    own = plan.groups[-1]
    assert (own.kind, own.layers, own.draft_layers, own.sliding_window) == ("sliding", (), (0, 1), 1024)
    assert all(g.page_bytes == PAGE and g.block_size == BLOCK for g in plan.groups)
    window_blocks = -(-(1024 - 1) // BLOCK) + 1  # ceil((window + 1 - 2) / block) + 1 blocks at a decode step
    per_seq = (16 * (L // BLOCK) + window_blocks) * 2 * PAGE
    assert plan.capacity.bytes_per_sequence == per_seq
    assert plan.num_blocks == MEMORY // (2 * PAGE)
    assert "layers 0, 1 form group 16 (sliding) of their own" in plan.summary()


def test_draft_layers_of_a_fraction_of_the_page_share_page_slots():
    # A Llama-3.2-1B-like draft: 16 layers of 8 KV heads of 64, a page of 16 x 8 x 128 x 2 = 32768 bytes, half
    # the pool's: two layers per page slot, 8 slots. Group sizes between 8 and 32 for types of 32 and 8 slots:
    # 8 wastes none (4 target groups + 1 draft group).
    draft = dict(SMALL_DRAFT, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64)
    plan = resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"),
                   CacheConfig(max_model_len=L, kv_cache_memory=MEMORY), draft_spec=spec(draft, "small"))
    assert plan.group_size == 8 and len(plan.groups) == 5 and plan.padding_layers == 0
    own = plan.groups[-1]
    assert (own.layers, own.draft_layers, own.draft_layers_per_slot) == ((), tuple(range(16)), 2)
    assert all(g.page_bytes == g.page_bytes_unpadded == PAGE and g.block_size == BLOCK for g in plan.groups)
    per_seq = (L // BLOCK) * (32 + 8) * PAGE  # 32 target slots + 16 draft layers in 8 slots
    assert plan.capacity.bytes_per_sequence == per_seq
    assert plan.num_blocks == MEMORY // (8 * PAGE)
    assert plan.draft.bytes_per_token == 16 * 8 * 128 * 2
    assert "layers 0..15 (16) form group 4 (full, 2 per page slot) of their own" in plan.summary()


@pytest.mark.parametrize("over, page", [
    (dict(num_key_value_heads=8, num_attention_heads=8, head_dim=256), 131072),  # twice the pool's page
    (dict(num_key_value_heads=3, num_attention_heads=6, head_dim=128), 24576),  # not a whole fraction
])
def test_a_draft_page_that_does_not_fit_the_pool_page_is_refused(over, page):
    with pytest.raises(PlanError) as e:
        resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), CacheConfig(max_model_len=L),
                draft_spec=spec(dict(SMALL_DRAFT, **over), "small"))
    text = str(e.value)
    assert "draft model small: layers 0, 1" in text and f"is {page} bytes" in text and "65536 bytes" in text
    assert "fix: use a draft whose attention layers have the target's KV heads x head size" in text


def test_mla_draft_layer_joins_the_target_mla_group():
    target = spec(PRESETS["deepseek-v3"], "deepseek-v3")
    row = (512 + 64) * 2  # one latent row per token: kv_lora_rank + qk_rope_head_dim, bf16
    plan = resolve(target, CacheConfig(max_model_len=4096, kv_cache_memory=10**9),
                   draft_spec=spec(dict(PRESETS["deepseek-v3"], num_hidden_layers=1), "mla-draft"))
    assert [(g.kind, g.layers, g.draft_layers) for g in plan.groups] == [("mla", tuple(range(61)), (0,))]
    assert plan.num_blocks == 10**9 // (62 * 16 * row)
    assert plan.capacity.bytes_per_sequence == (4096 // 16) * 62 * 16 * row


def test_extra_proposer_layers_join_by_the_same_rule():
    # An extra MLA layer of the target's own checkpoint (an MTP layer): no weights beyond the target's count.
    target = spec(PRESETS["deepseek-v3"], "deepseek-v3")
    mtp = ProposerLayers("mtp", "DeepseekV3", (replace(target.layers[0], index=61),), 0)
    cache = CacheConfig(max_model_len=4096, gpu_memory=8 * 10**12)
    plan = resolve(target, cache, proposer_layers=mtp)
    alone = resolve(target, cache)
    assert plan.groups[0].draft_layers == (61,) and plan.group_size == 62
    assert plan.capacity.kv_cache_memory == alone.capacity.kv_cache_memory  # no weights of its own
    assert plan.draft.capacity_without == alone.capacity


def test_gpu_memory_pays_the_draft_weights():
    cache = CacheConfig(max_model_len=8192, gpu_memory=80 * 2**30, gpu_memory_utilization=0.9)
    target = spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b")
    alone = resolve(target, cache)
    plan = resolve(target, cache, draft_spec=spec(SMALL_DRAFT, "small"))
    draft_params = spec(SMALL_DRAFT, "small").num_parameters
    assert plan.draft.weights_bytes_per_rank == draft_params * 2
    assert plan.capacity.kv_cache_memory == alone.capacity.kv_cache_memory - draft_params * 2
    assert plan.draft.capacity_without == alone.capacity


def test_plan_cli_shows_the_draft_groups(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_DRAFT))
    cfg = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    assert main(["plan", "llama-3.1-8b", "--device", "cuda", "--max-model-len", "8192", "--kv-cache-memory",
                 "6000000000", "--speculative-config", cfg]) == 0
    out = capsys.readouterr().out
    assert "draft layers" in out and "speculative draft" in out and "capacity with the draft" in out
    assert main(["plan", "llama-3.1-8b", "--device", "cuda", "--max-model-len", "8192", "--kv-cache-memory",
                 "6000000000", "--json", "--speculative-config", cfg]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["groups"][0]["draft_layers"] == [0, 1]
    assert d["bytes_per_sequence"] == 512 * 34 * PAGE
    assert d["draft"]["capacity_without"]["bytes_per_sequence"] == 512 * 32 * PAGE
    assert d["num_blocks"] == MEMORY // (34 * PAGE)
    assert d["draft"]["capacity_without"]["num_blocks"] == MEMORY // (32 * PAGE)


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
    qwen3_next = spec(dict(PRESETS["qwen3-next-80b-a3b"], num_hidden_layers=4), "qwen3-next")
    with pytest.raises(ConfigError, match="the draft model qwen3-next keeps linear-attention state"):
        resolve(spec(PRESETS["qwen3-8b"], "qwen3-8b"), CacheConfig(max_model_len=4096), draft_spec=qwen3_next)


def test_a_draft_plan_error_names_the_draft():
    # 3 KV heads cannot be split over 2 ranks nor replicated: the draft's own plan fails, and says whose.
    with pytest.raises(PlanError, match="draft model small: --tensor-parallel-size 2 and num_key_value_heads 3"):
        resolve(spec(PRESETS["llama-3.1-8b"], "llama-3.1-8b"), CacheConfig(max_model_len=8192), ParallelConfig(2),
                draft_spec=spec(dict(SMALL_DRAFT, num_attention_heads=6, num_key_value_heads=3), "small"))


def test_a_missing_draft_model_is_named_as_the_speculative_configs(tmp_path, capsys):
    from kvforge import LLM
    from kvforge.planner.api import plan

    missing = str(tmp_path / "no-draft")
    says = f"the draft model (--speculative-config's \"model\", '{missing}'): model '{missing}' is neither"
    with pytest.raises(ConfigError) as err:
        plan("llama-3.1-8b", draft_model=missing)
    assert says in str(err.value)
    with pytest.raises(ConfigError) as err:  # the engine: before any weight is read
        LLM(load_format="dummy", device="cpu", speculative_config={"method": "draft_model", "model": missing,
                                                                   "num_speculative_tokens": 2})
    assert says in str(err.value)
    assert main(["plan", "--speculative-config", json.dumps({"method": "draft_model", "model": missing,
                                                             "num_speculative_tokens": 2})]) == 2
    assert says in capsys.readouterr().err
