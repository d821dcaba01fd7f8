"""Input-major weight storage on CPU (``layers.store_input_major``, applied by the CPU model runner).

The stored values, shapes and Parameter objects stay the same (so checkpoint loading, tying and hooks are
unaffected); only the memory order changes, to ``[in, out]``. Products with such a weight are the same
float32 dot products summed in another order, so they agree with the output-major layout to float32
rounding (bound: ``in_features * eps * sum |x_i w_i|``), not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvforge.models.layers import store_input_major


def _is_input_major(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0])


def test_values_kept_and_products_agree():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 40, bias=True)
    emb = nn.Embedding(50, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        emb.weight.copy_(torch.randn(50, 96, generator=g))
    params = (lin.weight, emb.weight)
    before_lin, before_emb = lin.weight.detach().clone(), emb.weight.detach().clone()
    x = torch.randn(3, 96, generator=g)
    ids = torch.tensor([0, 7, 49, 7])
    want_y, want_e = lin(x).detach(), emb(ids).detach()

    store_input_major([lin, emb])
    assert (lin.weight, emb.weight) == params  # the same Parameter objects
    assert _is_input_major(lin.weight) and _is_input_major(emb.weight)
    assert torch.equal(lin.weight, before_lin) and torch.equal(emb.weight, before_emb)
    assert torch.equal(emb(ids), want_e)  # a lookup copies rows: exact
    bound = 96 * torch.finfo(torch.float32).eps * ((x.abs() @ lin.weight.abs().t()) + lin.bias.abs())
    assert bool(((lin(x) - want_y).abs() <= bound).all())
    tied = F.linear(x, emb.weight)  # a head tied to the embedding reads the same storage
    assert bool(((tied - x @ before_emb.t()).abs() <= 96 * torch.finfo(torch.float32).eps
                 * (x.abs() @ before_emb.abs().t())).all())

    store_input_major([lin])  # idempotent: no second transpose
    assert _is_input_major(lin.weight) and torch.equal(lin.weight, before_lin)
    with torch.no_grad():  # a later load writes through the strided view
        lin.weight.copy_(before_lin * 2)
    assert torch.equal(lin.weight, before_lin * 2)


def test_other_module_types_are_left_alone():
    class Sharded(nn.Linear):  # stands for a tensor-parallel layer with its own forward
        pass

    sharded, conv = Sharded(8, 4), nn.Conv1d(4, 4, 3)
    store_input_major([sharded, conv])
    assert sharded.weight.is_contiguous() and conv.weight.is_contiguous()


def test_cpu_runner_stores_the_llama_projections_input_major(tmp_path):
    """The CPU runner stores every projection and the (tied) head input-major; the untouched norms stay."""
    pytest.importorskip("transformers")
    from test_engine_vs_hf import _save_hf

    from kvforge import LLM

    _save_hf(tmp_path, "qwen3")  # tied embeddings
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22,
              progress=False, device="cpu")
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert _is_input_major(lin.weight)
    assert model.lm_head is None and model.lm_head_weight is model.model.embed_tokens.weight
    assert _is_input_major(model.model.embed_tokens.weight)
    assert layer.input_layernorm.weight.is_contiguous()
