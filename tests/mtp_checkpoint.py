"""A tiny random DeepSeek-V3 checkpoint with a multi-token-prediction layer, and a float64 reference of
that layer written from the DeepSeek-V3 report's equations (section 2.2).

transformers' DeepseekV3ForCausalLM writes the main model (it has no MTP layer); the MTP tensors are
added under the names DeepSeek-V3's checkpoints use (``model.layers.{num_hidden_layers}.*``) in a second
safetensors file. The MTP block's decoder layer is drawn as the only layer of a one-layer transformers
DeepseekV3 model (``first_k_dense_replace`` 0, so it is an MoE layer, as the MTP layer of the main config
is): that model, called on the projected inputs, is the reference for ``shared_head.norm(block(x))``
(causal MLA with rope at the MTP positions, then the final norm). The rest of the reference (embedding,
``enorm``, ``hnorm``, ``eh_proj``, ``head``) is written out here.
"""

from __future__ import annotations

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 256
DEEPSEEK_V3_MTP = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
    q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB,
    max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1, n_group=4, topk_group=2,
    norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    rope_scaling=dict(type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=64,
                      beta_fast=32, beta_slow=1),
)


def _perturb(model) -> None:
    """Norm weights and router biases away from their defaults, so each of them changes the output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)


class MTPReference:
    """The main model and the MTP layer in float64 (see the module docstring)."""

    def __init__(self, main, block, enorm, hnorm, eh_proj, embed, head, eps):
        for model in (main, block):  # the experts' loop (grouped GEMMs take no float64)
            model.config._experts_implementation = "eager"
        self.main, self.block = main.double(), block.double()
        self.enorm, self.hnorm, self.eh_proj = enorm.double(), hnorm.double(), eh_proj.double()
        self.embed, self.head, self.eps = embed.double(), head.double(), eps

    def _rms(self, x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The main model's last hidden states [T, hidden] (after its final norm: what its head reads)."""
        return self.main.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def outputs(self, next_ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        """``shared_head.norm(block(x))`` [T, hidden] for MTP positions 0 .. T - 1 with tokens ``next_ids``
        (the token after each position) and previous hidden states ``prev_hidden`` [T, hidden]."""
        e = self._rms(self.embed[torch.tensor(next_ids)], self.enorm)
        x = torch.cat([e, self._rms(prev_hidden.double(), self.hnorm)], dim=-1) @ self.eh_proj.T
        return self.block.model(inputs_embeds=x[None]).last_hidden_state[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.head.T


def save_deepseek_v3_with_mtp(path, dtype=torch.float32, seed: int = 0, **overrides) -> MTPReference:
    """Write the checkpoint to ``path``; returns its float64 reference (exact for ``dtype`` float32; with
    another dtype the MTP block's reference weights are not rounded to it)."""
    cfg_dict = {**DEEPSEEK_V3_MTP, **overrides}
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**cfg_dict)
    main = transformers.DeepseekV3ForCausalLM(cfg).eval().float()
    _perturb(main)
    main.to(dtype).save_pretrained(path, safe_serialization=True)
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    block_cfg = transformers.DeepseekV3Config(**{**cfg_dict, "num_hidden_layers": 1, "first_k_dense_replace": 0})
    block = transformers.DeepseekV3ForCausalLM(block_cfg).eval().float()
    _perturb(block)
    g = torch.Generator().manual_seed(seed + 1)
    enorm = 1 + 0.1 * torch.randn(h, generator=g)
    hnorm = 1 + 0.1 * torch.randn(h, generator=g)
    eh_proj = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    tensors = {f"model.layers.{n}." + k[len("model.layers.0."):]: v
               for k, v in block.state_dict().items() if k.startswith("model.layers.0.")}
    tensors.update({
        f"model.layers.{n}.embed_tokens.weight": block.model.embed_tokens.weight.detach(),
        f"model.layers.{n}.shared_head.norm.weight": block.model.norm.weight.detach(),
        f"model.layers.{n}.shared_head.head.weight": block.lm_head.weight.detach(),
        f"model.layers.{n}.enorm.weight": enorm, f"model.layers.{n}.hnorm.weight": hnorm,
        f"model.layers.{n}.eh_proj.weight": eh_proj,
    })
    save_file({k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    main.float()  # save_pretrained above cast it in place: the reference sees the saved (rounded) weights
    return MTPReference(main, block, enorm, hnorm, eh_proj, block.model.embed_tokens.weight.detach(),
                        block.lm_head.weight.detach(), cfg.rms_norm_eps)
