"""``allowed_token_ids`` and ``logit_bias`` (kvforge/engine/token_biases.py) against a per-element
reference, in the sampler and through the engine.

Exactness: a bias is one float32 addition (the reference adds the same float32 values, so results are
equal), the allowed-set mask writes -inf, and untouched rows are copied: all compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.engine.sampler import Sampler
from kvforge.engine.token_biases import apply_token_biases
from kvforge.errors import InvalidRequestError

transformers = pytest.importorskip("transformers")

VOCAB = 256


def test_biases_and_allowed_sets_per_row():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logit_bias={3: 5.0, "7": -100}), SamplingParams(allowed_token_ids=[9, 2, 200]),
              SamplingParams(), SamplingParams(allowed_token_ids=[1, 3], logit_bias={3: 2.5, 4: 50})]
    got = apply_token_biases(logits, params)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] += -100.0
    want[1] = torch.full((VOCAB,), float("-inf"))
    want[1, [9, 2, 200]] = logits[1, [9, 2, 200]]
    want[3] = torch.full((VOCAB,), float("-inf"))
    want[3, 1] = logits[3, 1]
    want[3, 3] = logits[3, 3] + 2.5
    assert torch.equal(got, want)  # a masked token stays -inf whatever its bias (token 4)
    assert apply_token_biases(logits, [SamplingParams()] * 4) is logits


def test_params_store_a_hashable_sorted_bias_and_refuse_bad_values():
    p = SamplingParams(logit_bias={"10": 1, 2: -3.5}, allowed_token_ids=[])
    assert p.logit_bias == ((2, -3.5), (10, 1.0)) and p.allowed_token_ids is None
    hash(p)
    for bad in ({1: 101}, {-1: 1.0}, {"x": 1.0}, {1: "a"}, {1: True}):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(allowed_token_ids=[1, -2])
    assert err.value.field == "allowed_token_ids"


def test_sampler_greedy_and_random_rows_stay_inside_the_allowed_set():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = [17, 40, 41]
    params = [SamplingParams(temperature=t, seed=s, allowed_token_ids=allowed, logprobs=1)
              for t, s in ((0, None), (1.0, 1), (2.0, 2), (0.5, 3), (1.0, None), (5.0, 4))]
    out = Sampler().sample(logits, params)
    assert set(out.token_ids.tolist()) <= set(allowed)
    assert out.token_ids[0].item() == allowed[logits[0, allowed].argmax().item()]
    raw = torch.log_softmax(logits[0], -1)  # logprobs stay those of the raw logits
    assert out.logprobs[0][out.token_ids[0].item()] == pytest.approx(raw[out.token_ids[0]].item(), rel=1e-6)


def test_engine_forced_and_banned_tokens(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu", num_speculative_tokens=2)
    prompt = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}]
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(**base, logit_bias={99: 100}), use_tqdm=False)[0].outputs[0]
    assert list(forced.token_ids) == [99] * 8  # random logits of a tiny model are far below 100 apart
    banned = set(plain)
    kept = llm.generate(prompt, SamplingParams(**base, logit_bias={t: -100 for t in banned}), use_tqdm=False)
    assert not banned & set(kept[0].outputs[0].token_ids)
    only = llm.generate(prompt, SamplingParams(**base, allowed_token_ids=[1, 2]), use_tqdm=False)
    assert set(only[0].outputs[0].token_ids) <= {1, 2}
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as err:
        llm.generate(prompt, SamplingParams(**base, logit_bias={VOCAB: 1.0}), use_tqdm=False)
    assert err.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as err:
        llm.generate(prompt, SamplingParams(**base, stop_token_ids=[3, VOCAB]), use_tqdm=False)
    assert err.value.field == "stop_token_ids"
    for field, value in (("stop", 5), ("stop_token_ids", 7)):
        with pytest.raises(InvalidRequestError, match="expected a list") as err:
            SamplingParams(**{field: value})
        assert err.value.field == field


# ---- min_tokens -------------------------------------------------------------------------------------------


def test_min_tokens_excludes_stop_tokens_until_enough_output():
    logits = torch.zeros(4, VOCAB)
    params = [SamplingParams(min_tokens=3, stop_token_ids=[9]), SamplingParams(min_tokens=3, stop_token_ids=[9]),
              SamplingParams(min_tokens=3, ignore_eos=True), SamplingParams()]
    got = apply_token_biases(logits, params, num_generated=[2, 3, 0, 0], eos_token_ids={1, 2})
    inf = float("-inf")
    assert got[0, [1, 2, 9]].tolist() == [inf] * 3 and torch.isfinite(got[0]).sum() == VOCAB - 3
    assert torch.equal(got[1], logits[1])  # three output tokens already: stops allowed
    assert torch.equal(got[2], logits[2])  # EOS ignored, no stop ids: nothing to exclude
    assert torch.equal(got[3], logits[3])
    with pytest.raises(ValueError, match="count of output tokens"):
        apply_token_biases(logits, params)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert err.value.field == "min_tokens"


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_strings_wait_for_min_tokens():
    from kvforge.engine.detokenizer import IncrementalDetokenizer

    for min_tokens, want in ((0, "a"), (3, "aba"), (4, "ababa")):
        d = IncrementalDetokenizer(CharTokenizer(), [], stop=("b",), min_tokens=min_tokens)
        for ch in "ababab":
            d.add_tokens([ord(ch)])
        assert d.stopped_on == "b" and d.text == want, (min_tokens, d.text)


@pytest.mark.parametrize("engine_kw", [{}, dict(async_scheduling=True), dict(num_speculative_tokens=2)],
                         ids=["sync", "async", "speculative"])
def test_engine_min_tokens_holds_back_a_stop_token(tmp_path, engine_kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu", **engine_kw)
    prompt = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    stop = plain[1]
    first = plain.index(stop)
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]), use_tqdm=False)
    assert len(early[0].outputs[0].token_ids) == first + 1  # without min_tokens it stops at once
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=6),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
    assert held.finish_reason == "length" or held.token_ids[-1] == stop
