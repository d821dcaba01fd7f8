"""Structured outputs (kvforge/structured/) on the embedded SmolLM2 GGUF (CPU).

References, none built with the code under test: the masks are checked against a vocabulary decoded here
from the GGUF's raw byte-level BPE entries with GPT-2's byte table written out below; outputs are checked
with Python's ``json`` and ``re`` and by hand against the schema. Greedy outputs under a constraint equal
across the synchronous engine, the overlapped one, speculative decoding and preemption: each of those
keeps the target's argmax tokens, and the grammar masks the same rows the same way (equality is exact on
CPU float32 where the steps run the same rows; otherwise compared by the near-tie rule of
tests/greedy_agreement.py).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree
from test_engine_smollm2 import FP32_BLOCK_BYTES

from kvforge import SamplingParams
from kvforge.errors import InvalidRequestError
from kvforge.structured import StructuredOutputsParams

pytest.importorskip("xgrammar")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "colour": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array",
                                                                               "items": {"type": "string"},
                                                                               "maxItems": 3}},
          "required": ["name", "age", "colour", "tags"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
YES_NO = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]+ "."'


def _gpt2_byte_table() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: the bytes 33-126, 161-172 and 174-255 are their own
    characters; the other 68 bytes, in order, are U+0100 onwards."""
    own = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {chr(b): b for b in own}
    shifted = [b for b in range(256) if b not in own]
    table.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
    return table


def _reference_vocab(tokenizer) -> dict[int, bytes]:
    """id -> the bytes its raw vocabulary entry stands for, for the ordinary (not added) tokens."""
    table = _gpt2_byte_table()
    added = set(tokenizer.backend.get_added_tokens_decoder())
    return {i: bytes(table[c] for c in tok) for tok, i in tokenizer.backend.get_vocab(with_added_tokens=False).items()
            if i not in added}


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    words = bitmask[row].tolist()
    return {i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1}


def _person_ok(value) -> bool:
    return (isinstance(value, dict) and list(value) == ["name", "age", "colour", "tags"]
            and isinstance(value["name"], str) and type(value["age"]) is int
            and value["colour"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, str) for t in value["tags"]))


def _text(llm, prompt, **kw):
    kw.setdefault("temperature", 0)
    out = llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason


def test_params_one_constraint_and_forms():
    class Person:  # a pydantic model's class method, as vLLM users pass one
        @staticmethod
        def model_json_schema():
            return PERSON

    assert StructuredOutputsParams(json=Person) == StructuredOutputsParams(json=json.dumps(PERSON))
    assert StructuredOutputsParams(json=PERSON).kind == "json"
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")
    for bad, field in [({}, "structured_outputs"), ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
                       ({"json": "{not json"}, "structured_outputs.json"), ({"json": [1]}, "structured_outputs.json"),
                       ({"choice": []}, "structured_outputs.choice"), ({"choice": "ab"}, "structured_outputs.choice"),
                       ({"regex": ""}, "structured_outputs.regex"), ({"regexp": "a"}, "structured_outputs")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(structured_outputs=bad)
        assert e.value.field == field, (bad, e.value)


def test_a_number_that_is_not_finite_is_refused_with_its_path():
    """Python's JSON reader takes 1e400 as infinity (and NaN as NaN); a schema holding one is refused naming the
    number's place, where it would otherwise reach the compiler as text that is not JSON."""
    cases = [({"type": "number", "maximum": json.loads("1e400")}, "(inf) at #/maximum"),
             ({"enum": [1, float("nan")]}, "(nan) at #/enum/1"),
             ({"type": "object", "properties": {"a/b": {"type": "number", "minimum": -math.inf}}},
              "(-inf) at #/properties/a~1b/minimum")]
    for schema, where in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(f"not finite {where}: ")) as e:
            StructuredOutputsParams(json=schema)
        assert e.value.field == "structured_outputs.json" and "give a finite number" in str(e.value)
    assert StructuredOutputsParams(json={"type": "number", "maximum": 1e308}).json == '{"type":"number","maximum":1e+308}'


