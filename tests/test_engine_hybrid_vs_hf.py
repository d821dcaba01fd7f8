"""The KV pool's groups under Gemma 3 and gpt-oss (sliding-window and full layers) in the engine, against
transformers on tiny random checkpoints (tests/tiny_checkpoints.py: 16-token window), float32 on CPU.

What this adds to tests/test_hybrid_engine_vs_hf.py: every step, no sequence
holds a sliding-group block that a query of the step can see yet was freed,
and none holds more than the window plus its chunk; a second round of the same
prompts resumes every prompt from its last full block (the sliding groups from
the window's blocks, their earlier blocks having been freed while the first
round ran); and decode steps through the CUDA-graph path's static per-group
inputs (run eagerly on CPU), and with overlapped scheduling. Block size 4, prefill chunks of 23 tokens (ending
inside the window), prompts 3-4x the window, batched. Greedy tokens follow
transformers' by the near-tie rule (tests/greedy_agreement.py).
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_greedy_agrees, top2_margins

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB, WINDOW, make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.engine.model_runner import ModelRunner  # noqa: E402
from kvforge.planner.groups import sliding_window_blocks  # noqa: E402

BLOCK = 4
NEW_TOKENS = 8
CHUNK = 23
ENGINE = dict(dtype="float32", block_size=BLOCK, skip_tokenizer_init=True, kv_cache_memory=1 << 22,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=True, progress=False, device="cpu",
              max_num_seqs=4)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hf_greedy(hf, prompt, n):
    """Greedy tokens from whole-sequence forwards (no cache) and the top-2 margin of every step."""
    toks, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([toks])).logits[0, -1:]
            margins += top2_margins(logits)
            toks.append(int(logits[0].argmax()))
    return toks[len(prompt):], margins


def _prompts():
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    return [stem + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 13)] + [
        torch.randint(0, VOCAB, (61,), generator=g).tolist()]


class _WindowWatch:
    """After every schedule: the most blocks any sequence holds in a sliding group, and no entry a query of
    the step can see is a freed one."""

    def __init__(self, engine):
        self.most = 0
        inner = engine.scheduler.schedule

        def schedule():
            out = inner()
            bm = engine.block_manager
            for s in out.scheduled:
                for g, w in enumerate(bm.group_windows):
                    if w is not None:
                        self.most = max(self.most, len(s.seq.block_tables[g]) - s.seq.num_skipped_blocks[g])
                        assert s.seq.num_skipped_blocks[g] <= max(0, s.start_pos - w + 1) // bm.block_size
            return out

        engine.scheduler.schedule = schedule


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, _ = make_checkpoint(request.param, path)
    prompts = _prompts()
    return request.param, path, prompts, [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts], hf


@pytest.mark.parametrize("decode_path", ["eager", "static", "async"])
def test_sliding_blocks_freed_and_prefix_hits_resume_from_the_window(checkpoint, engines, decode_path):
    """``async``: overlapped scheduling, so blocks leave the window while the step that computed their last
    token is still in flight."""
    family, path, prompts, want, _ = checkpoint
    llm = engines(path, async_scheduling=decode_path == "async")
    engine = llm.engine
    assert engine.async_scheduling == (decode_path == "async")
    sliding = [g for g in llm.plan.groups if g.kind == "sliding"]
    assert sliding and len(engine.block_manager.group_windows) == len(llm.plan.groups)
    if decode_path == "static":
        engine.runner = ModelRunner(engine.model, engine.pool, engine.plan, engine.device, enforce_eager=False,
                                    max_num_seqs=engine.scheduler.max_num_seqs, static_decode_on_cpu=True)
    watch = _WindowWatch(engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    bm = engine.block_manager
    for run in ("first", "prefix-cached"):
        hits = bm.prefix_cache_hits
        outs = llm.generate(reqs, params, use_tqdm=False)
        for k, (out, (tokens, margins)) in enumerate(zip(outs, want)):
            assert_greedy_agrees(out.outputs[0].token_ids, tokens, margins, FP32_LOGIT_TOL,
                                 what=f"{family} {decode_path} {run} request {k}")
    # The second round resumes every prompt from its last full block, in every group.
    assert bm.num_evictions == 0
    assert bm.prefix_cache_hits - hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    # A chunk of n tokens holds the window plus the chunk for its step, never a whole 61-token prompt.
    assert watch.most <= sliding_window_blocks(WINDOW, BLOCK, CHUNK) < -(-(61 + NEW_TOKENS) // BLOCK)
    assert bm.num_used_blocks == 0
    if decode_path == "static":
        assert engine.runner.num_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family,enforce_eager", [("gemma3", True), ("gemma3", False), ("gpt-oss", True)])
def test_groups_on_cuda_eager_and_graphs(tmp_path, engines, family, enforce_eager):
    """Triton paged attention over every group (Gemma 3: three sliding groups and a full one; gpt-oss: one
    of each, with sinks, eager: its MoE loop is not capturable), decode steps as CUDA-graph replays with one
    static block table and slot mapping per group, or eager: greedy follows transformers (float32 on the
    CPU), first round and prefix-cache round."""
    hf, _ = make_checkpoint(family, tmp_path, hidden_size=128, head_dim=32)  # the kernel's smallest head size
    llm = engines(tmp_path, device="cuda", block_size=16, enforce_eager=enforce_eager)
    assert {layer.backend for layer in llm.plan.layers} == {"triton_paged"}
    prompts = _prompts()
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for run in ("first", "prefix-cached"):
        outs = llm.generate(reqs, params, use_tqdm=False)
        for k, (out, (tokens, margins)) in enumerate(zip(outs, want)):
            assert_greedy_agrees(out.outputs[0].token_ids, tokens, margins, FP32_LOGIT_TOL,
                                 what=f"{family} cuda eager={enforce_eager} {run} request {k}")
    assert llm.engine.block_manager.prefix_cache_hits > 0
    counters = llm.engine.rank_counters()[0]
    assert (counters["num_graph_steps"] > 0) == (not enforce_eager), counters


def test_scoring_holds_the_window_per_chunk(checkpoint, engines):
    """compute_prompt_logits (the evaluators' path) takes blocks chunk by chunk and frees what leaves each
    window: at most the full groups' blocks plus window + chunk per sliding group; logits as transformers'."""
    _, path, prompts, _, hf = checkpoint
    llm = engines(path)
    engine, bm = llm.engine, llm.engine.block_manager
    used = []
    inner = engine.runner.run

    def run(*args, **kw):
        used.append(bm.num_used_blocks)
        return inner(*args, **kw)

    engine.runner.run = run
    prompt = prompts[2]  # 61 tokens: chunks of 23, 23, 15
    ours = engine.compute_prompt_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    full = sum(1 for w in bm.group_windows if w is None)
    sliding = len(bm.group_windows) - full
    assert len(used) == 3
    assert max(used) <= full * -(-61 // BLOCK) + sliding * sliding_window_blocks(WINDOW, BLOCK, CHUNK)
    assert used[-1] < len(bm.group_windows) * -(-61 // BLOCK)  # the sliding groups did not keep every block
    assert bm.num_used_blocks == 0
