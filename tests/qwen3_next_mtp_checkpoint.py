"""A tiny random Qwen3-Next checkpoint with a multi-token-prediction layer (``mtp.*``), and a float64
reference of that layer.

transformers' Qwen3NextForCausalLM writes the main model (tests/tiny_checkpoints.py's config; transformers
runs no MTP layer and ignores ``mtp.*`` tensors). The MTP tensors are added under the names Qwen3-Next's
checkpoints use in a second safetensors file. The MTP block's decoder layer and final norm are drawn as the
only layer and the norm of a one-layer transformers Qwen3-Next model (``layer_types`` ``["full_attention"]``,
so gated attention with partial rope, and MoE, as the checkpoint's ``mtp.layers.0`` is): that model, called on
the projected inputs, is the reference for ``norm(layers.0(x))``. The rest of the reference (the target's
embedding and head, the zero-centred ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` and ``fc``) is
written out here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_checkpoints import QWEN3_NEXT, make_checkpoint


class Qwen3NextMTPReference:
    """The main model and the MTP layer in float64 (see the module docstring)."""

    def __init__(self, main, block, norm_embedding, norm_hidden, fc, eps):
        for model in (main, block):  # the experts' loop (grouped GEMMs take no float64)
            model.config._experts_implementation = "eager"
        self.main, self.block = main.double(), block.double()
        self.norm_embedding, self.norm_hidden, self.fc = norm_embedding.double(), norm_hidden.double(), fc.double()
        self.eps = eps

    def _zero_centred_rms(self, x, w):
        return (1 + w) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The main model's last hidden states [T, hidden] (after its final norm: what its head reads)."""
        return self.main.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def outputs(self, next_ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        """``norm(layers.0(x))`` [T, hidden] for MTP positions 0 .. T - 1 with tokens ``next_ids`` (the token
        after each position) and previous hidden states ``prev_hidden`` [T, hidden]."""
        embedded = self.main.model.embed_tokens.weight[torch.tensor(next_ids)]
        e = self._zero_centred_rms(embedded, self.norm_embedding)
        h = self._zero_centred_rms(prev_hidden.double(), self.norm_hidden)
        x = torch.cat([e, h], dim=-1) @ self.fc.T
        return self.block.model(inputs_embeds=x[None]).last_hidden_state[0]

    @torch.no_grad()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.main.lm_head.weight.T


def save_qwen3_next_with_mtp(path, seed: int = 0) -> Qwen3NextMTPReference:
    """Write the checkpoint (float32) to ``path``; returns its float64 reference."""
    main, config = make_checkpoint("qwen3-next", path, mtp_num_hidden_layers=1)
    assert config.get("mtp_num_hidden_layers") == 1, "transformers dropped mtp_num_hidden_layers from config.json"
    with tempfile.TemporaryDirectory() as scratch:
        block, _ = make_checkpoint("qwen3-next", Path(scratch), num_hidden_layers=1,
                                   layer_types=["full_attention"], mlp_only_layers=[])
    h = QWEN3_NEXT["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    norm_embedding = 0.2 * torch.randn(h, generator=g)  # zero-centred: x * (1 + w)
    norm_hidden = 0.2 * torch.randn(h, generator=g)
    fc = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    tensors = {"mtp." + k[len("model."):]: v for k, v in block.state_dict().items() if k.startswith("model.layers.0.")}
    # The hub's layout: one tensor per expert and projection (transformers writes them fused over experts).
    gate_up = tensors.pop("mtp.layers.0.mlp.experts.gate_up_proj")
    down = tensors.pop("mtp.layers.0.mlp.experts.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    tensors.update({"mtp.norm.weight": block.model.norm.weight.detach(), "mtp.fc.weight": fc,
                    "mtp.pre_fc_norm_embedding.weight": norm_embedding, "mtp.pre_fc_norm_hidden.weight": norm_hidden})
    save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return Qwen3NextMTPReference(main, block, norm_embedding, norm_hidden, fc, QWEN3_NEXT["rms_norm_eps"])
