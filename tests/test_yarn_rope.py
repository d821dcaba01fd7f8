"""YaRN inverse frequencies and attention factor of DeepSeek and gpt-oss vs transformers' ``_compute_yarn_parameters``.

Exact equality: kvforge/models/yarn.py performs the same float32 tensor operations in the same order as
transformers (and the same float64 Python arithmetic for the ramp bounds and the factor), so every value is
bitwise identical. Factor 40 is DeepSeek-V3's setting, where a different order of the blend changes up to 14
of the 32 frequencies by one ulp.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from kvforge.models.deepseek import DeepseekArgs, DeepseekRotary  # noqa: E402
from kvforge.models.gpt_oss import GptOssArgs, GptOssRotaryEmbedding  # noqa: E402

DEEPSEEK_YARN = [
    dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
         beta_fast=32, beta_slow=1),
    dict(type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=0.8, original_max_position_embeddings=64,
         beta_fast=16, beta_slow=2),
    dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, attention_factor=1.25),
]


@pytest.mark.parametrize("rope_scaling", DEEPSEEK_YARN)
def test_deepseek_yarn_equals_transformers(rope_scaling):
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64,
                                        qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, rope_theta=10000.0,
                                        max_position_embeddings=163840, rope_scaling=dict(rope_scaling))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    rotary = DeepseekRotary(DeepseekArgs(cfg.to_dict()))
    assert rotary.inv_freq.shape == want_freq.shape == (32,)
    assert torch.equal(rotary.inv_freq, want_freq)
    assert rotary.attention_factor == want_factor


@pytest.mark.parametrize("factor", [32.0, 40.0])
def test_gpt_oss_yarn_equals_transformers(factor):
    cfg = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": factor,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 4096})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    a = GptOssArgs(cfg.to_dict())
    rotary = GptOssRotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling)
    assert rotary.inv_freq.shape == want_freq.shape == (32,)
    assert torch.equal(rotary.inv_freq, want_freq)
    assert rotary.attention_factor == want_factor