def test_first_masks_equal_the_decoded_vocabulary(smol_llm):
    """The tokens a regex allows first, and after a prefix, are exactly those whose bytes continue it."""
    from kvforge.structured.token_masks import grammar_bitmask

    engine = smol_llm().engine
    vocab = engine.spec.vocab_size
    reference = _reference_vocab(engine.tokenizer)
    eos = engine.tokenizer.eos_token_id
    digits = StructuredOutputsParams(regex="[0-9]+")
    fresh = engine.grammar_backend().matcher(digits)
    started = engine.grammar_backend().matcher(digits)
    assert started.accept_token(engine.tokenizer.encode("7", add_special_tokens=False)[0])
    bitmask = grammar_bitmask([fresh, None, started], vocab)
    want = {i for i, b in reference.items() if b and all(48 <= c <= 57 for c in b)}
    assert len(want) >= 10
    assert _allowed(bitmask, 0, vocab) == want
    assert _allowed(bitmask, 1, vocab) == set(range(vocab))
    assert _allowed(bitmask, 2, vocab) == want | {eos}
    # A literal with a space and a multi-byte character: every allowed first token is a prefix of it.
    literal = "Zürich is"
    matcher = engine.grammar_backend().matcher(StructuredOutputsParams(choice=[literal]))
    allowed = _allowed(grammar_bitmask([matcher], vocab), 0, vocab)
    encoded = literal.encode()
    assert allowed == {i for i, b in reference.items() if b and encoded.startswith(b)}


def test_outputs_match_their_constraints(smol_llm):
    llm = smol_llm()
    text, reason = _text(llm, "A person as JSON:", max_tokens=80, structured_outputs={"json": PERSON})
    assert reason == "stop" and _person_ok(json.loads(text)), text
    text, reason = _text(llm, "Call me at", max_tokens=20, structured_outputs={"regex": PHONE})
    assert reason == "stop" and re.fullmatch(PHONE, text), text
    text, _ = _text(llm, "Call me at", max_tokens=20)
    assert not re.fullmatch(PHONE, text), "the prompt alone already gives the pattern: the check above is empty"
    choices = ["positive", "negative", "neutral"]
    text, reason = _text(llm, "The review 'great food' is", max_tokens=10, structured_outputs={"choice": choices})
    assert reason == "stop" and text in choices
    text, reason = _text(llm, "Is the sky green?", max_tokens=40, structured_outputs={"grammar": YES_NO})
    assert reason == "stop" and re.fullmatch(r"(yes|no) because [a-z ]+\.", text), text
    text, reason = _text(llm, "Some data:", max_tokens=60,
                         structured_outputs={"json_object": True, "disable_any_whitespace": True})
    # Without "any whitespace", json.dumps's one-line separators and no other whitespace.
    assert reason == "stop" and isinstance(json.loads(text), dict) and text == json.dumps(json.loads(text)), text


def test_json_whitespace_runs_are_bounded(smol_llm):
    """JSON outputs take any whitespace, but no run longer than ``JSON_WHITESPACE_RUN_MAX`` between two JSON
    tokens (a model emitting blank lines would otherwise run to ``max_tokens``); pretty-printed JSON passes."""
    from kvforge.structured.backend import JSON_WHITESPACE_RUN_MAX as run

    backend = smol_llm().engine.grammar_backend()
    deep = {"name": "a", "age": 3, "colour": "red", "tags": ["x", "y"]}
    for constraint in ({"json": PERSON}, {"json_object": True}, {"json": True}):
        params = StructuredOutputsParams(**constraint)
        assert backend.matcher(params).accept_string(json.dumps(deep, indent=4)), constraint
        for blank in (" ", "\n"):
            assert backend.matcher(params).accept_string("{" + blank * run + '"name"'), (constraint, blank)
            matcher = backend.matcher(params)
            assert matcher.accept_string("{" + blank * run), constraint
            assert not matcher.accept_string(blank), (constraint, blank)


