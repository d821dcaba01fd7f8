"""Speculative method mtp in the engine (a tiny random DeepSeek-V3 with an MTP layer, CPU): greedy output
equal to speculation off at k = 1 and 3, float32 and bfloat16, model-dtype and fp8 KV caches, chunked
prefill; the rollback invariants after every step (tests/test_speculative_engine.py).

Verification keeps exactly the tokens of the target's argmax, but the verify step's batch shape changes
the summation order, which can flip a near-tie: tokens are compared by the near-tie rule of
tests/greedy_agreement.py, with the tolerance of tests/test_speculative_gpu.py (FP32_LOGIT_TOL in
float32; 8 bf16 steps at the largest |logit| in bfloat16, 4x that with an fp8 KV cache). Random MTP
weights guess the target's tokens rarely, so these cases mostly test rejection; ``test_mtp_that_computes_the_target_is_accepted`` builds a checkpoint whose MTP layer
computes the target's own next-token function, where every greedy proposal must be accepted.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree
from mtp_checkpoint import save_deepseek_v3_with_mtp
from proposer_reads import count_propose_reads
from safetensors.torch import load_file, save_file
from test_speculative_engine import generate, token_ids

from kvforge import LLM, SamplingParams

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 61)), [9, 9, 3, 9, 9, 3, 9, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(path, k=0, **kw):
    base = dict(block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False, device="cpu",
                max_num_batched_tokens=16)
    if k:
        base["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "backoff": False}
    return LLM(str(path), **{**base, **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    save_deepseek_v3_with_mtp(path)
    return path


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto"),
                                      ("bfloat16", "fp8")])
def test_greedy_agrees_with_speculation_off(checkpoint, dtype, kv):
    assert_mtp_agrees_with_speculation_off(_llm, checkpoint, dtype, kv, mtp_layer=2)


def assert_mtp_agrees_with_speculation_off(make_llm, checkpoint, dtype: str, kv: str, mtp_layer: int) -> None:
    """Greedy output with MTP proposals at k = 1 and 3 against speculation off (``make_llm(path, k, **kw)``), by
    the near-tie rule; the plan's proposer layer is ``mtp_layer`` and proposals were verified."""
    # A 16-token budget chunks the 24- and 31-token prompts and truncates proposals next to prefill chunks.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    off = make_llm(checkpoint, dtype=dtype, kv_cache_dtype=kv)
    ref = generate(off, PROMPTS, params)
    tol = FP32_LOGIT_TOL
    if dtype == "bfloat16":
        tol = max(1.0, off.engine.compute_prompt_logits(PROMPTS[1]).abs().max().item()) * 2.0**-5
        tol *= 4 if kv == "fp8" else 1
    for k in (1, 3):
        llm = make_llm(checkpoint, k, dtype=dtype, kv_cache_dtype=kv)
        assert [layer.index for layer in llm.engine.plan.draft.layers] == [mtp_layer]
        assert_outputs_agree(generate(llm, PROMPTS, params), ref, tol)
        counters = llm.engine.stats()["spec_decode"]
        assert counters["num_draft_tokens"] >= 20 * k  # proposals were made and verified



