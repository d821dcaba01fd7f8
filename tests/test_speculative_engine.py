"""Speculative decoding in the engine: greedy output identical to speculation off, token for token.

Speculation off is the reference (that path is checked against transformers in
tests/test_engine_vs_hf.py). Exact token equality holds because verification keeps exactly the
tokens the target's argmax gives; only the float summation order of a batch changes, which moves
logits in the last bits and could flip a near-tie (none occurs for these fixed prompts and seeds).
Every case also checks the rollback invariants after each step: a sequence holds exactly the blocks
of its computed tokens, and every block registered in the prefix cache hashes real tokens only.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.engine.block_manager import block_hash
from kvforge.engine.scheduler import Scheduler
from kvforge.speculative.ngram import NgramProposer

transformers = pytest.importorskip("transformers")

TEXT = ("The quick brown fox jumps over the lazy dog. The early bird catches the worm. "
        "A stitch in time saves nine.")
REPEAT = f"Repeat this text exactly: {TEXT}\nRepeated: {TEXT}\nRepeated:"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class GarbageProposer:
    """Proposes uniformly random token ids (seeded): nearly every proposal is rejected."""

    def __init__(self, num_speculative_tokens: int, vocab_size: int, seed: int = 0):
        self.num_speculative_tokens, self.vocab_size = num_speculative_tokens, vocab_size
        self.rng = random.Random(seed)

    def propose(self, seqs):
        return [[self.rng.randrange(self.vocab_size) for _ in range(self.num_speculative_tokens)] for _ in seqs]


def check_rollback_invariants(engine) -> None:
    """After a step: blocks == blocks of the computed tokens; registered hashes are of real tokens."""
    bm = engine.block_manager
    running = list(engine.scheduler.running)
    bm.check_invariants(running + list(engine.scheduler.waiting))
    for seq in running:
        # Decoding, or computing its prompt (a preempted sequence recomputes its prompt and outputs, in chunks).
        assert seq.num_tokens - seq.num_computed_tokens == 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
            or seq.num_preemptions > 0
        if seq.num_tokens - seq.num_computed_tokens == 1:
            assert len(seq.block_tables[0]) == bm.blocks_needed(seq.num_computed_tokens), seq
        tokens, parent = seq.all_token_ids, None
        for i in range(seq.num_registered_blocks):
            parent = block_hash(parent, tokens[i * bm.block_size:(i + 1) * bm.block_size])
            for g, table in enumerate(seq.block_tables):
                if i >= seq.num_skipped_blocks[g]:
                    key = bm._block_hash[table[i]]
                    # None: another block already held this hash when it was registered (no dedup); that block
                    # may have been evicted since.
                    assert key is None or key == (g, parent), f"{seq}: block {i} hashes other tokens"


def generate(llm, prompts, params=GREEDY, check=True):
    """Step the engine to the end (checking the invariants after every step); outputs in prompt order."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p if isinstance(p, str) else list(p), params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check:
            check_rollback_invariants(engine)
    return [final[str(i)] for i in range(len(prompts))]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def embedded(**kw):
    return LLM(**{**dict(device="cpu", progress=False), **kw})


