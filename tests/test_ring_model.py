"""The CsaRingTest architecture in the engine (dummy weights, CPU).

Each layer writes one ring row per token (a projection of its normed input)
into a per-request ring of R = ring_rows + num_speculative_tokens rows that
lives inside one page of the ring's KV cache group. Checks: the block size the
planner negotiates is the one the engine runs with; the rings hold exactly the
most recent R rows (position p in row p mod R); ring writes never touch any
byte outside the rows of the request's own ring page.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.state_slots import StateSlots

CONFIG = dict(architectures=["CsaRingTestForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=128, ring_rows=7,
              ring_row_bytes=256, max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="float32")
PROMPTS = [[5, 9, 3], list(range(10, 20)), list(range(20, 60)), [7] * 6, list(range(60, 90))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SENTINEL = 0xAB


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def make(model_dir, **kw):
    base = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 21,
                max_model_len=256, max_num_seqs=3, progress=False, device="cpu", enable_prefix_caching=False)
    return LLM(model_dir, **{**base, **kw})


def test_fp8_ring_forces_block_32_and_runs(model_dir, caplog):
    # 1 KV head x (32 + 32) fp8 bytes = 64 B/token: a 16-token page (1024 B) cannot hold 7 x 256 B = 1792 B.
    with caplog.at_level(logging.INFO, logger="kvforge.plan"):
        llm = make(model_dir, kv_cache_dtype="fp8")
    assert llm.plan.block_size == 32
    assert "Setting kv cache block size to 32 for csa_ring backend(s)." in caplog.text
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert make(model_dir, kv_cache_dtype="auto").plan.block_size == 16  # fp32 KV: 4096-byte page fits


def _run_capturing_rings(llm):
    """Generate PROMPTS; copy each request's ring pages when its slot is released."""
    pool = llm.engine.pool
    captured: dict[str, list[torch.Tensor]] = {}
    original = StateSlots.release

    def spy(self, request_id):
        slot = self.held.get(request_id)
        if slot is not None:
            captured[request_id] = [page[slot].clone() for page in pool.ring_pages]
        return original(self, request_id)

    StateSlots.release = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        StateSlots.release = original
    return outs, captured


def test_rings_hold_the_most_recent_rows(model_dir):
    llm = make(model_dir, num_speculative_tokens=2)
    R, rb = 7 + 2, 256
    pool = llm.engine.pool
    assert len(pool.ring_pages) == 2 and pool.state_slots >= 3
    assert pool.nbytes == (llm.plan.num_blocks * llm.plan.group_size * llm.plan.groups[0].page_bytes
                           + pool.state_slots * llm.plan.state_bytes_per_sequence)
    outs, captured = _run_capturing_rings(llm)
    assert len(captured) == len(PROMPTS)
    model = llm.engine.model
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids[:-1]  # the last sampled token is never fed
        L = len(tokens)
        seen: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(lambda mod, a, o, i=i, seen=seen: seen.__setitem__(i, o.detach().clone()))
                 for i, m in enumerate(model.ring_proj)]
        try:
            llm.engine.compute_prompt_logits(tokens)  # teacher-forced reference of every position's row
        finally:
            for h in hooks:
                h.remove()
        for layer, page in enumerate(captured[out.request_id]):
            ring = page[: R * rb].view(torch.float32).view(R, rb // 4)
            for p in range(max(0, L - R), L):
                torch.testing.assert_close(ring[p % R], seen[layer][p], rtol=1e-5, atol=1e-6)


def test_ring_writes_touch_nothing_else(model_dir, monkeypatch):
    with_rings = make(model_dir)
    pool = with_rings.engine.pool
    pool.buffer.fill_(SENTINEL)
    outs_a, captured = _run_capturing_rings(with_rings)
    a = pool.buffer.clone()

    monkeypatch.setattr(ModelRunner, "_ring_write", lambda self, layer, rows: None)
    without = make(model_dir)
    without.engine.pool.buffer.fill_(SENTINEL)
    outs_b = without.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    b = without.engine.pool.buffer.clone()

    # Exact: ring rows are written, never read by this architecture's forward, so both engines run the
    # same batches through the same kernels and compute bitwise-equal logits.
    assert [o.outputs[0].token_ids for o in outs_a] == [o.outputs[0].token_ids for o in outs_b]
    attention_bytes = pool.num_blocks * with_rings.plan.group_size * pool.page_bytes
    assert torch.equal(a[:attention_bytes], b[:attention_bytes]), "a ring write changed KV-cache bytes"
    assert bool((b[attention_bytes:] == SENTINEL).all())
    used_rows = 7 * 256
    rings = a[attention_bytes:].view(len(pool.ring_pages), pool.state_slots, -1)
    assert bool((rings[:, :, used_rows:] == SENTINEL).all()), "a ring write went past its R rows"
    written = (rings[:, :, :used_rows] != SENTINEL).any(dim=2)
    assert written.any(dim=0).sum().item() <= with_rings.engine.scheduler.max_num_seqs
    assert with_rings.engine.state_slots.num_free == pool.state_slots


def test_ring_models_never_default_to_overlapped_scheduling(model_dir, monkeypatch):
    """Overlap would run one more step for a finished sequence, writing a row into its ring after its last
    token: the engine asks the default with its rings, and the default refuses them on every platform."""
    from kvforge.engine import llm_engine
    from kvforge.engine.overlap import default_async_scheduling

    asked = []

    def recorded(platform, tensor_parallel, rings):
        asked.append(rings)
        return default_async_scheduling(platform, tensor_parallel, rings)

    monkeypatch.setattr(llm_engine, "default_async_scheduling", recorded)
    assert not make(model_dir).engine.async_scheduling and asked == [True]
    assert not default_async_scheduling("cuda", False, True)
    assert default_async_scheduling("cuda", False, False)  # the CUDA default at TP 1 otherwise
    assert not default_async_scheduling("cuda", True, False) and not default_async_scheduling("cpu", False, False)
