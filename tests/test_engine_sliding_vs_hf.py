"""Sliding-window KV-cache groups through the whole engine, against transformers (float32, CPU).

The engine frees a sliding group's blocks once their tokens leave the window,
so these runs use prompts 3-4x the window, block size 4 (a window of 16 spans
4-5 blocks), prefill chunks that end inside the window rather than on its edge,
and a second round whose prompts hit the prefix cache. Greedy tokens must
equal transformers' greedy tokens on the whole sequence (ties are not an issue
for these random models: the top-2 logit gap is checked). Models: a tiny
Mistral with a sliding window on every layer (one sliding group).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.planner.groups import sliding_window_blocks  # noqa: E402

WINDOW = 16
BLOCK = 4
VOCAB = 256
NEW_TOKENS = 10


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mistral(path, head_dim=16):
    cfg = transformers.MistralConfig(hidden_size=4 * head_dim, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=head_dim, intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_greedy(hf, prompt, n):
    """Greedy continuation from full-sequence forwards (no cache), with the smallest top-2 logit gap."""
    toks, gap = list(prompt), float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([toks])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            toks.append(int(logits.argmax()))
    return toks[len(prompt):], gap


class _WindowWatch:
    """Wraps the engine's scheduler: after every schedule, records the most blocks any sequence holds in each
    sliding group, and that no table entry a query can see was freed."""

    def __init__(self, engine):
        self.engine = engine
        self.most = 0
        sched = engine.scheduler
        inner = sched.schedule

        def schedule():
            out = inner()
            bm = engine.block_manager
            for s in out.scheduled:
                seq = s.seq
                for g, w in enumerate(bm.group_windows):
                    if w is None:
                        continue
                    held = len(seq.block_tables[g]) - seq.num_skipped_blocks[g]
                    self.most = max(self.most, held)
                    assert seq.num_skipped_blocks[g] <= max(0, s.start_pos - w + 1) // bm.block_size
            return out

        sched.schedule = schedule


def _prompts():
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    return [stem + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 13)] + [
        torch.randint(0, VOCAB, (61,), generator=g).tolist()]


def static_decode_runner(engine):
    """A runner whose decode steps take the CUDA-graph path's static, padded per-group inputs (eager on CPU)."""
    from kvforge.engine.model_runner import ModelRunner

    return ModelRunner(engine.model, engine.pool, engine.plan, engine.device, enforce_eager=False,
                       max_num_seqs=engine.scheduler.max_num_seqs, static_decode_on_cpu=True)


@pytest.mark.parametrize("decode_path", ["eager", "static"])
def test_mistral_sliding_window_greedy_equals_transformers_with_chunks_and_prefix_hits(tmp_path, decode_path):
    hf = _mistral(tmp_path)
    # Budget 23: prefill chunks end at positions that are not block or window edges.
    llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, skip_tokenizer_init=True, kv_cache_memory=1 << 22,
              max_num_batched_tokens=23, enable_prefix_caching=True, progress=False, device="cpu", max_num_seqs=4)
    engine = llm.engine
    if decode_path == "static":
        engine.runner = static_decode_runner(engine)
    assert [g.kind for g in llm.plan.groups] == ["sliding"] and engine.block_manager.group_windows == (WINDOW,)
    watch = _WindowWatch(engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    want = []
    for p in prompts:
        toks, gap = _hf_greedy(hf, p, NEW_TOKENS)
        assert gap > 1e-3
        want.append(toks)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == want
    assert engine.block_manager.prefix_cache_hits > 0  # the second prompt shares 48 tokens with the first
    # A chunk of n tokens holds the window plus the chunk for its step: never all of a 60-token prompt.
    assert watch.most <= sliding_window_blocks(WINDOW, BLOCK, 23) < -(-70 // BLOCK)
    # Second round: every prompt is cached up to its last block.
    hits = engine.block_manager.prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert engine.block_manager.num_evictions == 0
    assert engine.block_manager.prefix_cache_hits - hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert engine.block_manager.num_used_blocks == 0
    if decode_path == "static":
        assert engine.runner.num_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_mistral_sliding_window_on_cuda_eager_and_graphs(tmp_path, enforce_eager):
    """Triton paged attention over a sliding group whose early blocks are freed and reused, decode steps as
    CUDA-graph replays (per-group block tables in the static buffers) or eager: greedy equals transformers."""
    hf = _mistral(tmp_path, head_dim=32)  # the Triton kernel's smallest head size
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 24,
              max_num_batched_tokens=23, progress=False, device="cuda", max_num_seqs=4,
              enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    want = [_hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert {layer.backend for layer in llm.plan.layers} == {"triton_paged"}
    counters = llm.engine.rank_counters()[0]
    assert (counters["num_graph_steps"] > 0) == (not enforce_eager), counters
