"""The MLP and expert sizes a tensor-parallel split gives each rank an equal share of, per architecture,
read from the config alone (no torch), so the plan refuses a TP size the model cannot be cut into before
anything loads. The attention and linear-attention heads are the plan's own rule (kvforge/planner/resolver.py);
the TP model classes (kvforge/distributed/) cut exactly these sizes and check them again when they are built
(tests/test_plan_tp_split.py holds the two to the same answers)."""

from __future__ import annotations

from collections.abc import Callable


def _int(cfg: dict, *keys: str, default: int = 0) -> int:
    """The first of ``keys`` the config sets (to a number), as an int; ``default`` where none is set."""
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return default


def _dense_mlp(cfg: dict) -> tuple[tuple[str, int], ...]:
    return (("intermediate_size", _int(cfg, "intermediate_size")),)


def _gpt_oss(cfg: dict) -> tuple[tuple[str, int], ...]:
    return (("num_local_experts", _int(cfg, "num_local_experts", "num_experts")),)


def _mla_moe(cfg: dict, experts_key: str, routed: int, shared: int) -> tuple[tuple[str, int], ...]:
    inter = _int(cfg, "intermediate_size")
    sizes = [("intermediate_size", inter), (experts_key, routed)]
    if routed:
        sizes.append(("the shared experts' intermediate size", _int(cfg, "moe_intermediate_size", default=inter)
                      * shared))
    return tuple(sizes)


def _deepseek(cfg: dict) -> tuple[tuple[str, int], ...]:
    return _mla_moe(cfg, "n_routed_experts", _int(cfg, "n_routed_experts"), _int(cfg, "n_shared_experts"))


def _kimi_linear(cfg: dict) -> tuple[tuple[str, int], ...]:
    return _mla_moe(cfg, "num_experts", _int(cfg, "num_experts", "num_local_experts", "n_routed_experts"),
                    _int(cfg, "num_shared_experts", "n_shared_experts"))


def _qwen3_next(cfg: dict) -> tuple[tuple[str, int], ...]:
    return (("intermediate_size", _int(cfg, "intermediate_size")), ("num_experts", _int(cfg, "num_experts")),
            ("shared_expert_intermediate_size", _int(cfg, "shared_expert_intermediate_size")))


_SIZES: dict[str, Callable[[dict], tuple[tuple[str, int], ...]]] = {
    **{arch: _dense_mlp for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                     "Qwen3ForCausalLM", "Gemma3ForCausalLM")},
    "GptOssForCausalLM": _gpt_oss,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "KimiLinearForCausalLM": _kimi_linear,
    "Qwen3NextForCausalLM": _qwen3_next,
}


def tp_split_sizes(cfg: dict, arch: str) -> tuple[tuple[str, int], ...]:
    """(what, size) pairs every tensor-parallel size must divide; none for an architecture TP does not run."""
    sizes = _SIZES.get(arch)
    return sizes(cfg) if sizes is not None else ()
