"""Speculative method mtp in the plan: the checkpoint's MTP layer is the plan's proposer layer, placed in
the target's group of its page layout after the target's layers (same block tables: DeepSeek-V3's MLA
group, Qwen3-Next's full-attention group), counted in bytes per token, capacity and weights, and shown by
the plan."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.planner.api import plan
from kvforge.spec.presets import PRESETS


def test_deepseek_v3_plan_holds_the_mtp_layer_in_its_group():
    kw = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 34, max_model_len=8192)
    alone, with_mtp = plan("deepseek-v3", **kw), plan("deepseek-v3", mtp=True, **kw)
    assert alone.draft is None
    draft = with_mtp.draft
    assert draft.model == "deepseek-v3 MTP layer" and [layer.index for layer in draft.layers] == [61]
    assert draft.layers[0].kind == "mla" and draft.layers[0].backend == with_mtp.layers[0].backend
    assert len(with_mtp.groups) == 1 and with_mtp.groups[0].layers == tuple(range(61))
    assert with_mtp.groups[0].draft_layers == (61,)
    # One more latent row per token: 62 x 576 bytes (fp8) per sequence token instead of 61 x 576.
    assert draft.bytes_per_token == 576 and with_mtp.capacity.bytes_per_sequence == 62 * 576 * 8192
    assert draft.capacity_without == alone.capacity and alone.capacity.bytes_per_sequence == 61 * 576 * 8192
    assert with_mtp.capacity.num_blocks == (1 << 34) // (62 * 576 * 16)
    # The MTP layer's weights: a MoE decoder layer plus embedding, head, eh_proj and three norms.
    h, v = 7168, 129280
    assert draft.num_parameters > 2 * v * h + 2 * h * h
    assert "draft deepseek-v3 MTP layer: layer 61 joins group 0" in with_mtp.summary()
    # The summary names the layer's weights beside the target's (float32 on CPU: 4 bytes a parameter, one rank).
    assert with_mtp.model_dtype == "float32"
    assert f"weights {4 * draft.num_parameters / 2**30:.2f} GiB per rank" in with_mtp.summary()


def test_kvforge_plan_cli_shows_the_mtp_layer(capsys):
    assert main(["plan", "deepseek-v3", "--device", "cuda", "--kv-cache-memory", str(1 << 34), "--json", "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["index"] for layer in data["draft"]["layers"]] == [61] and data["num_speculative_tokens"] == 2
    assert data["groups"][0]["draft_layers"] == [61]


def test_plan_without_an_mtp_layer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["kimi-k2"], "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers > 0"):
        plan(str(tmp_path), mtp=True)


def test_qwen3_next_plan_holds_the_mtp_layer_in_its_full_attention_group():
    kw = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 34, max_model_len=8192, device="cuda")
    alone, with_mtp = plan("qwen3-next-80b-a3b", **kw), plan("qwen3-next-80b-a3b", mtp=True, **kw)
    draft = with_mtp.draft
    assert draft.model == "qwen3-next-80b-a3b MTP layer" and [layer.index for layer in draft.layers] == [48]
    assert draft.layers[0].kind == "full"
    (full,) = [g for g in with_mtp.groups if g.kind == "full"]
    assert full.layers == tuple(range(3, 48, 4)) and full.draft_layers == (48,)
    assert all(not g.draft_layers for g in with_mtp.groups if g.kind != "full")
    # One more layer of 2 KV heads x 256 x (K and V) fp8 bytes per token, beside the 12 full layers' and the
    # Gated DeltaNet state (per sequence, not per token).
    assert draft.bytes_per_token == 2 * 256 * 2 and with_mtp.bytes_per_token == alone.bytes_per_token
    assert with_mtp.capacity.bytes_per_sequence == alone.capacity.bytes_per_sequence + 1024 * 8192
    assert draft.capacity_without == alone.capacity
    assert with_mtp.capacity.num_blocks < alone.capacity.num_blocks
    # The MTP layer's weights: fc (2H x H), three norms and a gated-attention MoE layer; no embedding or head.
    h, heads, kv_heads, d, experts, inter = 2048, 16, 2, 256, 512, 512
    attention = h * 2 * heads * d + 2 * h * kv_heads * d + heads * d * h + 2 * d  # q with its gate, k, v, o, norms
    moe = experts * 3 * h * inter + 3 * h * inter + h * experts  # routed and shared experts, router
    want = 2 * h * h + 3 * h + attention + moe + 2 * h
    assert abs(draft.num_parameters - want) <= 1e-3 * want  # the shared expert's one-row gate may go uncounted
    assert "draft qwen3-next-80b-a3b MTP layer: layer 48 joins group" in with_mtp.summary()


def test_qwen3_next_without_an_mtp_layer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["qwen3-next-80b-a3b"], "mtp_num_hidden_layers": 0}))
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers > 0"):
        plan(str(tmp_path), mtp=True)


def test_mtp_with_embeddings_of_its_own_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["qwen3-next-80b-a3b"],
                                                      "mtp_use_dedicated_embeddings": True}))
    with pytest.raises(ConfigError, match="embeddings of its own"):
        plan(str(tmp_path), mtp=True)


@pytest.mark.parametrize("model,tp,heads,kv_heads", [("qwen3-next-80b-a3b", 2, 8, 1), ("deepseek-v3", 8, 16, 1)])
def test_the_mtp_layer_at_tensor_parallelism_takes_the_targets_heads_per_rank(model, tp, heads, kv_heads):
    """Qwen3-Next: 16 query heads and 2 KV heads over 2 ranks; DeepSeek-V3: 128 MLA heads over 8 ranks, one
    latent each (the configs' head counts, divided by hand)."""
    p = plan(model, mtp=True, tensor_parallel_size=tp, device="cuda")
    (layer,) = p.draft.layers
    assert (layer.heads_per_rank, layer.kv_heads_per_rank) == (heads, kv_heads)
    target = next(lp for lp in p.layers if lp.kind == layer.kind)
    assert (target.heads_per_rank, target.kv_heads_per_rank) == (heads, kv_heads)