@pytest.fixture(scope="module")
def off():
    """The speculation-off reference engine of the embedded SmolLM2, shared by the tests of this module.
    Without prefix caching every reference run computes its prompts in full, exactly as a fresh engine
    (a cached prefix would change the float summation order of the reference)."""
    return embedded(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(off):
    """Speculation off, the embedded SmolLM2: REPEAT, a prose prompt, and a short one."""
    prompts = [REPEAT, "Write a short note about the sea.", "Count: one, two, three, four, five, six,"]
    return prompts, token_ids(generate(off, prompts))


def test_greedy_equal_and_proposals_accepted(reference):
    prompts, ref = reference
    llm = embedded(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    outs = generate(llm, prompts)
    assert token_ids(outs) == ref
    repeat = outs[0].speculative
    assert repeat.num_accepted_tokens > 0 and repeat.acceptance_rate > 0.5, repeat
    assert repeat.mean_accepted_length > 2.0
    stats = llm.engine.stats()
    assert stats["generation_tokens_total"] == sum(len(t) for t in ref)
    assert stats["num_steps"] < sum(len(t) for t in ref)  # accepted proposals saved steps
    counters = stats["spec_decode"]
    assert counters["num_accepted_tokens"] == sum(o.speculative.num_accepted_tokens for o in outs)
    assert counters["num_draft_tokens"] == sum(o.speculative.num_draft_tokens for o in outs)
    assert counters["accepted_per_pos"][0] >= counters["accepted_per_pos"][1] >= counters["accepted_per_pos"][2]
    assert sum(counters["accepted_per_pos"]) == counters["num_accepted_tokens"]


def test_garbage_proposals_change_nothing(reference):
    prompts, ref = reference
    llm = embedded(speculative_config={"num_speculative_tokens": 4, "backoff": False})  # verify every step
    llm.engine.proposer = GarbageProposer(4, llm.engine.spec.vocab_size)
    outs = generate(llm, prompts)
    assert token_ids(outs) == ref
    counters = llm.engine.stats()["spec_decode"]
    assert counters["num_draft_tokens"] > 50
    assert counters["num_accepted_tokens"] / counters["num_draft_tokens"] < 0.05


def test_fp8_kv_cache():
    prompts = [REPEAT, "Count: one, two, three, four, five, six,"]
    ref = token_ids(generate(embedded(kv_cache_dtype="fp8"), prompts))
    outs = generate(embedded(kv_cache_dtype="fp8", num_speculative_tokens=3), prompts)
    assert token_ids(outs) == ref
    assert outs[0].speculative.num_accepted_tokens > 0


def test_chunked_prefill_and_preemption(monkeypatch):
    # A 48-token budget chunks the prompts and truncates proposals next to prefill chunks; a pool of a
    # few blocks preempts (recompute) while sequences hold proposals' blocks.
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    prompts = [REPEAT, TEXT + " " + TEXT, "Count: one, two, three, four, five, six,", REPEAT + " The"]
    # 10 blocks of 16 tokens x 46080 bytes (30 layers x K and V x 3 KV heads x 64 x fp32) for four requests of
    # ~80 tokens each.
    kw = dict(max_num_batched_tokens=48, block_size=16, max_model_len=128, kv_cache_memory=10 * 16 * 46080)
    off = embedded(**kw)
    ref = token_ids(generate(off, prompts))
    on = embedded(num_speculative_tokens=5, **kw)
    outs = generate(on, prompts)
    assert token_ids(outs) == ref
    assert on.engine.stats()["num_preemptions"] > 0
    assert on.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_stop_token_inside_accepted_proposals(off):
    # "." ends the request: it is usually an accepted proposal in the middle of a step's tokens.
    stop = off.engine.tokenizer.encode(" dog.")[-1]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    ref = token_ids(generate(off, [REPEAT], params))
    outs = generate(embedded(num_speculative_tokens=4), [REPEAT], params)
    assert token_ids(outs) == ref and ref[0][-1] == stop
    assert outs[0].outputs[0].finish_reason == "stop"


def test_max_tokens_limits_proposals(off):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = token_ids(generate(off, [REPEAT], params))
    on = embedded(num_speculative_tokens=6)
    assert isinstance(on.engine.proposer, NgramProposer)  # n-gram is the default method
    outs = generate(on, [REPEAT], params)
    assert token_ids(outs) == ref and len(ref[0]) == 5


def test_logprobs_match_speculation_off(off):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = generate(off, [REPEAT], params)[0].outputs[0]
    out = generate(embedded(num_speculative_tokens=3), [REPEAT], params)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    assert len(out.logprobs) == len(ref.logprobs) == 12
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for t in a:  # float32 logits of one row computed in batches of different shapes
            assert abs(a[t] - b[t]) <= 1e-4


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = token_ids(generate(embedded(num_speculative_tokens=3), [REPEAT], params))
    b = token_ids(generate(embedded(num_speculative_tokens=3), [REPEAT], params))
    assert a == b and len(a[0]) == 16


# ---- tiny random models (transformers save_pretrained) ---------------------------------------------------

LLAMA = ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                                 max_position_embeddings=256, rms_norm_eps=1e-5))
DEEPSEEK = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256, max_position_embeddings=256,
    rms_norm_eps=1e-5, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    rope_scaling=None))
TINY_PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 61)), [9, 9, 3, 9, 9, 3, 9, 9]]


def save_tiny(path, case):
    cfg_cls, model_cls, kw = case
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("backoff,async_scheduling,budget", [(False, False, 16), (True, False, 16), (True, False, 512),
                                                              (True, True, 512), (False, True, 512)])
