"""Speculative method mtp at tensor parallelism 2 on CPU (gloo, 2 processes): every rank runs its slice of the
checkpoint's MTP layer (DeepSeek-V3: MLA heads, experts, its own embedding and head vocab-parallel;
Qwen3-Next: gated-attention heads and experts, reading the model's vocab-parallel embedding and head) on
its own copies of the target's hidden states and the head inputs, and the proposal logits reach rank 0.

References: the TP=1 engine. Greedy tokens with MTP at TP=2 follow TP=1 without speculation (near-tie rule of
tests/greedy_agreement.py: the all-reduces change the summation order, ``FP32_LOGIT_TOL`` as in the TP=1 MTP
tests). The logits of every proposal at TP=2 equal TP=1's within ``1e-4 * max(1, max |logit|)`` (float32
sums in another order, far below it), one request at a time so both engines make the same calls, until a
proposal's top two logits come within that bound (a near-tie may pick another proposal there). A
checkpoint whose MTP layer computes the target's own next-token function has every proposal accepted at
TP=2 as at TP=1.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree, top2_margins
from linear_attention_setup import one_torch_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from mtp_checkpoint import save_deepseek_v3_with_mtp  # noqa: E402
from qwen3_next_mtp_checkpoint import save_qwen3_next_with_mtp  # noqa: E402
from test_mtp_engine import PROMPTS  # noqa: E402
from test_mtp_engine import _target_function_checkpoint as deepseek_target_function  # noqa: E402

from kvforge import SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
SAVE = {"deepseek-v3": save_deepseek_v3_with_mtp, "qwen3-next": save_qwen3_next_with_mtp}
MTP = {"method": "mtp", "num_speculative_tokens": 2, "backoff": False}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def _record_proposal_logits(engine) -> list[torch.Tensor]:
    """Every logits tensor rank 0's MTP runner returns from here on (first and later proposals)."""
    seen = []
    runner = engine.draft_runner
    for name in ("mtp_first", "mtp_next"):
        call = getattr(runner, name)

        def wrapped(*args, _call=call):
            logits = _call(*args)
            seen.append(logits.clone())
            return logits

        setattr(runner, name, wrapped)
    return seen


@pytest.mark.parametrize("case", sorted(SAVE))
def test_tp2_proposals_and_output_match_tp1(case, tmp_path, engines):
    SAVE[case](tmp_path)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    want = engines(tmp_path).generate(reqs, GREEDY, use_tqdm=False)
    one = engines(tmp_path, speculative_config=MTP, enable_prefix_caching=False)
    two = engines(tmp_path, speculative_config=MTP, enable_prefix_caching=False, tensor_parallel_size=2)
    assert_outputs_agree(two.generate(reqs, GREEDY, use_tqdm=False), want, FP32_LOGIT_TOL)
    assert two.engine.stats()["spec_decode"]["num_draft_tokens"] >= 20

    compared = 0
    for req in reqs:  # one request at a time: both engines run the same steps while their proposals agree
        seen = [_record_proposal_logits(llm.engine) for llm in (one, two)]
        for llm in (one, two):
            llm.generate([req], GREEDY, use_tqdm=False)
        for got, ref in zip(seen[1], seen[0]):
            assert got.shape == ref.shape
            tol = 1e-4 * max(1.0, ref.abs().max().item())
            assert (got - ref).abs().max().item() <= tol, f"{case}: proposal logits differ beyond {tol:.3g}"
            compared += 1
            if min(top2_margins(ref)) <= tol:
                break  # a near-tie: the proposals (and every later call) may differ from here
        for llm in (one, two):  # the recording wrappers go; a fresh set for the next request
            for name in ("mtp_first", "mtp_next"):
                del llm.engine.draft_runner.__dict__[name]
    assert compared >= 10, compared


def test_tp2_accepts_every_proposal_of_an_mtp_layer_that_computes_the_target(tmp_path, engines):
    """DeepSeek-V3's MTP layer with its own embedding and head (split by vocabulary at TP=2) set to compute
    the target's next-token function (tests/test_mtp_engine.py): every greedy proposal is accepted."""
    save_deepseek_v3_with_mtp(tmp_path)
    deepseek_target_function(tmp_path)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engines(tmp_path).generate(reqs, plain, use_tqdm=False)]
    two = engines(tmp_path, speculative_config=MTP, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two.generate(reqs, plain, use_tqdm=False)] == want
    counters = two.engine.stats()["spec_decode"]
    assert counters["num_draft_tokens"] >= 20, counters
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters
