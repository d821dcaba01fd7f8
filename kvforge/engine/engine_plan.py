"""The engine's KV plan from its arguments alone (step 1 of ``LLMEngine``): config metadata only, no weight
file opened. ``kvforge generate`` plans the same way before loading to check its prompts against the plan's
max model len (``--max-model-len auto`` fits it to the memory)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.config import EngineArgs
from kvforge.errors import ConfigError
from kvforge.kv_dtypes import platform_model_dtype
from kvforge.planner.inputs import CacheConfig, ParallelConfig, resolve_kv_cache_memory
from kvforge.planner.kv_plan import KVPlan
from kvforge.planner.resolver import resolve
from kvforge.spec.load import load_draft_model_spec, load_model_spec
from kvforge.spec.model_spec import ModelSpec


@dataclass(frozen=True)
class EnginePlan:
    """What the engine plans before any weight: the model's spec, a draft model's (speculative decoding with a
    draft), the MTP layers planned beside the target's (None without MTP), the model dtype and the plan."""

    spec: ModelSpec
    draft_spec: ModelSpec | None
    mtp_layers: tuple | None
    model_dtype: str
    plan: KVPlan


def pick_device(requested: str) -> torch.device:
    """``--device``: auto is CUDA when torch sees a device, else CPU; cuda without a device is refused."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but torch sees no CUDA device; use --device cpu")
    return torch.device(requested)


def cache_config(args: EngineArgs, device: torch.device) -> CacheConfig:
    """The planner's cache inputs from ``args`` on ``device`` (its memory from ``--kv-cache-memory`` or, on
    CUDA, the device's total memory under ``--gpu-memory-utilization``); raises ConfigError on a bad value."""
    platform = device.type
    return CacheConfig(
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        num_speculative_tokens=args.num_speculative_tokens,
        kv_cache_memory=resolve_kv_cache_memory(args.kv_cache_memory, platform),
        gpu_memory=(args.gpu_memory or torch.cuda.mem_get_info(device)[1]) if platform == "cuda" else None,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_scale_scheme=args.kv_scale_scheme,
        calculate_kv_scales=args.calculate_kv_scales, max_num_seqs=args.max_num_seqs,
        query_dtype=args.query_dtype, state_dtype=args.state_dtype,
        max_num_batched_tokens=args.step_token_budget(platform),
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def plan_engine(args: EngineArgs, device: torch.device, cache: CacheConfig | None = None) -> EnginePlan:
    """Resolve the KV plan the engine of ``args`` on ``device`` runs; ``cache``: :func:`cache_config`'s, when
    the caller built it already."""
    platform = device.type
    spec = load_model_spec(args.model)
    model_dtype = platform_model_dtype(args.dtype, platform, spec.model_dtype)
    cache = cache_config(args, device) if cache is None else cache
    speculative = args.speculative_config
    mtp_layers = None
    if speculative is not None and speculative.method == "mtp":  # the checkpoint's MTP layer, in the target's groups
        from kvforge.speculative.mtp_spec import mtp_proposer_layers

        mtp_layers = mtp_proposer_layers(spec)
    draft_spec = (load_draft_model_spec(speculative.model)
                  if speculative is not None and speculative.method == "draft_model" else None)
    plan = resolve(spec, cache, ParallelConfig(args.tensor_parallel_size), platform, model_dtype=model_dtype,
                   draft_spec=draft_spec, proposer_layers=mtp_layers)
    return EnginePlan(spec, draft_spec, mtp_layers, model_dtype, plan)
