"""The RMSNorm prologue (kvforge/models/linear_route.py) is taken only where the input projection is the one
reader of the normed input: a model whose forward pre-hook also reads it (the ring test model's ring
projection) gets the normed tensor, on every path where the prologue would otherwise apply."""

from __future__ import annotations

import torch

from kvforge.models import linear_route
from kvforge.models.csa_ring import CsaRingTestForCausalLM
from kvforge.models.linear_route import PendingNorm, norm_input
from kvforge.models.llama import LlamaForCausalLM

CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=128, ring_rows=7,
              ring_row_bytes=256, max_position_embeddings=512, rms_norm_eps=1e-6)


def _attention_input(model, monkeypatch):
    monkeypatch.setattr(linear_route, "use_prologue", lambda *a: True)  # as a one-row CUDA step would
    layer = model.model.layers[0]
    x, residual = torch.randn(1, 64), torch.randn(1, 64)
    with torch.no_grad():
        return norm_input(layer.input_layernorm, x, residual, layer.self_attn)


def test_the_attention_of_a_plain_llama_takes_the_prologue(monkeypatch):
    h, stream = _attention_input(LlamaForCausalLM(CONFIG), monkeypatch)
    assert isinstance(h, PendingNorm) and stream is h


def test_a_second_reader_of_the_attention_input_gets_the_normed_tensor(monkeypatch):
    model = CsaRingTestForCausalLM({**CONFIG, "architectures": ["CsaRingTestForCausalLM"]})
    h, stream = _attention_input(model, monkeypatch)
    assert isinstance(h, torch.Tensor) and isinstance(stream, torch.Tensor)
    layer = model.model.layers[0]
    expected = layer.input_layernorm(stream)  # the stream is x + residual; h its norm
    torch.testing.assert_close(h, expected, rtol=0, atol=0)  # the same module on the same input


def test_kimi_linear_layers_take_the_prologue_into_their_stacked_products(monkeypatch):
    """A KDA layer reads its input only through the stacked product of q, k, v, the gates' first projections
    and b_proj, an MLA layer through DeepSeek's stacked query and latent projection: both take the prologue,
    though both stack a ``q_proj`` of their own (the loader puts each into the layer's stack)."""
    from tiny_checkpoints import KIMI_LINEAR

    from kvforge.models.kimi_linear import KimiLinearForCausalLM

    model = KimiLinearForCausalLM({**KIMI_LINEAR, "architectures": ["KimiLinearForCausalLM"]})
    monkeypatch.setattr(linear_route, "use_prologue", lambda *a: True)  # as a one-row CUDA step would
    x, residual = torch.randn(1, 64), torch.randn(1, 64)
    taken = []
    with torch.no_grad():
        for layer in model.model.layers:
            h, _ = norm_input(layer.input_layernorm, x, residual, layer.self_attn)
            taken.append(isinstance(h, PendingNorm))
    assert taken == [True] * len(KIMI_LINEAR["layer_types"])
    stacks = [type(layer.self_attn).__name__ + (".in_proj" if hasattr(layer.self_attn, "in_proj") else
                                                ".fused_qkv_a_proj") for layer in model.model.layers]
    assert stacks == ["KimiDeltaAttention.in_proj", "MLAAttention.fused_qkv_a_proj",
                      "KimiDeltaAttention.in_proj", "KimiDeltaAttention.in_proj"]
