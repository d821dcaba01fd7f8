"""What each choice says about how it ended (``stop_reason``) and its logprobs at ``logprobs: 0`` /
``top_logprobs: 0``, on both ``/v1/completions`` and ``/v1/chat/completions``, through the official
``openai`` client over real HTTP.

``stop_reason`` follows vLLM: the stop string or stop token id that ended the choice, null for EOS
or a length limit; in a stream only the choice's last chunk carries it. It is checked on
``tests/fake_engine.FakeEngine`` (character tokens, greedy a pure function of the text so far), where
the stop that fires is known in advance. The logprobs are checked on the real engine (embedded
SmolLM2, float32 on CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, smollm2_test_engine  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402

MESSAGES = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def fake():
    srv = ServerThread(create_app(FakeEngine())).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def _run(client, kind: str, stream: bool, **kw) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of a one-choice greedy request; for a stream, stop_reason
    comes from the one chunk that carries it (the test fails when another chunk has it too)."""
    kw = dict(model=FakeEngine.model_name, temperature=0, **kw)
    if kind == "completion":
        kw["prompt"] = "abc"
        create = client.completions.create
    else:
        kw["messages"] = MESSAGES
        create = client.chat.completions.create
    if not stream:
        (choice,) = create(**kw).choices
        text = choice.text if kind == "completion" else choice.message.content
        return text, choice.finish_reason, choice.model_extra["stop_reason"]
    text, finish, carriers = "", None, []
    for chunk in create(stream=True, **kw):
        for choice in chunk.choices:
            text += (choice.text if kind == "completion" else choice.delta.content) or ""
            finish = choice.finish_reason or finish
            if "stop_reason" in choice.model_extra:
                carriers.append((choice.finish_reason, choice.model_extra["stop_reason"]))
    assert len(carriers) == 1 and carriers[0][0] is not None, carriers  # the last chunk, only it
    return text, finish, carriers[0][1]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_reason_names_the_stop_that_fired(fake, kind, stream):
    base, finish, reason = _run(fake, kind, stream, max_tokens=12)
    assert (finish, reason) == ("length", None) and len(base) == 12
    # A stop string from the middle of the greedy text: the text ends before it, stop_reason is it.
    stop = base[5:7]
    first = base.find(stop)
    text, finish, reason = _run(fake, kind, stream, max_tokens=12, stop=["zzzz", stop])
    assert (finish, reason) == ("stop", stop)
    if not stream:  # the fake engine does not hold back streamed text that may start a stop string
        assert text == base[:first]
    # A stop token id: the choice ends on its first occurrence, without its text; stop_reason is the id.
    token = ord(base[6])
    text, finish, reason = _run(fake, kind, stream, max_tokens=12, extra_body={"stop_token_ids": [token]})
    assert finish == "stop" and reason == token and text == base[:base.index(base[6])]


# -- logprobs 0 on the real engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=4)
    srv = ServerThread(create_app(engine)).start()
    yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()
    engine.shutdown()


# Two runs of the same solo greedy request on the same float32 CPU engine: the logprob of a token
# agrees far below this (the runs take the same path; the bound only allows for the last bits).
TOL = 1e-5


