"""Architecture name -> model class, and ``build_model``."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.csa_ring import CsaRingTestForCausalLM
from kvforge.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.gpt_oss import GptOssForCausalLM
from kvforge.models.kimi_linear import KimiLinearForCausalLM
from kvforge.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from kvforge.models.qwen3_next import Qwen3NextForCausalLM
from kvforge.spec.architectures import text_model_config

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "CsaRingTestForCausalLM": CsaRingTestForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}

# config.json files without "architectures" still carry model_type.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: dict) -> str:
    """The architecture name this config asks for; ConfigError listing the supported ones if unknown.

    A multimodal wrapper resolves to its text architecture (see ``text_model_config``).
    """
    hf_config = text_model_config(hf_config)
    archs = hf_config.get("architectures") or []
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config["model_type"]]]
    for a in archs:
        if a in _MODELS:
            return a
    asked = archs or [hf_config.get("model_type")]
    raise ConfigError(
        f"model architecture {', '.join(map(str, asked))} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )


def get_model_class(hf_config: dict) -> type[nn.Module]:
    return _MODELS[resolve_architecture(hf_config)]


def build_model(hf_config: dict, dtype: torch.dtype, device, with_mtp: bool = False) -> nn.Module:
    """Instantiate the model with uninitialised parameters of ``dtype`` on ``device``.

    No random init is run (that is slow for big models); call
    ``kvforge.weights.load_weights`` next, which fills every parameter. ``with_mtp``: also the
    checkpoint's multi-token-prediction layer (DeepSeek-V3, speculative method mtp).
    """
    arch = resolve_architecture(hf_config)
    config = dict(text_model_config(hf_config))
    config["architectures"] = [arch]
    with torch.device("meta"):
        model = _MODELS[arch](config, dtype=dtype, **({"with_mtp": True} if with_mtp else {}))
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    return model.eval()
