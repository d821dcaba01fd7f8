"""Loading routed experts stacked per layer (``experts_gate_up [E, 2I, H]``, ``experts_down [E, H, I]``).

Checkpoints store them per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the hub layout)
or fused over experts (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``,
what transformers 5 writes). :class:`StackedExpertsCheckpoint` is the
:class:`~kvforge.models.decoder.DecoderForCausalLM` mixin that maps both onto the stacked
parameters (the layout of :class:`kvforge.models.deepseek.MoE`), and says whether decode steps can be
captured in a CUDA graph (DeepSeek's rule for that MoE module).
"""

from __future__ import annotations

import re

import torch

from kvforge.models.decoder import copy_checked
from kvforge.models.deepseek import DeepseekV2ForCausalLM

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class StackedExpertsCheckpoint:
    """``checkpoint_names`` / ``load_checkpoint_tensor`` for stacked routed experts; the rest by the base class."""

    @property
    def cuda_graph_unsupported_reason(self) -> str | None:
        """DeepSeek's rule, for the same MoE module: decode is capturable where ``torch._grouped_mm`` works."""
        return DeepseekV2ForCausalLM.cuda_graph_unsupported_reason.fget(self)

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        if name.endswith(".experts_gate_up"):
            base = name[: -len(".experts_gate_up")]
            return [f"{base}.experts.{e}.{w}.weight" for e in range(param.shape[0]) for w in ("gate_proj", "up_proj")]
        if name.endswith(".experts_down"):
            base = name[: -len(".experts_down")]
            return [f"{base}.experts.{e}.down_proj.weight" for e in range(param.shape[0])]
        return super().checkpoint_names(name, param)

    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        m = _PER_EXPERT.match(name)
        if m:
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            if f"{base}.experts_down" not in params:
                return None
            if which == "down_proj":
                copy_checked(params[f"{base}.experts_down"][e], name, tensor)
            else:
                full = params[f"{base}.experts_gate_up"][e]
                inter = full.shape[0] // 2
                copy_checked(full.narrow(0, 0 if which == "gate_proj" else inter, inter), name, tensor)
            return (name,)
        m = _FUSED.match(name)
        if m:
            base, which = m.group(1), m.group(2)
            target = f"{base}.experts_gate_up" if which == "gate_up_proj" else f"{base}.experts_down"
            if target not in params:
                return None
            copy_checked(params[target], name, tensor)
            return self.checkpoint_names(target, params[target])
        return super().load_checkpoint_tensor(params, name, tensor)
