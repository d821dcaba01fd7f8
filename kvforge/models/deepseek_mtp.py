"""The multi-token-prediction (MTP) layer of DeepSeek-V3-style checkpoints.

A checkpoint with ``num_nextn_predict_layers > 0`` stores, after its ``num_hidden_layers`` decoder
layers, one more block under ``model.layers.{num_hidden_layers}``: the decoder layer's usual weights
(``input_layernorm``, MLA ``self_attn``, ``post_attention_layernorm``, ``mlp``: MoE or dense by the
same rule as every layer) plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.{norm,head}``. For position ``i``, with ``h_i`` the hidden state the main model hands
its head (after the final norm) and ``t_{i+1}`` the token that follows position ``i``::

    x_i   = eh_proj([enorm(embed_tokens(t_{i+1})) ; hnorm(h_i)])      # embedding half first
    y_i   = decoder_layer(x_i)                                        # MLA over positions 0 .. i
    out_i = shared_head.norm(y_i);  logits_i = shared_head.head(out_i)   # a guess of t_{i+2}

The layer's attention is MLA with the main model's dimensions and runs at position ``i``; its KV
cache is a page slot of the target's MLA group (the plan's proposer layer), so it shares the target
sequence's block tables. Used for more than one guess, the layer is applied again to its
own output: ``out_i`` takes the place of ``h`` at position ``i + 1`` with the guessed token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.models.decoder import PreNormDecoderLayer
from kvforge.models.layers import RMSNorm


class SharedHead(nn.Module):
    """``norm`` then ``head`` (HF ``shared_head.norm`` / ``shared_head.head``)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype=None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)


class DeepseekMTPLayer(PreNormDecoderLayer):
    """One MTP block (see the module docstring): a pre-norm decoder layer around ``self_attn`` and
    ``mlp`` plus its own embedding, the two input norms, ``eh_proj`` and ``shared_head``."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module,
                 dtype=None):
        super().__init__(hidden_size, eps, self_attn, mlp, dtype=dtype)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.enorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.hnorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False, dtype=dtype)
        self.shared_head = SharedHead(hidden_size, vocab_size, eps, dtype=dtype)

    def predict(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn,
                rotary: nn.Module) -> torch.Tensor:
        """``out`` [T, hidden] (the head's input) for rows ``(t_{i+1}, i, h_i)``; writes the layer's KV of
        each position through ``attn`` like any MLA layer."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)], dim=-1))
        rope = rotary.cos_sin(positions, x.dtype)
        y, residual = super().forward(rope, x, None, attn, rotary)
        return self.shared_head.norm(y, residual)[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab] of :meth:`predict`'s output."""
        return F.linear(out, self.shared_head.head.weight).float()