def test_json_true_is_any_json_value(smol_llm):
    """``json: true`` takes any JSON value (a scalar too), and ``disable_any_whitespace`` holds it to
    ``json.dumps``'s one-line separators as it does a schema."""
    backend = smol_llm().engine.grammar_backend()
    for value in ('"text"', "-0.5e10", "null", "[1, 2]", '{"a": [true, {}]}'):
        assert backend.matcher(StructuredOutputsParams(json=True)).accept_string(value), value
    tight = StructuredOutputsParams(json=True, disable_any_whitespace=True)
    assert backend.matcher(tight).accept_string(json.dumps({"a": [1, 2]}))
    assert not backend.matcher(tight).accept_string('{"a":1')  # json.dumps writes ": "
    assert not backend.matcher(tight).accept_string("{\n")


def test_sampled_outputs_match_and_seeds_repeat(smol_llm):
    llm = smol_llm()
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs={"json": PERSON})
              for s in range(4)]
    outs = llm.generate(["A person as JSON:"] * 4, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert _person_ok(json.loads(o.outputs[0].text)), o.outputs[0].text
    assert len(set(texts)) > 1
    again = llm.generate(["A person as JSON:"], params[2], use_tqdm=False)[0].outputs[0].text
    assert again == texts[2]


def test_complete_output_ends_the_request(smol_llm):
    """ignore_eos and min_tokens do not run a request past its complete output."""
    llm = smol_llm()
    text, reason = _text(llm, "Yes or no?", max_tokens=30, ignore_eos=True, min_tokens=20,
                         structured_outputs={"choice": ["yes", "no"]})
    assert (text, reason) in {("yes", "stop"), ("no", "stop")}


def test_bad_constraints_refused_and_engine_goes_on(smol_llm):
    llm = smol_llm()
    for so, field in [({"regex": "(unclosed"}, "structured_outputs.regex"),
                      ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar"),
                      ({"json": {"type": "string", "pattern": "(unclosed"}}, "structured_outputs.json")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert e.value.field == field and "could not be compiled" in str(e.value), e.value
    with pytest.raises(InvalidRequestError, match='"no-such-type" is no JSON type') as e:
        SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "no-such-type"}})
    assert e.value.field == "structured_outputs.json"
    assert not llm.engine.has_unfinished_requests()
    text, _ = _text(llm, "Pick:", max_tokens=5, structured_outputs={"choice": ["a", "b"]})
    assert text in ("a", "b")


def test_allowed_tokens_with_no_first_token_of_the_constraint_are_refused(smol_llm):
    """An allowed set sharing no token with the constraint's first tokens is refused naming allowed_token_ids
    (the sampler would otherwise keep the grammar's mask alone and ignore the set); a set that holds the
    digits' tokens is honoured beside the constraint."""
    llm = smol_llm()
    tokenizer = llm.engine.tokenizer
    digits = sorted({tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"})
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    regex = {"regex": "[0-9]+"}
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["Count:"], SamplingParams(max_tokens=3, allowed_token_ids=[letter], structured_outputs=regex),
                     use_tqdm=False)
    assert e.value.field == "allowed_token_ids" and "can begin with" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Count:"], SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=digits[:3] + [letter],
                                                  structured_outputs=regex), use_tqdm=False)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(digits[:3])


def _own_engine(**kwargs):
    """An engine of this test alone, with a small KV cache, shut down by the caller (the shared ones of
    conftest.py stay alive for the whole run, each holding its weights and KV cache)."""
    from kvforge import LLM

    return LLM(progress=False, max_model_len=1024, kv_cache_memory=128 << 20, **kwargs)


def test_no_tokenizer_refused():
    llm = _own_engine(skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}), use_tqdm=False)
    llm.shutdown()


def test_missing_xgrammar_named(monkeypatch):
    import sys

    from kvforge.structured.backend import xgrammar_module

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(InvalidRequestError, match="pip install xgrammar"):
        xgrammar_module()


MIXED = ["A person as JSON:", "The three primary colors are", "Call me at", "Once upon a time,"]


