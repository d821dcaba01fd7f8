"""Loading routed experts stacked per layer (``experts_gate_up [E, 2I, H]``, ``experts_down [E, H, I]``).

Checkpoints store them per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the hub layout)
or fused over experts (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``,
what transformers 5 writes). :class:`StackedExpertsCheckpoint` is the
:class:`~kvforge.models.decoder.DecoderForCausalLM` mixin that maps both onto the stacked
parameters (the layout of :class:`kvforge.models.deepseek.MoE`), and says whether decode steps can be
captured in a CUDA graph.
"""

from __future__ import annotations

import re

import torch

from kvforge.models.decoder import copy_checked
from kvforge.models.grouped_mm import grouped_mm_problem

PER_EXPERT_NAME = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
"""A checkpoint tensor of one expert: groups (``model.layers.{i}.mlp``, or an MTP block's ``mtp.layers.{i}.mlp``,
expert index, projection)."""
FUSED_EXPERTS_NAME = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
"""A checkpoint tensor fused over experts: groups (``model.layers.{i}.mlp``, projection)."""


class StackedExpertsCheckpoint:
    """``checkpoint_names`` / ``load_checkpoint_tensor`` for stacked routed experts; the rest by the base class."""

    @property
    def cuda_graph_unsupported_reason(self) -> str | None:
        """Why decode steps cannot be captured (None: they can). Stacked experts are capturable on CUDA where
        ``torch._grouped_mm`` works for their dtype (probed once, kvforge/models/grouped_mm.py); otherwise
        they loop over experts with per-expert counts read on the host, which capture forbids."""
        w = next((p for name, p in self.named_parameters() if name.endswith(".experts_down")), None)
        if w is None:
            return None
        if w.device.type != "cuda":
            return "MoE layers loop over experts with host-side token counts"
        problem = grouped_mm_problem(w.device, w.dtype)
        if problem:
            return f"MoE layers loop over experts with host-side token counts ({problem})"
        return None

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        if name.endswith(".experts_gate_up"):
            base = name[: -len(".experts_gate_up")]
            return [f"{base}.experts.{e}.{w}.weight" for e in range(param.shape[0]) for w in ("gate_proj", "up_proj")]
        if name.endswith(".experts_down"):
            base = name[: -len(".experts_down")]
            return [f"{base}.experts.{e}.down_proj.weight" for e in range(param.shape[0])]
        return super().checkpoint_names(name, param)

    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        """Routed experts per expert (the hub layout) or fused over experts; everything else by the base class."""
        m = PER_EXPERT_NAME.match(name)
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
        m = FUSED_EXPERTS_NAME.match(name)
        if m:
            base, which = m.group(1), m.group(2)
            target = f"{base}.experts_gate_up" if which == "gate_up_proj" else f"{base}.experts_down"
            if target not in params:
                return None
            copy_checked(params[target], name, tensor)
            return self.checkpoint_names(target, params[target])
        return super().load_checkpoint_tensor(params, name, tensor)