def assert_mtp_graph_path_agrees(make_llm, checkpoint, monkeypatch, k: int, all_accepted: bool) -> None:
    """The MTP layer's passes on the CUDA-graph path (the static, padded inputs and the previous-hidden rows
    its graphs read; run on CPU with ``static_decode_on_cpu``, as the target's decode steps): each replayed
    pass equals the eager pass on the same inputs (float32, 1e-5 of the largest head input: one padded batch
    against another; a stale or misplaced hidden row, token or position moves it by far more, and the exact
    verification would hide it in the output), and the greedy output equals speculation off by the near-tie
    rule. Single-token passes (q = 1) replay and, with ``all_accepted``, the observed rows of a fully
    accepted step (q = 1 + k) too; three sequences pad to the graph of 4 rows (sizes 1, 2, 4, 8)."""
    from mtp_graph_passes import run_graph_passes_twice, use_static_graph_inputs

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = generate(make_llm(checkpoint), PROMPTS, params)

    use_static_graph_inputs(monkeypatch)
    llm = make_llm(checkpoint, k, cuda_graph_sizes=[1, 2, 4, 8])
    runner = llm.engine.draft_runner
    assert runner.graphs is not None and runner.graphs.query_lens == tuple(range(1, k + 2))
    passes = run_graph_passes_twice(runner)
    assert_outputs_agree(generate(llm, PROMPTS, params), ref, FP32_LOGIT_TOL)
    assert max(diff for _, _, diff in passes) <= 1e-5, passes
    stats = llm.engine.stats()
    assert stats["proposer_steps"]["graph"] == len(passes) > 0, stats
    assert any(n == 3 for n, _, _ in passes), passes  # padded to the graph of 4 rows
    assert any(q == 1 for _, q, _ in passes), passes
    if all_accepted:
        assert any(q == k + 1 for _, q, _ in passes), passes
        counters = stats["spec_decode"]
        assert counters["num_accepted_tokens"] == counters["num_draft_tokens"] >= 20, counters


def assert_mtp_graph_passes_of_every_query_length(make_llm, checkpoint, monkeypatch, k: int = 3) -> None:
    """Direct MTP passes of three sequences at every captured query length 1 .. 1 + k, random previous hidden
    rows and tokens, on the graph path's static, padded inputs (CPU) against the same passes run eagerly
    (tests/mtp_graph_passes.py): within 1e-5 of the largest head input, so a hidden row, token, position or
    KV slot out of place in a multi-row pass shows (an engine run replays multi-row passes only where every
    proposal is accepted)."""
    from mtp_graph_passes import run_graph_passes_twice, use_static_graph_inputs

    use_static_graph_inputs(monkeypatch)
    llm = make_llm(checkpoint, k, cuda_graph_sizes=[1, 2, 4, 8])
    runner = llm.engine.draft_runner
    passes = run_graph_passes_twice(runner)
    g = torch.Generator().manual_seed(5)
    hidden_size = runner.mtp_hidden.shape[1]
    for q in range(1, k + 2):
        # sequence i: positions 7 + 3 i .. 7 + 3 i + q - 1 over blocks of its own
        chunks = [(torch.randint(3, 100, (q,), generator=g).tolist(), 7 + 3 * i,
                   [list(range(1 + 8 * i, 9 + 8 * i)) for _ in range(runner.num_groups)]) for i in range(3)]
        hidden = torch.randn(3 * q, hidden_size, generator=g).to(runner.mtp_hidden.dtype)
        runner.run_mtp(chunks, hidden, list(range(3 * q)), logits=False)
    assert sorted(q for _, q, _ in passes) == list(range(1, k + 2)), passes
    assert all(n == 3 for n, _, _ in passes) and max(diff for _, _, diff in passes) <= 1e-5, passes


def _target_function_checkpoint(path) -> None:
    """Every attention output and MLP down projection of the target and of the MTP block is zero, so the
    target's next token is a function of the current token only: head(norm(embed(t))). The MTP layer is
    made to compute that same function of the token it reads: its embedding, output norm and head are the
    target's, ``enorm`` is 1 and ``eh_proj`` keeps the embedding half ([I, 0]); its output at position i
    is norm(embed(t_{i+1})), whose logits are exactly the target's at position i + 1."""
    tensors = {}
    for name in ("model.safetensors", "mtp.safetensors"):
        tensors.update(load_file(str(path / name)))
    for name, t in tensors.items():
        if "o_proj" in name or "down_proj" in name:
            tensors[name] = torch.zeros_like(t)
    h = tensors["model.norm.weight"].shape[0]
    mtp = "model.layers.2."
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[mtp + "enorm.weight"] = torch.ones(h)
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    main = {k: v.contiguous() for k, v in tensors.items() if not k.startswith(mtp)}
    save_file(main, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in tensors.items() if k.startswith(mtp)}, str(path / "mtp.safetensors"))