def _mixed_params(max_tokens=40):
    return [SamplingParams(temperature=0, max_tokens=80, logprobs=2, structured_outputs={"json": PERSON}),
            SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, logprobs=2, structured_outputs={"regex": PHONE}),
            SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)]


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_overlapped_engine_equals_synchronous(smol_llm):
    """Constrained and free requests in one batch: the overlapped engine feeds each constrained request's token
    in flight to its grammar once the next step's forward is launched (no step is resolved early for it). A
    request that ends on its grammar's end token leaves one wasted row in the next step, which changes the
    batch's shape, so outputs compare by the near-tie rule; every constrained output still matches."""
    sync = smol_llm().generate(MIXED, _mixed_params(), use_tqdm=False)
    llm = smol_llm(async_scheduling=True)
    before = (llm.engine.grammar_tokens_fed_ahead, llm.engine.async_pressure_resolves)
    overlapped = llm.generate(MIXED, _mixed_params(), use_tqdm=False)
    assert_outputs_agree(overlapped, sync, tol=FP32_LOGIT_TOL)
    assert _person_ok(json.loads(overlapped[0].outputs[0].text)) and re.fullmatch(PHONE, overlapped[2].outputs[0].text)
    fed = llm.engine.grammar_tokens_fed_ahead - before[0]
    constrained_tokens = len(overlapped[0].outputs[0].token_ids) + len(overlapped[2].outputs[0].token_ids)
    assert fed >= constrained_tokens - 2  # every token but each request's first went to its grammar in flight
    assert llm.engine.async_pressure_resolves == before[1]


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5, "backoff": False},
    {"num_speculative_tokens": 4, "backoff": False},  # garbage proposals (below): nearly all refused
])
def test_speculative_equals_plain(smol_llm, config):
    """Proposals the grammar refuses are rejected; those it allows verify as usual; the output is the plain
    engine's. The repeating list gives n-gram proposals that fit the schema."""
    schema = {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 6, "maxItems": 6}
    prompt = 'Fruit: ["apple", "pear", "plum", "apple", "pear", "plum"]. Again:'
    params = [SamplingParams(temperature=0, max_tokens=60, logprobs=2, structured_outputs={"json": schema}),
              SamplingParams(temperature=0, max_tokens=30, logprobs=2, structured_outputs={"regex": PHONE})]
    plain = smol_llm(enable_prefix_caching=False).generate([prompt, "Call me at"], params, use_tqdm=False)
    llm = _own_engine(enable_prefix_caching=False, speculative_config=config)
    if config.get("method") != "ngram":
        from test_speculative_engine import GarbageProposer

        llm.engine.proposer = GarbageProposer(4, llm.engine.spec.vocab_size)
    spec = llm.generate([prompt, "Call me at"], params, use_tqdm=False)
    assert_outputs_agree(spec, plain, tol=FP32_LOGIT_TOL)
    assert json.loads(spec[0].outputs[0].text) and re.fullmatch(PHONE, spec[1].outputs[0].text)
    counters = llm.engine.stats()["spec_decode"]
    assert counters["num_draft_tokens"] > 10
    if config.get("method") == "ngram":
        assert counters["num_accepted_tokens"] > 0
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_preempted_constrained_request_keeps_its_output(smol_llm, overlap):
    want = smol_llm().generate(MIXED, _mixed_params(100), use_tqdm=False)
    overlapped = {"async_scheduling": True} if overlap else {}  # the engines test_engine_smollm2 and
    small = smol_llm(kv_cache_memory=12 * FP32_BLOCK_BYTES, max_model_len=192, **overlapped)  # test_async_* use
    got = small.generate(MIXED, _mixed_params(100), use_tqdm=False)  # the free requests alone need 14 blocks
    assert small.engine.stats()["num_preemptions"] > 0
    assert_outputs_agree(got, want, tol=FP32_LOGIT_TOL)
    assert _person_ok(json.loads(got[0].outputs[0].text)) and re.fullmatch(PHONE, got[2].outputs[0].text)


def test_a_schema_nested_too_deeply_is_a_request_error():
    """A schema thousands of levels deep exhausts Python's recursion while it is read: refused as a request
    error naming the fix, not a RecursionError."""
    schema = {"type": "string"}
    for _ in range(3000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        StructuredOutputsParams(json=schema)
    assert e.value.field == "structured_outputs.json"
