"""``LLMEngine.shutdown()`` / ``with LLM(...)`` give the engine's memory back at once.

CPU: the KV pool's buffer is freed by ``shutdown()`` itself, with the garbage collector off (so no
reference cycle is needed to free it, and none is left holding it), while the caller still holds
the engine; the model's weights are emptied; after ``del`` the whole engine is collected.

GPU (marked ``gpu``): several engines built and shut down one after another in one process leave
``torch.cuda.memory_allocated()`` where it started.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvforge import LLM, SamplingParams

CPU = dict(device="cpu", max_model_len=128, kv_cache_memory=16 << 20, progress=False)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _engine_refs(llm):
    engine = llm.engine
    model = engine.model
    return {
        "pool buffer": weakref.ref(engine.pool.buffer),
        "a KV view": weakref.ref(engine.pool.kv_caches[0]),
        "a k scale": weakref.ref(engine.pool.k_scales[0]),
        "the model": weakref.ref(model),
        "the runner": weakref.ref(engine.runner),
        "the engine": weakref.ref(engine),
    }


def test_shutdown_frees_pool_and_weights_without_the_collector():
    llm = LLM(**CPU)
    llm.generate(["Hello there", "The sky is"], PARAMS, use_tqdm=False)
    refs = _engine_refs(llm)
    params = list(llm.engine.model.parameters())
    assert sum(p.numel() for p in params) > 0
    gc.collect()
    gc.disable()
    try:
        llm.shutdown()
        for name in ("pool buffer", "a KV view", "a k scale"):
            assert refs[name]() is None, f"{name} is still alive after shutdown()"
        assert llm.engine.pool.nbytes == 0
        # The caller still holds parameter objects; their storage is gone all the same.
        assert all(p.numel() == 0 for p in params)
        assert llm.engine.model is None
    finally:
        gc.enable()
    del params
    llm.shutdown()  # idempotent
    del llm
    gc.collect()
    for name in ("the model", "the runner", "the engine"):
        assert refs[name]() is None, f"{name} is still alive after shutdown() and del"


def test_context_manager_shuts_down_and_refuses_more_work():
    with LLM(**CPU) as llm:
        out = llm.generate("Hello", PARAMS, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        buffer = weakref.ref(llm.engine.pool.buffer)
    assert buffer() is None and llm.engine.is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hello again", PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.step()


def test_shutdown_aborts_requests_in_flight():
    llm = LLM(**CPU)
    llm.engine.add_request("a", "Tell me a story", SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.has_unfinished_requests()
    llm.shutdown()
    assert not llm.engine.has_unfinished_requests()


def test_engines_one_after_another_on_cpu_reuse_nothing():
    """Three engines in turn: each one's pool and weights are gone before the next is built."""
    for _ in range(3):
        with LLM(**CPU) as llm:
            refs = _engine_refs(llm)
            llm.generate("Hi", PARAMS, use_tqdm=False)
        assert refs["pool buffer"]() is None
        del llm
        gc.collect()
        assert refs["the engine"]() is None


def test_ring_model_shutdown_frees_its_ring_pages(tmp_path):
    """A ring (CsaRingTest) engine: the ring pages (views of the pool) and state slots go with the pool."""
    import json

    config = dict(architectures=["CsaRingTestForCausalLM"], hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=128,
                  ring_rows=7, ring_row_bytes=256, max_position_embeddings=512, rms_norm_eps=1e-6,
                  torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 21,
              max_model_len=256, max_num_seqs=3, progress=False, device="cpu", enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": [5, 9, 3]}, {"prompt_token_ids": list(range(10, 20))}], PARAMS,
                 use_tqdm=False)
    ring = weakref.ref(llm.engine.pool.ring_pages[0])
    buffer = weakref.ref(llm.engine.pool.buffer)
    gc.collect()
    gc.disable()
    try:
        llm.shutdown()
        assert ring() is None and buffer() is None
    finally:
        gc.enable()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kwargs", [
    # The ring test preset (dummy weights, rings: eager decode).
    dict(model="csa-ring-test", load_format="dummy", gpu_memory_utilization=0.3),
    # Llama-3.1-8B's shapes (dummy weights) with decode CUDA graphs captured.
    dict(model="llama-3.1-8b", load_format="dummy", gpu_memory_utilization=0.3, max_model_len=1024),
], ids=["ring_preset", "llama_8b_dummy_cuda_graphs"])
def test_engines_give_device_memory_back(kwargs):
    """Four engines one after another: after each ``shutdown()`` (caller's references still alive),
    ``memory_allocated`` is back at its starting value. The first engine may leave the process's
    one-time allocations (cuBLAS workspaces); the check is exact from the second engine on, and the
    first one's leftover is at most 64 MiB."""
    gc.collect()
    start = _allocated()
    base = None
    for i in range(4):
        llm = LLM(**{**kwargs, "progress": False, "device": "cuda"})
        assert _allocated() > start + (1 << 30)  # at 0.3 of a data-center GPU the pool alone is far above 1 GiB
        # Token ids: the preset has no tokenizer.
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8, 9]}], PARAMS,
                     use_tqdm=False)
        llm.engine.shutdown()
        after = _allocated()
        if base is None:
            assert after - start <= 64 << 20, f"engine 0 left {(after - start) / 2**20:.1f} MiB allocated"
            base = after
        else:
            assert after == base, f"engine {i} left {(after - base) / 2**20:.1f} MiB allocated"
        del llm
    gc.collect()
    assert _allocated() == base
