"""Speculative verification steps through the CUDA-graph path (kvforge/engine/cuda_graphs.py, invariant 6).

A step in which every sequence verifies the same ``k`` proposals takes the graph path's static, padded
inputs: ``b`` sequences of ``1 + k`` query tokens each, padding sequences of ``1 + k`` tokens at block 0,
and for MLA layers per-token metadata derived from the static buffers. On CPU,
``DecodeGraphs(capture=False)`` runs those inputs eagerly, so these tests check the inputs themselves:
the outputs must agree with speculation off, eager (near-tie rule of tests/greedy_agreement.py: padding
changes the batch's summation order), with proposals that are partly right, so accepted runs, rejections
and full acceptance all happen. On CUDA the captured graphs are compared with speculation off.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree
from test_speculative_engine import DEEPSEEK, LLAMA, TINY_PROMPTS, save_tiny

from kvforge import LLM, SamplingParams
from kvforge.engine.cuda_graphs import DecodeGraphs

K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
KW = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
          max_model_len=128)


class OracleProposer:
    """Proposes the reference run's next ``k`` tokens, with the second one wrong on every third call of a
    sequence: accepted runs of 1, of ``k`` (then the target's bonus token), and rejections."""

    def __init__(self, k: int, reference: dict[tuple[int, ...], list[int]]):
        self.num_speculative_tokens, self.reference, self.calls = k, reference, {}

    def propose(self, seqs):
        out = []
        for seq in seqs:
            done = seq.num_tokens - seq.num_prompt_tokens
            ref = self.reference[tuple(seq.prompt_token_ids)]
            props = list(ref[done:done + self.num_speculative_tokens])
            props += [7] * (self.num_speculative_tokens - len(props))
            n = self.calls[seq.request_id] = self.calls.get(seq.request_id, 0) + 1
            if n % 3 == 0:
                props[1] = (props[1] + 1) % 256
            out.append(props)
        return out


def _run(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def _with_static_verify(llm):
    """Give ``llm``'s runner the graph path's static inputs (eager on CPU) and count verification steps."""
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_num_seqs=llm.engine.scheduler.max_num_seqs, capture=False,
                                 query_lens=(1, 1 + K))
    seen = []
    run = runner.graphs.run

    def spy(host):
        seen.append(host.max_query_len)
        return run(host)

    runner.graphs.run = spy
    return seen


@pytest.mark.parametrize("case", ["llama", "deepseek"])
def test_verify_steps_take_the_static_inputs(tmp_path, case):
    path = save_tiny(tmp_path, LLAMA if case == "llama" else DEEPSEEK)
    ref = _run(LLM(path, device="cpu", **KW), TINY_PROMPTS)
    on = LLM(path, device="cpu", num_speculative_tokens=K, **KW)
    on.engine.proposer = OracleProposer(K, {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(TINY_PROMPTS, ref)})
    seen = _with_static_verify(on)
    outs = _run(on, TINY_PROMPTS)
    assert_outputs_agree(outs, ref, FP32_LOGIT_TOL)
    spec = on.engine.stats()["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # acceptances and rejections
    assert seen.count(1 + K) >= 5, seen  # verification steps went through the static inputs
    assert on.engine.stats()["num_steps"] < sum(len(o.outputs[0].token_ids) for o in ref)


def test_mixed_proposal_counts_run_eagerly(tmp_path):
    """A step whose sequences verify different numbers of proposals is not a captured shape."""
    path = save_tiny(tmp_path, LLAMA)
    llm = LLM(path, device="cpu", num_speculative_tokens=K, **KW)
    graphs = DecodeGraphs(llm.engine.runner, max_num_seqs=4, capture=False, query_lens=(1, 1 + K))

    class Host:
        num_seqs, max_query_len = 2, 1 + K
        qsl = [0, 4, 6]

    assert not graphs.accepts(Host)
    Host.qsl = [0, 4, 8]
    assert graphs.accepts(Host)
    Host.max_query_len = 3
    assert not graphs.accepts(Host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_captured_verify_graphs_follow_speculation_off(tmp_path, model):
    """On CUDA (Triton paged / MLA backends: the tiny configs of tests/test_speculative_gpu.py, dummy
    weights; float32, bfloat16 for DeepSeek, whose float32 MoE is not capturable): verification steps replay
    their captured graphs and agree with speculation off (tolerance of tests/test_speculative_gpu.py)."""
    import json

    from test_speculative_gpu import DEEPSEEK as GPU_DEEPSEEK
    from test_speculative_gpu import LLAMA as GPU_LLAMA
    from test_speculative_gpu import _tolerance

    (tmp_path / "config.json").write_text(json.dumps(GPU_LLAMA if model == "llama" else GPU_DEEPSEEK))
    kw = dict(load_format="dummy", skip_tokenizer_init=True, kv_cache_memory=1 << 28, progress=False, device="cuda",
              max_num_seqs=8, dtype="float32" if model == "llama" else "bfloat16", max_model_len=256)
    prompts = [[5, 6, 7, 8] * 8, [9, 9, 3] * 10, list(range(40, 140))]
    off = LLM(str(tmp_path), **kw)
    ref = off.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    gpu = LLM(str(tmp_path), num_speculative_tokens=K, **kw)
    graphs = gpu.engine.runner.graphs
    assert graphs is not None and {q for _, _, q in graphs.graphs} == {1, 1 + K}
    gpu.engine.proposer = OracleProposer(K, {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)})
    seen = []
    run = graphs.run
    graphs.run = lambda host: (seen.append(host.max_query_len), run(host))[1]
    outs = gpu.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert_outputs_agree(outs, ref, _tolerance(off, kw["dtype"], "auto"))
    assert seen.count(1 + K) >= 5, seen
    spec = gpu.engine.stats()["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