def test_mtp_that_computes_the_target_is_accepted(tmp_path):
    save_deepseek_v3_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    ref = token_ids(generate(_llm(tmp_path, dtype="float32"), PROMPTS))
    for k in (1, 3):
        llm = _llm(tmp_path, k, dtype="float32")
        outs = generate(llm, PROMPTS)
        assert token_ids(outs) == ref
        counters = llm.engine.stats()["spec_decode"]
        # Every proposal is the target's argmax (equal logits; a near-tie could only flip the last bits).
        assert counters["num_draft_tokens"] >= 20, counters
        assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters
        assert llm.engine.stats()["num_steps"] < 48 // k + 10  # 48 tokens in about 48 / (k + 1) decode steps



@pytest.mark.parametrize("target_function", [False, True])
def test_mtp_passes_on_the_graph_path(checkpoint, tmp_path, monkeypatch, target_function):
    """See :func:`assert_mtp_graph_path_agrees`; the MLA layer's verification metadata of q > 1 rows is the
    per-token form the graphs compute from their static buffers."""
    if target_function:
        save_deepseek_v3_with_mtp(tmp_path)
        _target_function_checkpoint(tmp_path)
        checkpoint = tmp_path
    assert_mtp_graph_path_agrees(lambda path, k=0, **kw: _llm(path, k, dtype="float32", **kw), checkpoint,
                                 monkeypatch, 2, all_accepted=target_function)



def test_sampled_proposals_reach_the_host_once_a_step(checkpoint, monkeypatch):
    """Each MTP pass reads the previous pass's proposals on the device; for sampled requests the proposer
    reads all of a step's proposals to the host once (one ``tolist`` of the proposer a propose call, with
    three passes)."""
    llm = _llm(checkpoint, 3, dtype="float32")
    reads, made = count_propose_reads(llm.engine.proposer, monkeypatch, ("mtp.py", "pick.py"))
    generate(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3))
    assert max(made) == 3 and {n for n, m in zip(reads, made) if m} == {1}, (reads, made)


@pytest.mark.parametrize("with_verification", [True, False])
def test_greedy_verify_steps_read_the_device_once(checkpoint, monkeypatch, with_verification):
    """Greedy proposals stay on the device until verification, which reads them with the target's argmax: one
    host read (``tolist`` of the engine's speculative path) a step that verifies proposals, two when the
    proposer reads them before the schedule (``READ_PROPOSALS_WITH_VERIFICATION`` off). Both ways run the same
    steps on the same ids (gathered on the device or copied from the host), so the outputs are equal, bitwise."""
    import kvforge.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "READ_PROPOSALS_WITH_VERIFICATION", with_verification)
    llm = _llm(checkpoint, 3, dtype="float32")
    engine, tolist = llm.engine, torch.Tensor.tolist
    reads, drafts = [], []
    step = engine.step

    def counted(self):
        if reads and sys._getframe(1).f_code.co_filename.endswith(
                ("mtp.py", "pick.py", "verify.py", "llm_engine.py", "device_proposals.py")):
            reads[-1] += 1
        return tolist(self)

    def counting_step():
        reads.append(0)
        before = engine.spec_counters.num_draft_tokens
        out = step()
        drafts.append(engine.spec_counters.num_draft_tokens - before)
        return out

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    engine.step = counting_step
    outputs = generate(llm, PROMPTS, GREEDY)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    verifying = [n for n, d in zip(reads, drafts) if d]
    assert len(verifying) >= 10 and set(verifying) == {1 if with_verification else 2}, (reads, drafts)
    monkeypatch.setattr(llm_engine, "READ_PROPOSALS_WITH_VERIFICATION", not with_verification)
    assert outputs == generate(_llm(checkpoint, 3, dtype="float32"), PROMPTS, GREEDY)


