"""The checkpoint's multi-token-prediction layer as the plan's proposer layers (speculative method mtp;
torch-free).

The first MTP layer of a checkpoint is planned at index ``num_hidden_layers``, after the target's
layers, in the target group of its own page layout (``GroupPlan.draft_layers``,
kvforge/planner/proposer_layers.py): it shares each sequence's block tables and its KV is counted in the
plan's bytes per token and capacity (``plan.draft``). A DeepSeek-V3 MTP layer
(``model.layers.{num_hidden_layers}``) attends with MLA of the target's dimensions, so it joins the MLA
group; a Qwen3-Next one (``mtp.layers.0``) is gated full attention and joins the full-attention group
(Qwen3-Next's Gated DeltaNet state has no MTP counterpart). Only the first MTP layer is planned:
proposals past the first reuse it (kvforge/speculative/mtp.py).
"""

from __future__ import annotations

from kvforge.errors import ConfigError
from kvforge.planner.proposer_layers import ProposerLayers
from kvforge.spec.architectures import deepseek_mtp_layer, qwen3_next_mtp_layer
from kvforge.spec.model_spec import ModelSpec

#: Architectures whose checkpoints' MTP layers kvforge runs -> (config key of their MTP layer count, the
#: builder of the first MTP layer's spec and parameter count).
MTP_LAYERS = {
    "DeepseekV3ForCausalLM": ("num_nextn_predict_layers", deepseek_mtp_layer),
    "Qwen3NextForCausalLM": ("mtp_num_hidden_layers", qwen3_next_mtp_layer),
}
MTP_ARCHITECTURES = tuple(MTP_LAYERS)


def num_mtp_layers(spec: ModelSpec) -> int:
    """Multi-token-prediction layers the checkpoint carries (DeepSeek-V3's ``num_nextn_predict_layers``,
    Qwen3-Next's ``mtp_num_hidden_layers``; either key is read for either family)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = spec.hf_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def check_mtp_target(spec: ModelSpec) -> None:
    """ConfigError naming the problem and the fix when ``spec``'s checkpoint has no MTP layer kvforge runs."""
    if spec.architecture not in MTP_LAYERS:
        raise ConfigError(f"--speculative-config method mtp runs the MTP layers of {', '.join(MTP_ARCHITECTURES)} "
                          f"checkpoints, not {spec.architecture}; use method ngram or draft_model")
    if not num_mtp_layers(spec):
        key = MTP_LAYERS[spec.architecture][0]
        raise ConfigError(f"--speculative-config method mtp needs a checkpoint with a multi-token-prediction "
                          f"layer ({key} > 0 in config.json); {spec.name} has none. Use method ngram, or a "
                          f"checkpoint that carries one")
    if spec.hf_config.get("mtp_use_dedicated_embeddings"):
        raise ConfigError(f"{spec.name}: an MTP layer with embeddings of its own (mtp_use_dedicated_embeddings) "
                          f"is not run; use method ngram or draft_model")


def mtp_proposer_layers(spec: ModelSpec) -> ProposerLayers:
    """``spec``'s first MTP layer (index ``num_hidden_layers``) and its weights, for the resolver's
    ``proposer_layers``."""
    check_mtp_target(spec)
    layer, params = MTP_LAYERS[spec.architecture][1](spec.hf_config)
    return ProposerLayers(f"{spec.name} MTP layer", spec.architecture, (layer,), params)
