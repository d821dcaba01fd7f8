"""The plan's capacity for hybrid models is what the running engine holds (CPU, dummy weights).

Checkpoint directories hold only a config.json with the KV geometry of the
gpt-oss-20b and gemma-3-27b presets (KV heads, head size, sliding window) and
everything that does not touch the KV cache scaled down (hidden size, query
heads, experts, vocabulary, fewer layers: gpt-oss keeps its alternation, Gemma 3
one sliding and one full layer). With KV memory for 5.5 (gpt-oss) or 2.5
(Gemma 3) sequences of max-model-len, int(max_concurrency) sequences run to
max-model-len together with no preemption, holding exactly the plan's blocks at
their last step; one sequence more preempts. Prompts are at most one window
long and are prefilled in one step, so no chunk holds more than the window in a
sliding group; max-model-len is a few blocks past the window to keep the CPU
run short. The same accounting at the presets' full layer counts and other
lengths is checked at the scheduler level (tests/test_hybrid_scheduler.py).
"""

from __future__ import annotations

import json

import pytest
import torch

import kvforge
from kvforge import LLM, SamplingParams
from kvforge.planner.groups import sliding_window_blocks
from kvforge.spec.presets import PRESETS

SCALED = {
    # preset: (overrides, max model len, prompt tokens, sequences the memory holds)
    "gpt-oss-20b": (dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, intermediate_size=32,
                         num_local_experts=4, num_experts_per_tok=2, vocab_size=512), 256, 128, 5.5),
    "gemma-3-27b": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=16, intermediate_size=64,
                         vocab_size=512, layer_types=["sliding_attention", "full_attention"]), 1088, 1024, 2.5),
}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config_dir(tmp_path, name):
    overrides = SCALED[name][0]
    cfg = {**PRESETS[name], **overrides}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _engine(path, max_len, memory):
    return LLM(str(path), load_format="dummy", dtype="float32", skip_tokenizer_init=True, max_model_len=max_len,
               kv_cache_memory=memory, max_num_batched_tokens=4096, max_num_seqs=16, enable_prefix_caching=False,
               progress=False, device="cpu")


def _run(llm, n, max_len, prompt):
    """``n`` sequences of ``prompt`` tokens decoding to max_len; (preemptions, peak blocks, most sequences
    running at once)."""
    engine = llm.engine
    peak = running = 0
    inner = engine.scheduler.schedule

    def schedule():
        nonlocal peak, running
        out = inner()
        peak = max(peak, engine.block_manager.num_used_blocks)
        running = max(running, engine.scheduler.num_running)
        return out

    engine.scheduler.schedule = schedule
    reqs = [{"prompt_token_ids": [(i * 11 + j) % 500 for j in range(prompt)]} for i in range(n)]
    outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=max_len - prompt, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == max_len for o in outs)
    return engine.scheduler.num_preemptions, peak, running


@pytest.mark.parametrize("name", list(SCALED))
def test_planned_concurrency_is_what_the_engine_admits_at_max_model_len(tmp_path, name):
    path = _config_dir(tmp_path, name)
    _, max_len, prompt, seqs = SCALED[name]
    probe = kvforge.plan(str(path), dtype="float32", max_model_len=max_len, kv_cache_memory=10**9)
    memory = int(seqs * 10**9 / probe.max_concurrency)
    llm = _engine(path, max_len, memory)
    plan = llm.plan
    n = int(plan.max_concurrency)
    assert n == int(seqs)
    full = [g for g in plan.groups if g.kind == "full"]
    sliding = [g for g in plan.groups if g.kind == "sliding"]
    assert full and sliding and all(g.sliding_window < max_len for g in sliding)
    B = plan.block_size
    window_blocks = sum(sliding_window_blocks(g.sliding_window, B) for g in sliding)
    assert plan.state_bytes_per_sequence == window_blocks * plan.group_size * plan.groups[0].page_bytes
    assert llm.engine.pool.nbytes == plan.num_blocks * plan.group_size * plan.groups[0].page_bytes <= memory
    preempted, peak, running = _run(llm, n, max_len, prompt)
    assert preempted == 0 and running == n
    # At their last step every sequence holds max_len tokens in each full group and a window that is not
    # aligned to a block edge (max_len and the windows are multiples of the block size) in each sliding one.
    assert peak == n * (len(full) * max_len // B + window_blocks) <= plan.num_blocks
    llm = _engine(path, max_len, memory)
    preempted, _, running = _run(llm, n + 1, max_len, prompt)
    # One sequence more does not fit: it preempts another (short prompts, all admitted, then grown), or, when
    # the prompts are most of max-model-len, it waits until one finishes.
    assert preempted > 0 if prompt <= max_len // 2 else (preempted == 0 and running == n)