def test_unread_proposals_under_penalties_and_biases(checkpoint, tmp_path, monkeypatch):
    """Greedy requests with repetition, frequency and presence penalties and a logit bias: their proposals stay
    on the device until verification, which reads them first, since the penalized rows' histories hold them.
    The histories the sampler gets and the outputs equal those of the proposer reading its proposals before
    the schedule (``READ_PROPOSALS_WITH_VERIFICATION`` off; the same steps, so bitwise), and the output agrees
    with speculation off by the near-tie rule. An MTP layer that computes the target's (unpenalized) next
    token gets proposals accepted, so rows after a proposal decide tokens."""
    import kvforge.engine.llm_engine as llm_engine

    save_deepseek_v3_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, repetition_penalty=1.2,
                            frequency_penalty=0.7, presence_penalty=0.5, logit_bias={7: 2.0})
    ref = generate(_llm(tmp_path, dtype="float32"), PROMPTS, params)
    runs = {}
    for with_verification in (True, False):
        monkeypatch.setattr(llm_engine, "READ_PROPOSALS_WITH_VERIFICATION", with_verification)
        llm = _llm(tmp_path, 3, dtype="float32")
        sampler, histories = llm.engine.sampler, []
        processed = sampler.processed_logits

        def recorded(logits, params, hist, *args, histories=histories, processed=processed, **kw):
            histories.append([(list(p), list(o)) for p, o in hist])
            return processed(logits, params, hist, *args, **kw)

        sampler.processed_logits = recorded
        runs[with_verification] = (token_ids(generate(llm, PROMPTS, params)), histories)
        counters = llm.engine.stats()["spec_decode"]
        assert counters["num_accepted_tokens"] >= 10, counters
    assert runs[True] == runs[False]
    assert_outputs_agree(generate(_llm(tmp_path, 3, dtype="float32"), PROMPTS, params), ref, FP32_LOGIT_TOL)


def test_mtp_graph_passes_of_every_query_length(checkpoint, monkeypatch):
    """See :func:`assert_mtp_graph_passes_of_every_query_length` (the MLA layer's per-token metadata of
    multi-row passes)."""
    assert_mtp_graph_passes_of_every_query_length(lambda path, k=0, **kw: _llm(path, k, dtype="float32", **kw),
                                                  checkpoint, monkeypatch)


def test_dummy_weights_run_the_mtp_layer(tmp_path):
    """A config without weights (a preset's path): the MTP layer gets seeded random weights like the rest."""
    from mtp_checkpoint import DEEPSEEK_V3_MTP

    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3_MTP, "architectures": ["DeepseekV3ForCausalLM"]}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = generate(_llm(tmp_path, dtype="float32", load_format="dummy"), PROMPTS, params)
    llm = _llm(tmp_path, 2, dtype="float32", load_format="dummy")
    assert_outputs_agree(generate(llm, PROMPTS, params), ref, FP32_LOGIT_TOL)
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    mtp = llm.engine.model.mtp_layers["2"]
    assert 0.01 < mtp.eh_proj.weight.std().item() < 0.03  # drawn ~ normal(0, 0.02)


def test_sampled_proposals_hand_their_q_to_verification(tmp_path):
    """With the MTP layer computing the target's distribution (the construction above), q of each sampled
    proposal equals the target's p, so rejection sampling accepts every proposal: it would accept a
    proposal d only with probability p(d) if q were missing (a point mass) or another distribution."""
    save_deepseek_v3_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    llm = _llm(tmp_path, 3, dtype="float32")
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True, seed=11)
    generate(llm, PROMPTS, params)
    counters = llm.engine.stats()["spec_decode"]
    assert counters["num_draft_tokens"] >= 20
    # min(1, p/q) is 1 up to float rounding of two equal softmaxes
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters


