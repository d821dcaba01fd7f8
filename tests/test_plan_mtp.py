"""Speculative method mtp in the plan: the checkpoint's MTP layer is the plan's proposer layer, placed in
the target's MLA group after the target's layers (same block tables), counted in bytes per token,
capacity and weights, and shown by the plan."""

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
