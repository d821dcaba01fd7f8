"""Architecture name -> tensor-parallel model class, and ``build_tp_model`` (the TP counterpart of
kvforge/models/registry.py)."""

from __future__ import annotations

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_deepseek import DEEPSEEK_FAMILY, TPDeepseekForCausalLM
from kvforge.distributed.tp_hybrid import TPGemma3ForCausalLM, TPGptOssForCausalLM
from kvforge.distributed.tp_kimi_linear import TPKimiLinearForCausalLM
from kvforge.distributed.tp_llama import LLAMA_FAMILY, TPLlamaForCausalLM
from kvforge.distributed.tp_qwen3_next import TPQwen3NextForCausalLM
from kvforge.errors import ConfigError
from kvforge.models.decoder import build_uninitialised
from kvforge.models.registry import resolve_architecture
from kvforge.spec.architectures import text_model_config

TP_MODELS = {
    **{arch: TPLlamaForCausalLM for arch in LLAMA_FAMILY},
    **{arch: TPDeepseekForCausalLM for arch in DEEPSEEK_FAMILY},
    "Gemma3ForCausalLM": TPGemma3ForCausalLM,
    "GptOssForCausalLM": TPGptOssForCausalLM,
    "Qwen3NextForCausalLM": TPQwen3NextForCausalLM,
    "KimiLinearForCausalLM": TPKimiLinearForCausalLM,
}


def check_tp_architecture(hf_config: dict) -> str:
    """The architecture name, or ConfigError when it has no tensor-parallel implementation."""
    arch = resolve_architecture(hf_config)
    if arch not in TP_MODELS:
        raise ConfigError(f"--tensor-parallel-size > 1 runs the Llama family ({', '.join(LLAMA_FAMILY)}), "
                          f"DeepSeek-V2/V3, Gemma 3, gpt-oss, Qwen3-Next and Kimi-Linear; "
                          f"{arch} runs at TP 1 only (`kvforge plan` shows its per-rank figures for any TP)")
    return arch


def _rank_args(hf_config: dict, plan) -> tuple[str, dict, int, int]:
    """(architecture, text config, heads per rank, KV heads per rank) of the plan's TP model."""
    arch = check_tp_architecture(hf_config)
    heads = {(lp.heads_per_rank, lp.kv_heads_per_rank) for lp in plan.layers if lp.kind != "state"}
    if len(heads) != 1:
        raise ConfigError(f"the plan gives layers different heads per rank {sorted(heads)}; not supported at TP > 1")
    (hpr, kvpr), = heads
    config = dict(text_model_config(hf_config))
    config["architectures"] = [arch]
    return arch, config, hpr, kvpr


def check_tp_split(hf_config: dict, plan) -> None:
    """ConfigError when the plan's tensor-parallel size cannot split the model as its TP class does (experts,
    MLP sizes, linear-attention heads beside the plan's own head checks); builds nothing."""
    arch, config, hpr, kvpr = _rank_args(hf_config, plan)
    TP_MODELS[arch].check_split(config, plan.tensor_parallel_size, hpr, kvpr)


def build_tp_model(hf_config: dict, dtype: torch.dtype, device: torch.device, group: TPGroup, plan,
                   with_mtp: bool = False):
    """This rank's model with uninitialised parameters (fill with kvforge.weights.load_weights); ``with_mtp``:
    with the checkpoint's multi-token-prediction block (DeepSeek, Qwen3-Next), split like its layers."""
    arch, config, hpr, kvpr = _rank_args(hf_config, plan)
    extra = {"with_mtp": True} if with_mtp else {}
    return build_uninitialised(lambda: TP_MODELS[arch](config, dtype, group, hpr, kvpr, **extra), device)
