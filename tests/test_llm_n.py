"""``SamplingParams.n`` through ``LLM.generate``: one RequestOutput per prompt holding its ``n`` samples,
each its own engine request (``SamplingParams.sample_params``), the later samples reusing the first's
prompt blocks through the prefix cache. The embedded SmolLM2, float32 on CPU."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams
from kvforge.errors import InvalidRequestError

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made and read across Europe. Printers set each page by hand, letter by letter, and")


def test_sample_params_derive_the_seed_and_run_one_sequence():
    p = SamplingParams(n=3, seed=5, temperature=0.7)
    assert [(q.n, q.seed, q.temperature) for q in map(p.sample_params, range(3))] == [(1, 5, 0.7), (1, 6, 0.7),
                                                                                      (1, 7, 0.7)]
    assert SamplingParams(n=2, seed=(1 << 63) - 1).sample_params(1).seed == -(1 << 63)  # wraps at 64 bits
    assert SamplingParams(n=2).sample_params(1).seed is None
    with pytest.raises(ValueError):
        p.sample_params(3)


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", max_model_len=256, max_num_seqs=8, progress=False) as llm:
        yield llm


def test_generate_returns_n_samples_per_prompt_sharing_the_prompt_blocks(llm):
    engine = llm.engine
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    hits = engine.stats()["prefix_cache_hits"]
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert out.finished and out.prompt_token_ids == engine.tokenizer.encode(PROMPT)
    block = engine.block_manager.block_size
    full_blocks = (len(out.prompt_token_ids) - 1) // block
    assert full_blocks >= 2, "the prompt must span several blocks for this check"
    assert engine.stats()["prefix_cache_hits"] - hits >= 2 * full_blocks * block
    # Offline, the same call runs the same steps in the same order: the same samples, token for token.
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert engine.stats()["num_running"] == 0 and engine.stats()["kv_blocks_used"] == 0


def test_generate_mixes_n_per_prompt_in_prompt_order(llm):
    prompts = ["One, two, three,", {"prompt_token_ids": llm.engine.tokenizer.encode("Water boils at")}]
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    a, b = llm.generate(prompts, params, use_tqdm=False)
    assert [len(c.token_ids) for c in a.outputs] == [4, 4] and [c.index for c in a.outputs] == [0, 1]
    assert len(b.outputs) == 1 and len(b.outputs[0].token_ids) == 3


def test_the_engine_takes_one_sequence_per_request(llm):
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(n=2))
    assert err.value.field == "n" and "sample_params" in str(err.value)
