"""The checkpoint's multi-token-prediction layer as the plan's proposer layers (speculative method mtp;
torch-free).

The MTP layer of a DeepSeek-V3 checkpoint (``model.layers.{num_hidden_layers}``) attends with MLA of
the target's dimensions, so the resolver places it in the target's MLA group, after the target's layers
(``GroupPlan.draft_layers``, kvforge/planner/proposer_layers.py): it shares each sequence's block tables
and its KV is counted in the plan's bytes per token and capacity (``plan.draft``). Only the first MTP
layer is planned: proposals past the first reuse it (kvforge/speculative/mtp.py).
"""

from __future__ import annotations

from kvforge.errors import ConfigError
from kvforge.planner.proposer_layers import ProposerLayers
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


def mtp_proposer_layers(spec: ModelSpec) -> ProposerLayers:
    """``spec``'s first MTP layer (index ``num_hidden_layers``) and its weights, for the resolver's
    ``proposer_layers``."""
    check_mtp_target(spec)
    layer, params = deepseek_mtp_layer(spec.hf_config)
    return ProposerLayers(f"{spec.name} MTP layer", spec.architecture, (layer,), params)
