"""Qwen3-Next and Kimi-Linear at tensor-parallel size 2 on CPU (gloo, 2 processes) against transformers.

Tiny random checkpoints written by transformers (tests/tiny_checkpoints.py), float32, one torch thread per
process: Qwen3-Next with 2 key heads serving 4 value heads (each rank holds one key head and its two value
heads, so a split that ignored the per-key-head layout of ``in_proj_qkvz`` / ``in_proj_ba`` or the q | k | v
blocks of the conv would change the logits), 2 KV heads split, 6 experts split 3 + 3 with a shared expert;
Kimi-Linear with 4 KDA heads, 4 MLA heads (latent replicated), 8 experts in 4 groups and a shared expert.
Prefill chunks of 16 tokens, so state slots carry each rank's heads across steps.

Teacher-forced logits within ``1e-4 * max(1, max |hf|)``, the bound of the TP=1 engine test
(tests/test_linear_attention_engine_vs_hf.py): the sums of the row-parallel projections are split over two
ranks, a change of summation order far below it. Greedy tokens of a batch of prompts of different lengths
follow transformers' until a near-tie within that bound (tests/greedy_agreement.py). Every rank's state slots
take the plan's per-rank bytes (half the TP=1 state); the real Qwen3-Next-80B and Kimi-Linear-48B configs'
per-rank state layouts equal the plan's per-rank state bytes at TP 2; a repeated batch resumes from state
snapshots every rank copied; TP sizes that do not divide the linear
heads fail at the plan, before any weight loads.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins
from linear_attention_setup import CASES, ENGINE, one_torch_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import LINEAR_VOCAB as VOCAB  # noqa: E402
from tiny_checkpoints import make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.distributed.launcher import expected_pool_bytes  # noqa: E402
from kvforge.errors import KVForgeError  # noqa: E402

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 21, 1, 9)]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        run = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return run.sequences[0, len(prompt):].tolist(), top2_margins(torch.cat(run.logits).float().cpu())


@pytest.mark.parametrize("decode_path", ["eager", "static"])
@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_transformers(case, decode_path, tmp_path, engines, monkeypatch):
    """``static``: every rank's decode steps take the CUDA-graph path's static, padded inputs and slot buffers
    (run eagerly on CPU), rank 0 deciding per step and broadcasting the state slots."""
    hf, _ = make_checkpoint(case, tmp_path)
    if decode_path == "static":
        from kvforge.distributed import launcher

        monkeypatch.setattr(launcher, "RUNNER_OPTIONS", {"static_decode_on_cpu": True})  # sent to every rank
    llm = engines(tmp_path, tensor_parallel_size=2, enforce_eager=decode_path == "eager", max_num_seqs=4)
    engine = llm.engine
    prompts = _prompts()
    with torch.no_grad():
        tol = 1e-4 * max(1.0, max(hf(torch.tensor([p])).logits.abs().max().item() for p in prompts))
        ref = hf(torch.tensor([prompts[0]])).logits[0]

    ours = engine.compute_prompt_logits(prompts[0])  # chunks of 16, 16 and 5 tokens through one state slot
    diff = (ours - ref).abs().max().item()
    print(f"{case} TP=2: max |ours - hf| {diff:.3g} (bound {tol:.3g})")
    assert ours.shape == ref.shape and diff <= tol

    expected = [_hf_greedy(hf, p) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for k, (out, (want, margins)) in enumerate(zip(outs, expected)):
        assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol, what=f"{case} TP=2 prompt {k}")
    # The batch again: every prompt of more than one block resumes from its state snapshot (36, 20 and 8
    # tokens), which every rank copied for its own heads (rank 0 sends the copies with the next step).
    hits = engine.stats()["prefix_cache_hits"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for k, (out, (want, margins)) in enumerate(zip(outs, expected)):
        assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol, what=f"{case} TP=2 cached prompt {k}")
    assert engine.stats()["prefix_cache_hits"] - hits == 36 + 20 + 8
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    if decode_path == "static":
        c0, c1 = engine.rank_counters()
        assert c0["num_graph_steps"] > 0 and c1["num_graph_steps"] == c0["num_graph_steps"]

    # Every rank holds its half of the heads' state: the plan's per-rank bytes, half of TP=1's.
    plan = engine.plan
    state_layers = [lp for lp in plan.layers if lp.kind == "state"]
    layouts = engine.model.linear_state_layouts()
    for lp in state_layers:
        assert lp.state_bytes == layouts[lp.index].elements * 4  # float32 slots
    from kvforge.planner.inputs import CacheConfig, ParallelConfig
    from kvforge.planner.resolver import resolve

    tp1 = resolve(engine.spec, CacheConfig(kv_cache_dtype="auto", block_size=4, kv_cache_memory=1 << 21,
                                           max_model_len=128), ParallelConfig(1), "cpu", model_dtype="float32")
    assert [2 * lp.state_bytes for lp in state_layers] == [lp.state_bytes for lp in tp1.layers if lp.kind == "state"]
    for r in engine.tp.reports:
        assert r["state_bytes"] == {lp.index: lp.state_bytes for lp in state_layers}
        assert r["state_slots"] == plan.capacity.state_slots == engine.pool.state_slots
        assert r["nbytes"] == expected_pool_bytes(plan)


@pytest.mark.parametrize("case", CASES)
def test_tp2_dummy_weights_match_tp1(case, tmp_path, engines):
    """Dummy weights draw the TP=1 tensors and keep each rank's part (the conv's q | k | v blocks, Kimi's
    ``A_log [1, 1, H, 1]`` along its head dimension): the same model at both sizes, logits within
    ``1e-5 * max(1, max |tp1|)`` (the TP=1 vs TP=2 bound of tests/test_tp.py)."""
    make_checkpoint(case, tmp_path)
    prompt = _prompts()[0]
    a = engines(tmp_path, load_format="dummy", seed=3).engine.compute_prompt_logits(prompt)
    b = engines(tmp_path, load_format="dummy", seed=3, tensor_parallel_size=2).engine.compute_prompt_logits(prompt)
    assert a.shape == b.shape and a.abs().max().item() > 0
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_transformers_on_two_gpus(case, tmp_path, engines):
    """float32 on 2 GPUs over NCCL: the state slots on the Triton kernels, decode steps replaying CUDA graphs
    whose all-reduces are captured (dense-MLP variants: a MoE decode needs grouped GEMMs to be captured); greedy
    tokens follow transformers' float32 greedy on CUDA until a near-tie within 1e-4 * max |logit|."""
    dense = {"qwen3-next": dict(num_experts=0, head_dim=32), "kimi-linear": dict(mlp_layer_types=["dense"] * 4)}[case]
    hf, _ = make_checkpoint(case, tmp_path, **dense)
    hf = hf.cuda()
    llm = engines(tmp_path, device="cuda", tensor_parallel_size=2, enforce_eager=False, max_num_seqs=8,
                  block_size=16)
    assert llm.engine.runner.graphs is not None, llm.engine.runner.graphs_off_reason
    prompts = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0].float().cpu()
        tol = 1e-4 * max(1.0, max(hf(torch.tensor([p], device="cuda")).logits.abs().max().item() for p in prompts))
    ours = llm.engine.compute_prompt_logits(prompts[0]).cpu()
    assert (ours - ref).abs().max().item() <= tol
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for k, (out, p) in enumerate(zip(outs, prompts)):
        want, margins = _hf_greedy(hf, p)
        assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol, what=f"{case} TP=2 CUDA prompt {k}")
    c0, c1 = llm.engine.rank_counters()
    assert c0["num_graph_steps"] > 0 and c1["num_graph_steps"] == c0["num_graph_steps"]


