"""Tiny random Gemma 3 and gpt-oss checkpoints written by transformers (shared by the model and TP tests).

Sliding window 16; norms, biases, sinks and experts randomised away from their
defaults so every one of them changes the logits.
"""

from __future__ import annotations

import json

import torch
import transformers

from kvforge.models.registry import build_model
from kvforge.weights import load_config, load_weights

WINDOW = 16
VOCAB = 256

GEMMA3 = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
    sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"],
    query_pre_attn_scalar=24, final_logit_softcapping=3.0,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
)
GPT_OSS = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5,
    sliding_window=WINDOW, num_local_experts=6, num_experts_per_tok=2,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
)
CASES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS),
}


def make_checkpoint(case: str, path, **overrides):
    """A random transformers model of ``case`` saved at ``path``: (hf model, saved config dict)."""
    config_cls, model_cls, base = CASES[case]
    config = getattr(transformers, config_cls)(**{**base, **overrides})
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # default init leaves norms at 0/1, biases and sinks at 0: randomise so they count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if case == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif ".experts." in name:
                p.copy_(0.3 * torch.randn_like(p))  # large enough that the SwiGLU clamp at 7 is reached
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    with open(path / "config.json") as f:
        return model, json.load(f)


def load_ours(path):
    ours = build_model(load_config(path), torch.float32, "cpu")
    load_weights(ours, path, "auto", progress=False)
    return ours


