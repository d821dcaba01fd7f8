"""The engine moves its startup's objects out of the collector's reach (kvforge/engine/gc_freeze.py), so
an automatic full collection mid-step walks only what serving created since, and a dropped engine's
reference cycles are still collected when the next engine starts."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvforge import LLM  # noqa: E402

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=128, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_gc")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(path, safe_serialization=True)
    return str(path)


def _llm(path):
    return LLM(path, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False, device="cpu",
               dtype="float32")


def test_startup_objects_are_frozen(tiny_llama):
    llm = _llm(tiny_llama)
    model = llm.engine.model
    assert gc.get_freeze_count() > 0
    assert not any(o is model for o in gc.get_objects())  # the permanent generation is not listed
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0  # shutdown thaws before it collects


def test_a_dropped_engine_is_collected_when_the_next_starts(tiny_llama):
    first = _llm(tiny_llama)
    engine = first.engine
    engine.cycle = engine  # a reference cycle: only the collector frees it
    gone = weakref.ref(engine)
    del first, engine
    _llm(tiny_llama)
    assert gone() is None


def test_a_dropped_engine_gives_its_memory_back_before_the_next_counts_it(tiny_llama, monkeypatch):
    """The next engine frees a dropped engine before it checks the memory it needs, so the dropped
    engine's weights and KV cache are not counted as taken."""
    import kvforge.engine.host_memory as host_memory

    first = _llm(tiny_llama)
    first.engine.cycle = first.engine
    model = weakref.ref(first.engine.model)
    del first
    alive_at_check = []
    check = host_memory.check_host_memory
    monkeypatch.setattr(host_memory, "check_host_memory",
                        lambda *a, **k: (alive_at_check.append(model() is not None), check(*a, **k))[1])
    _llm(tiny_llama).engine.shutdown()
    assert alive_at_check == [False]
