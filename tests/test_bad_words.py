"""vLLM's ``bad_words`` (kvforge/engine/bad_words.py): the ban rule against a brute-force reference over
every token, the sampler's bans, and greedy outputs of the embedded model against a step-by-step reference
that picks the most likely token that does not complete a bad word.

Exactness: a ban writes -inf and leaves every other logit as it was, so logits are compared exactly. The
greedy reference re-runs the whole text each step; its logits may differ from the engine's incremental ones
in the last bits, which changes nothing unless two tokens tie that closely (none does on these prompts).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import SamplingParams
from kvforge.engine.bad_words import banned_next_tokens, encode_bad_words
from kvforge.engine.sampler import Sampler
from kvforge.engine.token_biases import apply_token_biases
from kvforge.errors import InvalidRequestError


def _completes_a_word(words: list[tuple[int, ...]], output: list[int], token: int) -> bool:
    text = output + [token]
    return any(len(w) <= len(text) and tuple(text[len(text) - len(w):]) == w for w in words)


def test_banned_tokens_are_those_that_end_a_word_after_the_output():
    rng = random.Random(0)
    vocab = 6
    for _ in range(400):
        words = tuple({tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        want = {t for t in range(vocab) if _completes_a_word(list(words), output, t)}
        assert banned_next_tokens(words, output) == want, (words, output)


def test_words_are_encoded_as_written_and_after_a_space(smol_llm):
    tok = smol_llm(**ENGINE).get_tokenizer()

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    got = encode_bad_words(["Emma", "  Emma", "answer is:"], encode, tok.vocab_size)
    want = [tuple(encode("Emma")), tuple(encode(" Emma")), tuple(encode("answer is:")), tuple(encode(" answer is:"))]
    assert got == tuple(dict.fromkeys(want)) and len(got) == 4
    for word in ("  ", ""):
        with pytest.raises(InvalidRequestError, match="encodes to no tokens") as err:
            encode_bad_words([word], encode, tok.vocab_size)
        assert err.value.field == "bad_words"
    with pytest.raises(InvalidRequestError, match="outside the model's vocabulary of 100 tokens"):
        encode_bad_words(["Emma"], encode, 100)


def test_bans_write_minus_infinity_and_a_row_they_would_empty_keeps_its_logits():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[4, 5]), SamplingParams()]
    got = apply_token_biases(logits, params, bad_word_bans=[{2, 9}, {4, 5}, ()])
    want = logits.clone()
    want[0, [2, 9]] = float("-inf")
    want[1] = float("-inf")
    want[1, [4, 5]] = logits[1, [4, 5]]  # the bans would leave nothing: the allowed set alone
    assert torch.equal(got, want)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 3, bad_word_bans=[{logits[0].argmax().item()},
                                                                                       (), ()])
    assert out.token_ids[0].item() == logits[0].topk(2).indices[1].item()


def _reference(llm, prompt_ids: list[int], words: list[str], max_tokens: int) -> list[int]:
    """Greedy output that never completes a bad word: each step scores the whole text and takes the most
    likely token among the top 20 that does not end a word's encoding after the output so far."""
    tok = llm.get_tokenizer()
    seqs = [tuple(tok.encode(t, add_special_tokens=False)) for w in words for t in (w.lstrip(), " " + w.lstrip())]
    out: list[int] = []
    for _ in range(max_tokens):
        step = llm.generate([{"prompt_token_ids": prompt_ids + out}],
                            SamplingParams(temperature=0, max_tokens=1, logprobs=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        ranked = sorted(step.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
        out.append(next(t for t, _ in ranked if not _completes_a_word(seqs, out, t)))
    return out


#: float32 (the CPU's default; on a GPU, so the reference's full-text logits agree with the engine's
#: incremental ones at the top token) and a pool that leaves room for other engines.
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=1 << 26)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3,"
CASES = [("Once upon a time, there was a little", ["Emma"]),  # one token after a space
         ("The capital of France is", ["2018-01"]),  # eight tokens: the last is banned after the seven before
         ("The capital of France is", ["answer is:", "Paris"]),
         (COUNTING, ["6, 7"])]  # the n-gram proposer proposes the count, 7 among it


@pytest.mark.parametrize("engine", [{}, {"async_scheduling": True}, {"num_speculative_tokens": 2}],
                         ids=["sync", "async", "ngram"])
@pytest.mark.parametrize("prompt, words", CASES, ids=["one-token", "eight-tokens", "two-words", "counting"])
def test_greedy_output_skips_each_bad_word_as_the_reference_does(smol_llm, engine, prompt, words):
    llm = smol_llm(**ENGINE, **engine)
    ids = llm.get_tokenizer().encode(prompt)
    params = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert any(w in plain.text for w in words)  # the words are there without the ban
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**params, bad_words=words), use_tqdm=False)
    got = got[0].outputs[0]
    assert list(got.token_ids) != list(plain.token_ids)
    if prompt == COUNTING and "num_speculative_tokens" in engine:  # proposals were verified under the ban
        assert llm.engine.spec_counters.num_draft_tokens > 0
    assert list(got.token_ids) == _reference(smol_llm(**ENGINE), ids, words, 16)


def test_bad_words_need_a_tokenizer_and_an_allowed_token_they_do_not_ban(smol_llm):
    llm = smol_llm(**ENGINE)
    tok = llm.get_tokenizer()
    emma = tok.encode(" Emma", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="ban every token of allowed_token_ids") as err:
        llm.generate(["Hi"], SamplingParams(bad_words=["Emma"], allowed_token_ids=emma), use_tqdm=False)
    assert err.value.field == "bad_words"
    for value in ("Emma", [""], ["ok", 3], ["w"] * 129):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(bad_words=value)
        assert err.value.field == "bad_words"
    eos = tok.eos_token_id
    with pytest.raises(InvalidRequestError, match="allowed_token_ids .* that min_tokens leaves") as err:
        llm.generate(["Hi"], SamplingParams(bad_words=["Emma"], allowed_token_ids=emma + [eos], min_tokens=2),
                     use_tqdm=False)
    assert err.value.field == "bad_words"
    llm.generate(["Hi"], SamplingParams(bad_words=["Emma"], allowed_token_ids=emma + [eos], max_tokens=2),
                 use_tqdm=False)  # without min_tokens the end token is left
    with pytest.raises(InvalidRequestError, match="more than 2048 tokens") as err:  # one token a digit
        llm.generate(["Hi"], SamplingParams(bad_words=["7" * 1100]), use_tqdm=False)
    assert err.value.field == "bad_words"
    ids_only = smol_llm(**ENGINE, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="logit_bias -100") as err:
        ids_only.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(bad_words=["Emma"]), use_tqdm=False)
    assert err.value.field == "bad_words"
