"""The target's spec with its multi-token-prediction layer, for speculative method mtp (torch-free).

The MTP layer of a DeepSeek-V3 checkpoint (``model.layers.{num_hidden_layers}``) attends with MLA of
the target's dimensions, so it is planned as one more layer of the target: the resolver puts it in the
target's MLA group (same page layout), it shares each sequence's block tables, and its KV is counted in
the plan's bytes per token and capacity. Only the first MTP layer is planned: proposals past the first
reuse it (kvforge/speculative/mtp.py).
"""

from __future__ import annotations

import dataclasses

from kvforge.errors import ConfigError
from kvforge.spec.architectures import deepseek_mtp_layer
from kvforge.spec.model_spec import ModelSpec

#: Architectures whose checkpoints' MTP layers kvforge runs.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def num_mtp_layers(spec: ModelSpec) -> int:
    """Multi-token-prediction layers the checkpoint carries (DeepSeek-V3's ``num_nextn_predict_layers``)."""
    value = spec.hf_config.get("num_nextn_predict_layers") or 0
    return int(value) if isinstance(value, int) else 0


def check_mtp_target(spec: ModelSpec) -> None:
    """ConfigError naming the problem and the fix when ``spec``'s checkpoint has no MTP layer kvforge runs."""
    if not num_mtp_layers(spec):
        raise ConfigError(f"--speculative-config method mtp needs a checkpoint with a multi-token-prediction "
                          f"layer (num_nextn_predict_layers > 0 in config.json); {spec.name} has none. Use "
                          f"method ngram, or a DeepSeek-V3-style checkpoint that carries one")
    if spec.architecture not in MTP_ARCHITECTURES:
        raise ConfigError(f"--speculative-config method mtp runs the MTP layers of {', '.join(MTP_ARCHITECTURES)} "
                          f"checkpoints, not {spec.architecture}; use method ngram or draft_model")


def with_mtp_layer(spec: ModelSpec) -> ModelSpec:
    """``spec`` plus its first MTP layer (index ``num_hidden_layers``) and that layer's weights."""
    if spec.mtp_layers:
        return spec
    check_mtp_target(spec)
    layer, params = deepseek_mtp_layer(spec.hf_config)
    return dataclasses.replace(spec, layers=spec.layers + (layer,), num_parameters=spec.num_parameters + params,
                               mtp_layers=(layer.index,))
