"""CsaRingTestForCausalLM: Llama-style attention plus a per-request ring per layer.

The test architecture for ring block-size negotiation (docs/PLANNER.md). Every layer
projects its (normed) input to one ring row per token, ``ring_row_bytes`` wide
(``ring_row_bytes / element size`` values in the model dtype), and hands the
rows to the runner through ``attn.ring(layer, rows)``. The runner keeps, per
request and layer, the last ``ring_rows + num_speculative_tokens`` rows inside
ONE page-sized block of the ring's KV cache group (position p -> row p mod R).
The rings are write-only for the model (a stand-in for an indexer's cache):
they never change logits, which lets tests compare runs with and without them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.llama import LlamaForCausalLM


class CsaRingTestForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__(config, dtype=dtype)
        self.ring_row_bytes = int(config.get("ring_row_bytes", 1024))
        elem = torch.empty((), dtype=dtype or torch.float32).element_size()
        if self.ring_row_bytes % elem:
            raise ConfigError(f"ring_row_bytes {self.ring_row_bytes} is not a multiple of the model dtype's "
                              f"{elem}-byte elements")
        width = self.ring_row_bytes // elem
        self.ring_proj = nn.ModuleList(
            nn.Linear(self.hidden_size, width, bias=False, dtype=dtype) for _ in range(self.num_layers))
        # The ring row is a projection of each attention block's input; a pre-hook on self_attn sees that
        # input (the normed hidden state) without duplicating the Llama layer code. The hook only acts
        # while forward() has set self._ring_attn (the runner's attn object for this step).
        self._ring_attn = None
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.register_forward_pre_hook(self._make_ring_hook(i))
            layer.self_attn.input_has_other_readers = True  # the hook reads the normed input too

    def _make_ring_hook(self, index: int):
        def hook(module, args):
            attn = self._ring_attn
            if attn is not None and hasattr(attn, "ring"):
                x = args[1]  # LlamaAttention.forward(rope, x, attn, rotary)
                attn.ring(index, self.ring_proj[index](x))
        return hook

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        self._ring_attn = attn
        try:
            return super().forward(input_ids, positions, attn)
        finally:
            self._ring_attn = None
