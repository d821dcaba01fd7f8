"""The multi-token-prediction (MTP) layer of Qwen3-Next checkpoints.

A checkpoint with ``mtp_num_hidden_layers > 0`` stores one more block under ``mtp.*``: ``fc``
(``[hidden, 2 * hidden]``), the zero-centred norms ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and
``norm``, and ``layers.0``, a decoder layer of gated full attention with the MoE block of the target's
layers. It has no embedding or head of its own: it reads the target's. For position ``i``, with ``h_i``
the hidden state the target hands its head (after the final norm) and ``t_{i+1}`` the token that
follows position ``i``::

    x_i   = fc([pre_fc_norm_embedding(embed_tokens(t_{i+1})) ; pre_fc_norm_hidden(h_i)])   # embedding half first
    y_i   = layers.0(x_i)                          # gated attention over positions 0 .. i, partial rope, MoE
    out_i = norm(y_i);  logits_i = lm_head(out_i)  # a guess of t_{i+2}

The layer's KV is a page slot of the target's full-attention group (the plan's proposer layer,
kvforge/speculative/mtp_spec.py), so it shares the target sequence's block tables; it keeps no linear
state. Used for more than one guess, the layer is applied again to its own output: ``out_i`` takes the
place of ``h`` at position ``i + 1`` with the guessed token (kvforge/speculative/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.models.gemma3 import GemmaRMSNorm
from kvforge.models.linear_route import Linear


class Qwen3NextMTP(nn.Module):
    """The ``mtp.*`` block (module docstring); ``layer`` is a full-attention decoder layer whose attention
    writes the runner's layer 0 (the plan's proposer layer)."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module, dtype=None):
        super().__init__()
        self.fc = Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden_size, eps, dtype=dtype)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden_size, eps, dtype=dtype)
        self.layers = nn.ModuleList([layer])
        self.norm = GemmaRMSNorm(hidden_size, eps, dtype=dtype)

    def predict(self, embedded: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn,
                rotary: nn.Module) -> torch.Tensor:
        """``out`` [T, hidden] (the head's input) for rows ``(embed(t_{i+1}), i, h_i)``; writes the layer's KV
        of each position through ``attn`` like any full-attention layer."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = rotary.cos_sin(positions, x.dtype)
        y, residual = self.layers[0](rope, x, None, attn, rotary)
        return self.norm(y, residual)[0]
