"""Speculative method mtp in the plan: the checkpoint's MTP layer is one more layer of the target's MLA
group (same block tables), counted in bytes per token, capacity and weights, and shown by the plan."""

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
    assert alone.mtp_layers == () and with_mtp.mtp_layers == (61,)
    assert [layer.index for layer in with_mtp.layers] == list(range(62))
    assert with_mtp.layers[61].kind == "mla" and with_mtp.layers[61].backend == with_mtp.layers[0].backend
    assert len(with_mtp.groups) == 1 and with_mtp.groups[0].layers == tuple(range(62))
    assert with_mtp.bytes_per_token == 62 * 576 and alone.bytes_per_token == 61 * 576
    # The same memory holds 61/62 of the tokens (block counts round down).
    assert with_mtp.capacity_tokens <= alone.capacity_tokens * 61 / 62 < with_mtp.capacity_tokens + 64
    # The MTP layer's weights: a MoE decoder layer plus embedding, head, eh_proj and three norms.
    h, v = 7168, 129280
    assert with_mtp.num_parameters - alone.num_parameters > 2 * v * h + 2 * h * h
    text = with_mtp.summary()
    assert "MTP layer 61 (speculative method mtp) in group 0" in text and "0.9839x" in text


def test_kvforge_plan_cli_shows_the_mtp_layer(capsys):
    assert main(["plan", "deepseek-v3", "--kv-cache-memory", str(1 << 34), "--json", "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mtp_layers"] == [61] and data["num_speculative_tokens"] == 2
    assert data["bytes_per_token"] == 62 * 576 * 2


def test_plan_without_an_mtp_layer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["kimi-k2"], "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers > 0"):
        plan(str(tmp_path), mtp=True)