def test_each_seeded_sample_is_reproducible_on_its_own(tmp_path, backoff, async_scheduling, budget):
    """Sample j of an n-sample request with seed s draws what a request of its own with seed s + j draws, under
    speculation too, while the step budget verifies every proposal and nothing is preempted. At a 16-token
    budget the samples' prompts are cut, and a prompt whose chunks leave its last token for a step of its own
    gets no proposals there: each first token comes from a plain step, as a lone request's does. With the
    back-off a sample probes by its own output count (n-gram proposals over these tokens mostly fail, so
    several back off). Under async scheduling a lone request's first token is still in flight when a forked
    sample's is resolved: both propose from output token 1 on."""
    path = save_tiny(tmp_path, LLAMA)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "backoff": backoff}
    llm = embedded(model=path, dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=budget,
                   speculative_config=ngram, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in [*TINY_PROMPTS, [11, 12, 13, 14, 15] * 5 + [11, 12]]]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=9, n=3, ignore_eos=True)
    for i, prompt in enumerate(prompts):  # one at a time: 3 samples verify 12 rows, within either budget
        together = llm.generate([prompt], params, use_tqdm=False)[0]
        for j, sample in enumerate(together.outputs):
            alone = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=9 + j, ignore_eos=True)
            assert sample.token_ids == llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids, (i, j)
    spec = llm.engine.stats()["spec_decode"]
    assert spec["num_drafts"] > 0


@pytest.mark.parametrize("case", ["llama", "deepseek"])
def test_tiny_random_models(tmp_path, case):
    path = save_tiny(tmp_path, LLAMA if case == "llama" else DEEPSEEK)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = token_ids(generate(LLM(path, **kw), TINY_PROMPTS, params))
    on = LLM(path, num_speculative_tokens=3, **kw)
    outs = generate(on, TINY_PROMPTS, params)
    assert token_ids(outs) == ref
    assert on.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


RING = dict(architectures=["CsaRingTestForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=128, ring_rows=7,
            ring_row_bytes=256, max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="float32")


@pytest.mark.parametrize("k", [2, 6])
def test_ring_model(tmp_path, k):
    """Greedy equality, and each request's ring holds the rows of its last ring_rows computed positions
    when it finishes (rejected proposals wrote rows too; the plan's k extra rows keep them apart)."""
    from kvforge.engine.state_slots import StateSlots

    (tmp_path / "config.json").write_text(json.dumps(RING))
    kw = dict(load_format="dummy", dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 21,
              max_model_len=256, max_num_seqs=3, progress=False, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = token_ids(generate(LLM(str(tmp_path), **kw), TINY_PROMPTS, params))
    on = LLM(str(tmp_path), num_speculative_tokens=k, **kw)
    R = RING["ring_rows"] + k
    pool = on.engine.pool
    assert on.engine.runner.ring_rows == R
    pool.buffer.fill_(0xAB)  # a sentinel: ring bytes past the R rows must keep it
    captured, original = {}, StateSlots.release

    def spy(self, request_id):
        slot = self.held.get(request_id)
        if slot is not None:
            captured[request_id] = [page[slot].clone() for page in pool.ring_pages]
        return original(self, request_id)

    StateSlots.release = spy
    try:
        outs = generate(on, TINY_PROMPTS, params)
    finally:
        StateSlots.release = original
    assert token_ids(outs) == ref
    assert on.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    model, rb = on.engine.model, RING["ring_row_bytes"]
    attention_bytes = pool.num_blocks * on.plan.group_size * pool.page_bytes
    rings = pool.buffer[attention_bytes:].view(len(pool.ring_pages), pool.state_slots, -1)
    assert bool((rings[:, :, R * rb:] == 0xAB).all()), "a ring write went past its R rows"
    assert bool((rings[:, :, (R - 1) * rb:R * rb] != 0xAB).any()), "the plan's speculative rows were never used"
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids[:-1]
        seen = {}
        hooks = [m.register_forward_hook(lambda mod, a, o, i=i, seen=seen: seen.__setitem__(i, o.detach().clone()))
                 for i, m in enumerate(model.ring_proj)]
        try:
            on.engine.compute_prompt_logits(tokens)
        finally:
            for h in hooks:
                h.remove()
        for layer, page in enumerate(captured[out.request_id]):
            ring = page[: R * rb].view(torch.float32).view(R, rb // 4)
            for p in range(len(tokens) - RING["ring_rows"], len(tokens)):
                torch.testing.assert_close(ring[p % R], seen[layer][p], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["gemma3", "gpt-oss"])
def test_sliding_window_models(tmp_path, case):
    """Sliding-window groups free blocks that leave the window while proposals come and go; block size 4
    and a 16-token window make that happen every few steps."""
    from tiny_checkpoints import make_checkpoint

    make_checkpoint(case, tmp_path)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = token_ids(generate(LLM(str(tmp_path), **kw), TINY_PROMPTS, params))
    # Unigram matches too: these random models repeat their context less than the others.
    on = LLM(str(tmp_path), speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5, "backoff": False},
             **kw)
    assert token_ids(generate(on, TINY_PROMPTS, params)) == ref
    assert on.engine.stats()["spec_decode"]["num_accepted_tokens"] > 0

