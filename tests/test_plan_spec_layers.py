"""Layer kinds the planner reads from a config, against the layers the model code builds."""

import pytest

from kvforge.planner.inputs import CacheConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=4096,
            torch_dtype="bfloat16")


def windows(arch, **over):
    spec = spec_from_hf_config(dict(TINY, architectures=[arch], **over), name="tiny", source="test")
    return [(layer.kind, getattr(layer, "sliding_window", None)) for layer in spec.layers]


FULL, SLIDE = ("full", None), ("sliding", 256)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_slides_only_the_layers_from_max_window_layers(arch):
    # transformers writes layer_types for these configs; older ones carry only max_window_layers. Both say the
    # first max_window_layers layers attend to every token, as kvforge/models/llama.py runs them.
    listed = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert windows(arch, use_sliding_window=True, sliding_window=256, max_window_layers=2,
                   layer_types=listed) == [FULL, FULL, SLIDE, SLIDE]
    assert windows(arch, use_sliding_window=True, sliding_window=256, max_window_layers=2) == [FULL, FULL, SLIDE, SLIDE]
    assert windows(arch, use_sliding_window=False, sliding_window=256, max_window_layers=2) == [FULL] * 4


def test_layer_types_decide_which_dense_layers_slide():
    listed = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert windows("LlamaForCausalLM", sliding_window=256, layer_types=listed) == [SLIDE, FULL, SLIDE, FULL]
    assert windows("MistralForCausalLM", sliding_window=256, layer_types=listed) == [SLIDE, FULL, SLIDE, FULL]
    assert windows("MistralForCausalLM", sliding_window=256) == [SLIDE] * 4
    assert windows("MistralForCausalLM", sliding_window=None) == [FULL] * 4
    # Llama without layer_types never slides, whatever use_sliding_window says.
    assert windows("LlamaForCausalLM", use_sliding_window=True, sliding_window=256) == [FULL] * 4


def test_qwen_full_layers_below_max_window_layers_count_every_token():
    cfg = dict(TINY, architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=256,
               max_window_layers=2)
    plan = resolve(spec_from_hf_config(cfg, name="tiny", source="test"),
                   CacheConfig(max_model_len=1024, kv_cache_memory=2**26), platform="cuda")
    layer_bytes = 2 * (32 + 32) * 2  # 2 KV heads x (K 32 + V 32) x bf16
    assert plan.bytes_per_token == 2 * layer_bytes
    # Two groups of 2 layers (full, sliding), a page of 16 tokens: 1024 / 16 = 64 blocks in the full group and
    # ceil((256 - 1) / 16) + 1 = 17 in the sliding one, each block id one page in 2 slots.
    block_id_bytes = 2 * 16 * layer_bytes
    assert plan.num_blocks == 2**26 // block_id_bytes
    assert plan.capacity.bytes_per_sequence == (64 + 17) * block_id_bytes