def test_sampled_output_follows_the_target_distribution(checkpoint):
    """Random MTP weights (q far from p): the first two sampled tokens of many seeded requests follow the
    target's joint distribution p(t1) p(t2 | t1) (chi-square, p-value threshold of
    tests/test_rejection_sampling.py); t2 is a verified MTP proposal or the rejection's residual draw. A q
    handed over that is not the one the proposal was drawn from would bias it (a missing q would not:
    verifying a drawn proposal as a point mass is exact too, at lower acceptance, which the test above
    catches)."""
    from test_rejection_sampling import P_VALUE_THRESHOLD, chi_square_p_value

    prompt = PROMPTS[2]
    off = _llm(checkpoint, dtype="float32", max_num_batched_tokens=2048)
    temperature, top_k, n = 1.5, 3, 1800

    def probs(ids):
        logits = off.engine.compute_prompt_logits(ids)[-1].double() / temperature
        top = logits.topk(top_k)
        return top.indices.tolist(), torch.softmax(top.values, dim=-1)

    cells, want = {}, []
    first, p1 = probs(prompt)
    for a, pa in zip(first, p1):
        second, p2 = probs(prompt + [a])
        for b, pb in zip(second, p2):
            cells[(a, b)] = len(want)
            want.append(float(pa * pb))
    llm = _llm(checkpoint, 1, dtype="float32", max_num_batched_tokens=2048, max_num_seqs=256)
    engine = llm.engine
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                                                          ignore_eos=True, seed=i))
    counts = torch.zeros(len(want), dtype=torch.long)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[cells[tuple(out.outputs[0].token_ids[:2])]] += 1
    assert counts.sum() == n
    assert engine.stats()["spec_decode"]["num_draft_tokens"] >= n  # every t2 was a verified proposal
    assert chi_square_p_value(counts, torch.tensor(want)) > P_VALUE_THRESHOLD, (counts, want)


def test_preemption_recomputes_the_mtp_layer(checkpoint):
    """A pool of 16 blocks of 4 tokens for three requests of ~40 tokens each: requests are preempted and
    recomputed (the MTP layer's KV with them) while others hold proposals' blocks."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    memory = 16 * 4 * 3 * (32 + 8) * 4  # blocks x tokens x (2 target + 1 MTP layers) x latent row of float32
    ref = generate(_llm(checkpoint, dtype="float32"), PROMPTS, params)
    llm = _llm(checkpoint, 3, dtype="float32", kv_cache_memory=memory, max_model_len=64)
    assert llm.engine.plan.num_blocks == 16
    assert_outputs_agree(generate(llm, PROMPTS, params), ref, FP32_LOGIT_TOL)
    assert llm.engine.stats()["num_preemptions"] > 0


def test_chunked_prefill_writes_the_mtp_layer_of_every_prompt_position(checkpoint):
    """A 31-token prompt prefilled in chunks of 16: once its first token is sampled, the MTP layer's cache
    rows of positions 0 .. 30 (its proposer slot of the target's blocks) equal those of one unchunked MTP
    pass over the same prompt (float32; summation order differs, 1e-5 of the largest row value)."""
    prompt = PROMPTS[1]
    llm = _llm(checkpoint, 2, dtype="float32")
    engine = llm.engine
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.scheduler.requests["a"]
    while not seq.output_token_ids:
        engine.step()
    assert engine.stats()["num_steps"] == 2  # two prefill chunks
    cache, bs = engine.pool.draft_kv_caches[0], engine.pool.block_size
    table = seq.block_tables[0]
    got = torch.stack([cache[table[p // bs], p % bs] for p in range(len(prompt))])

    ref_engine = _llm(checkpoint, 2, dtype="float32", max_num_batched_tokens=64).engine
    tables = [[3, 9, 1, 6, 4, 8, 2, 7]]
    ref_engine.runner.run([(prompt, 0, tables)], [len(prompt) - 1])
    ref_engine.draft_runner.run_mtp([(prompt[1:] + seq.output_token_ids[:1], 0, tables)],
                                    ref_engine.runner.last_hidden, [len(prompt) - 1])
    ref_cache = ref_engine.pool.draft_kv_caches[0]
    want = torch.stack([ref_cache[tables[0][p // bs], p % bs] for p in range(len(prompt))])
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
