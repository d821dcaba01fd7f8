"""Tiny random checkpoints written by transformers, shared by the model, engine, TP and roofline tests.

Gemma 3 and gpt-oss (sliding window 16, vocabulary 256) and Qwen3-Next and Kimi-Linear (linear attention,
vocabulary 128). Weights are drawn away from transformers' defaults so each of them changes the logits:
norms, biases, sinks, experts (hybrid cases, ``_hybrid_init``); norms, conv kernels, router biases
(linear-attention cases, ``_linear_init``; the decay parameters keep transformers' init, the range trained
models have).
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
LINEAR_VOCAB = 128
QWEN3_NEXT = dict(
    vocab_size=LINEAR_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
KIMI_LINEAR = dict(
    vocab_size=LINEAR_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, linear_head_dim=16, linear_num_heads=4,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
)


def _hybrid_init(case: str, name: str) -> tuple[float, float] | None:
    """(offset, std) of parameter ``name`` of a Gemma 3 or gpt-oss checkpoint: default init leaves norms at
    0/1 and biases and sinks at 0, so they are randomised to count."""
    if "norm" in name:
        return (0.0 if case == "gemma3" else 1.0), 0.2
    if name.endswith("sinks"):
        return 0.0, 1.0
    if name.endswith("bias"):
        return 0.0, 0.1
    if ".experts." in name:
        return 0.0, 0.3  # large enough that gpt-oss's SwiGLU clamp at 7 is reached
    return 0.0, 0.08


def _linear_init(case: str, name: str) -> tuple[float, float] | None:
    """(offset, std) of parameter ``name`` of a Qwen3-Next or Kimi-Linear checkpoint, None: transformers' init
    (the decay parameters ``A_log`` and ``dt_bias`` keep the range trained models have)."""
    if "A_log" in name or "dt_bias" in name:
        return None
    if name.endswith("norm.weight") and case == "qwen3-next" and "linear_attn.norm" not in name:
        return 0.0, 0.2  # zero-centred: x * (1 + w)
    if "norm" in name:
        return 1.0, 0.2
    if "conv1d" in name:
        return 0.0, 0.4
    if "e_score_correction_bias" in name:
        return 0.0, 0.1
    return 0.0, 0.08


#: case: (transformers config class, model class, config, parameter init).
CASES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3, _hybrid_init),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS, _hybrid_init),
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT, _linear_init),
    "kimi-linear": ("KimiLinearConfig", "KimiLinearForCausalLM", KIMI_LINEAR, _linear_init),
}
HYBRID_CASES = ("gemma3", "gpt-oss")
LINEAR_ATTENTION_CASES = ("qwen3-next", "kimi-linear")


def randomize_dense_parameters(model) -> None:
    """Draw a dense transformers model's weights away from the default init, which leaves norms at 1 and
    biases at 0, so that norms and biases change the logits too: norms 1 + 0.2 N(0, 1), biases 0.1 N(0, 1),
    the rest 0.08 N(0, 1) (from torch's global generator: seed it first)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))


def make_checkpoint(case: str, path, **overrides):
    """A random transformers model of ``case`` saved at ``path``: (hf model, saved config dict)."""
    config_cls, model_cls, base, init = CASES[case]
    config = getattr(transformers, config_cls)(**{**base, **overrides})
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            rule = init(case, name)
            if rule is not None:
                offset, std = rule
                p.copy_(offset + std * torch.randn_like(p))
        for name, b in model.named_buffers():  # a buffer in some transformers versions
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    with open(path / "config.json") as f:
        return model, json.load(f)


def load_ours(path):
    """Our model of the checkpoint at ``path``, float32 on CPU."""
    ours = build_model(load_config(path), torch.float32, "cpu")
    load_weights(ours, path, "auto", progress=False)
    return ours
