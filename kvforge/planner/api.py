"""``kvforge.plan(...)``: the planner as one call (model name/path -> KVPlan)."""

from __future__ import annotations

from kvforge.errors import ConfigError
from kvforge.planner.inputs import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CacheConfig,
    ParallelConfig,
    resolve_max_num_seqs,
)
from kvforge.planner.kv_plan import KVPlan
from kvforge.planner.resolver import resolve
from kvforge.spec.load import load_draft_model_spec, load_model_spec


def plan(model: str | None = None, *, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
         block_size: int | None = None, max_model_len: int | None = None, num_speculative_tokens: int = 0,
         kv_cache_memory: int | None = None, gpu_memory: int | None = None,
         gpu_memory_utilization: float | None = None, device: str | None = None,
         dtype: str | None = None, kv_scale_scheme: str = "per_tensor",
         calculate_kv_scales: bool = False, max_num_seqs: int | None = None, query_dtype: str = "auto",
         state_dtype: str = "auto", backends=None, draft_model: str | None = None, mtp: bool = False,
         max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool = True) -> KVPlan:
    """Resolve the KV-cache plan for ``model`` (None = the embedded SmolLM2) without reading weights;
    ``draft_model``: a speculative draft model planned beside it (the plan's ``draft``); ``mtp``: with the
    checkpoint's multi-token-prediction layer (speculative method mtp, also the plan's ``draft``);
    ``max_num_batched_tokens``: the step size whose activations are set aside (None: the platform's default);
    ``max_num_seqs`` (None: the default, capped at ``max_num_batched_tokens``) must fit in it, as in the engine;
    ``enable_chunked_prefill`` False: a step holds a whole prompt of max model len, and its activations are
    set aside for that.
    Without ``kv_cache_memory`` or ``gpu_memory`` the plan has no capacity figures (the CPU engine would
    take DEFAULT_CPU_KV_CACHE_MEMORY; a plan is usually made for another machine than this one).
    ``device``: "cpu" (None, the default: the CPU reference backends) or "cuda". ``gpu_memory`` and
    ``gpu_memory_utilization`` (None: DEFAULT_GPU_MEMORY_UTILIZATION) size a GPU's KV cache: given with the
    CPU device, at any value, they are refused, since the CPU engine never reads them."""
    from kvforge.kv_dtypes import platform_model_dtype

    named = f"device={device!r}" if device is not None else "the default device, 'cpu',"
    device = device or "cpu"
    if device == "cpu" and (gpu_memory is not None or gpu_memory_utilization is not None):
        given = "gpu_memory" if gpu_memory is not None else "gpu_memory_utilization"
        raise ConfigError(f"{given} sizes a GPU's KV cache, but the plan is for {named} whose engine never reads "
                          f"it: pass device='cuda' to plan a GPU, or kv_cache_memory to size the CPU engine's cache")

    spec = load_model_spec(model)
    proposer_layers = None
    if mtp:
        from kvforge.speculative.mtp_spec import mtp_proposer_layers

        proposer_layers = mtp_proposer_layers(spec)
    cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, block_size=block_size, max_model_len=max_model_len,
                        num_speculative_tokens=num_speculative_tokens, kv_cache_memory=kv_cache_memory,
                        gpu_memory=gpu_memory,
                        gpu_memory_utilization=(DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None
                                                else gpu_memory_utilization),
                        kv_scale_scheme=kv_scale_scheme, calculate_kv_scales=calculate_kv_scales,
                        max_num_seqs=resolve_max_num_seqs(max_num_seqs, max_num_batched_tokens),
                        query_dtype=query_dtype,
                        state_dtype=state_dtype, max_num_batched_tokens=max_num_batched_tokens,
                        enable_chunked_prefill=enable_chunked_prefill)
    model_dtype = platform_model_dtype(dtype, device, spec.model_dtype)
    draft_spec = load_draft_model_spec(draft_model) if draft_model is not None else None
    return resolve(spec, cache, ParallelConfig(tensor_parallel_size), device, backends, model_dtype,
                   draft_spec=draft_spec, proposer_layers=proposer_layers)