def test_completion_logprobs_zero_gives_the_chosen_token_alone(real):
    engine, client = real
    kw = dict(model=engine.model_name, prompt="One, two, three,", max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    zero = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    three = client.completions.create(logprobs=3, **kw).choices[0].logprobs
    assert zero.tokens == three.tokens and len(zero.tokens) == 5
    for token, lp, top, lp3, top3 in zip(zero.tokens, zero.token_logprobs, zero.top_logprobs,
                                         three.token_logprobs, three.top_logprobs):
        assert lp is not None and lp <= 0 and abs(lp - lp3) <= TOL
        assert list(top) == [token] and abs(top[token] - lp) <= TOL
        # With k = 3 the entry holds the 3 most likely tokens; greedy chose the most likely one.
        assert len(top3) == 3 and token in top3 and abs(top3[token] - max(top3.values())) <= TOL


def test_completion_logprobs_include_the_chosen_token_outside_the_top_k(real):
    engine, client = real
    # Sampled at a high temperature from the full distribution: some token falls outside the top 1.
    r = client.completions.create(model=engine.model_name, prompt="Once upon a time", max_tokens=24,
                                  temperature=5.0, seed=3, logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    outside = 0
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and abs(top[token] - token_lp) <= TOL
        assert len(top) in (1, 2)
        outside += len(top) == 2
    assert outside, "the case needs a sampled token that is not the most likely one"


def test_chat_top_logprobs_zero_gives_each_token_and_no_alternatives(real):
    engine, client = real
    kw = dict(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
              temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    zero = client.chat.completions.create(top_logprobs=0, **kw).choices[0].logprobs.content
    two = client.chat.completions.create(top_logprobs=2, **kw).choices[0].logprobs.content
    assert len(zero) == 4 and [c.token for c in zero] == [c.token for c in two]
    for c, c2 in zip(zero, two):
        assert c.top_logprobs == [] and c.logprob <= 0 and abs(c.logprob - c2.logprob) <= TOL
        assert c.bytes == list(c.token.encode())
        assert len(c2.top_logprobs) == 2 and c2.top_logprobs[0].token == c.token  # greedy: the most likely


def test_penalties_from_the_openai_client_change_greedy_output(real):
    """OpenAI's presence/frequency penalties (the client's own parameters) and vLLM's repetition_penalty
    (extra_body) reach the sampler: greedy output over a repetitive prompt changes, and the logprobs stay
    the raw ones (the chosen token need not be the raw top-1)."""
    engine, client = real
    kw = dict(model=engine.model_name, prompt="one two one two one two one two", max_tokens=12, temperature=0,
              logprobs=1)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    penalized = client.completions.create(**kw, presence_penalty=2.0, frequency_penalty=2.0,
                                          extra_body={"ignore_eos": True}).choices[0]
    repeated = client.completions.create(**kw, extra_body={"ignore_eos": True, "repetition_penalty": 3.0}).choices[0]
    assert penalized.text != plain.text and repeated.text != plain.text
    lp = penalized.logprobs
    assert any(max(top, key=top.get) != token for token, top in zip(lp.tokens, lp.top_logprobs)), \
        "some penalized choice should differ from the raw top-1"


# -- special tokens in logprobs --------------------------------------------------------------------


def _literal(engine, token_id: int) -> str:
    """The token's text as transformers decodes it with the special tokens kept (the reference: the
    tokens OpenAI and vLLM show in logprobs), checked to be a special token (skipped by default)."""
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer.backend)
    assert ref.decode([token_id], skip_special_tokens=True) == ""
    return ref.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_logprobs_show_special_tokens_as_their_text(real, stream):
    """EOS (forced as the third token: min_tokens keeps it out of the first two, logit_bias makes it the
    greedy choice) shows as its text in ``tokens`` and in ``top_logprobs``, while the choice's text omits
    it (skip_special_tokens); its offset is the end of that text. An echoed prompt's special token shows
    the same way."""
    engine, client = real
    (eos,) = engine.tokenizer.eos_token_ids
    literal = _literal(engine, eos)
    assert literal == "<|im_end|>"
    kw = dict(model=engine.model_name, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=1,
              logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        finish = chunks[-1].finish_reason
    else:
        choice = client.completions.create(**kw).choices[0]
        text, finish = choice.text, choice.finish_reason
        tokens, tops, offsets = choice.logprobs.tokens, choice.logprobs.top_logprobs, choice.logprobs.text_offset
    assert finish == "stop" and len(tokens) == 3 and tokens[-1] == literal
    assert literal in tops[-1] and literal not in text and "" not in tokens
    assert text == tokens[0] + tokens[1] and offsets == [0, len(tokens[0]), len(text)]

    prompt = engine.tokenizer.encode("<|im_start|>user\nHi")
    echo = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=0).choices[0]
    assert echo.logprobs.tokens[0] == _literal(engine, prompt[0]) == "<|im_start|>"
    assert echo.text == "user\nHi" and echo.logprobs.text_offset[:2] == [0, 0]  # the text omits it


def test_chat_logprobs_show_special_tokens_as_their_text(real):
    """A chat choice that ends on EOS lists it in ``logprobs.content`` with its text and that text's UTF-8
    ``bytes`` (OpenAI's shape); the message content omits it."""
    engine, client = real
    (eos,) = engine.tokenizer.eos_token_ids
    literal = _literal(engine, eos)
    r = client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                       logit_bias={str(eos): 100}, extra_body={"min_tokens": 1})
    choice = r.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason == "stop" and len(content) == 2
    assert content[-1].token == literal and content[-1].bytes == list(literal.encode())
    assert choice.message.content == content[0].token and literal not in choice.message.content