@pytest.mark.parametrize("name,heads", [("qwen3-next-80b-a3b", {"linear_num_key_heads": 16,
                                                                  "linear_num_value_heads": 32}),
                                        ("kimi-linear-48b-a3b", {"linear_num_heads": 32})])
def test_full_size_per_rank_state_matches_the_plan(name, heads):
    """The real configs at TP 2: each rank's model (built on the meta device, no weights) reports state layouts
    whose slots take exactly the plan's per-rank state bytes, and a pool of the plan allocates them."""
    from kvforge.distributed.group import TPGroup
    from kvforge.distributed.tp_models import TP_MODELS
    from kvforge.engine.kv_pool import KVPool
    from kvforge.planner.inputs import CacheConfig, ParallelConfig
    from kvforge.planner.resolver import resolve
    from kvforge.spec.architectures import spec_from_hf_config
    from kvforge.spec.presets import PRESETS

    config = dict(PRESETS[name])
    spec = spec_from_hf_config(config, name=name, source="test")
    plan = resolve(spec, CacheConfig(kv_cache_dtype="bf16", kv_cache_memory=8 << 30, max_model_len=4096),
                   ParallelConfig(2), "cuda", model_dtype="bfloat16")
    state = {lp.index: lp.state_bytes for lp in plan.layers if lp.kind == "state"}
    tp1 = resolve(spec, CacheConfig(kv_cache_dtype="bf16", kv_cache_memory=8 << 30, max_model_len=4096),
                  ParallelConfig(1), "cuda", model_dtype="bfloat16")
    assert all(2 * state[lp.index] == lp.state_bytes for lp in tp1.layers if lp.kind == "state")
    hpr, kvpr = next((lp.heads_per_rank, lp.kv_heads_per_rank) for lp in plan.layers if lp.kind != "state")
    arch = config["architectures"][0]
    for rank in range(2):
        group = TPGroup(rank, 2, "gloo", torch.device("meta"), 1.0)
        with torch.device("meta"):
            model = TP_MODELS[arch](config, torch.bfloat16, group, hpr, kvpr)
        layouts = model.linear_state_layouts()
        assert {i: lay.elements * 4 for i, lay in layouts.items()} == state  # float32 slots (--state-dtype auto)
        assert {key: getattr(model.args, key) for key in heads} == {key: n // 2 for key, n in heads.items()}
        pool = KVPool(plan, torch.device("meta"), layouts)
        assert pool.nbytes == expected_pool_bytes(plan)
        ls = pool.linear_states
        assert {i: ls.conv[i][0].nbytes + ls.recurrent[i][0].nbytes for i in ls.conv} == state


@pytest.mark.parametrize("case,tp,names", [("qwen3-next", 4, ["linear_num_key_heads 2", "linear_num_value_heads 4"]),
                                           ("kimi-linear", 3, ["linear_num_heads 4"])])
def test_tp_not_dividing_the_linear_heads_fails_before_weights(case, tp, names, tmp_path, engines, monkeypatch):
    make_checkpoint(case, tmp_path, **({"num_attention_heads": 4, "num_key_value_heads": 4} if case == "qwen3-next"
                                       else {"num_attention_heads": 3, "num_key_value_heads": 3}))
    import kvforge.weights

    def no_weights(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(kvforge.weights, "load_weights", no_weights)
    with pytest.raises(KVForgeError) as err:
        engines(tmp_path, tensor_parallel_size=tp)
    msg = str(err.value)
    assert f"--tensor-parallel-size {tp} does not divide" in msg and "TP sizes that split this whole model: " in msg
    assert any(n in msg for n in names)


@pytest.mark.parametrize("case,tp,overrides,name", [("qwen3-next", 2, {"num_experts": 3}, "num_experts 3"),
                                                    ("kimi-linear", 4, {"num_experts": 6, "num_expert_group": 2, "topk_group": 1},
                                                     "num_experts 6")])
def test_tp_not_dividing_the_experts_fails_before_any_worker_starts(case, tp, overrides, name, tmp_path, engines,
                                                                    monkeypatch):
    """The TP class's own split checks run on rank 0 before it starts a worker process (the plan checks the
    heads; experts and MLP sizes are the family's rule)."""
    make_checkpoint(case, tmp_path, **overrides)
    import kvforge.distributed.launcher as launcher

    class NoWorkers:
        @staticmethod
        def Popen(*a, **k):
            raise AssertionError("a worker process was started")

    monkeypatch.setattr(launcher, "subprocess", NoWorkers)
    with pytest.raises(KVForgeError, match=f"--tensor-parallel-size {tp} does not divide {name}"):
        engines(tmp_path, tensor_parallel_size=tp)
