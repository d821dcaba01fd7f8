"""Token ids over HTTP, as vLLM returns them: ``return_token_ids`` (a choice's generated ``token_ids``, the
prompt's ``prompt_token_ids``), ``return_tokens_as_token_ids`` (logprobs name tokens ``token_id:N``) and a
server without a tokenizer (``--skip-tokenizer-init``), whose logprobs name tokens by id; plain and streamed,
through the official ``openai`` client on the real engine (embedded SmolLM2, float32 on CPU).

The ids are checked against the engine's own greedy run of the same prompt (``LLMEngine`` in-process: the
same float32 path, so the tokens are equal) and the logprobs' labels against the ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402

PROMPT = "Emoji time: 😀🎉 and 中文字符 here. More emoji:"


def _server(extra_args=()):
    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=4, extra_args=extra_args)
    srv = ServerThread(create_app(engine)).start()
    return engine, srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def real():
    engine, srv, client = _server()
    yield engine, client
    srv.stop()
    engine.shutdown()


def _greedy_ids(engine, prompt_ids: list[int], n: int) -> list[int]:
    engine.add_request("ref", prompt_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("no output")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_returns_its_token_ids_and_labels_logprobs_by_id(real, stream):
    engine, client = real
    kw = dict(model=engine.model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5, stream=stream,
              extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**kw) if c.choices]
        ids = [t for c in chunks for t in c.model_extra["token_ids"]]
        prompt_ids = [c.model_extra["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c.model_extra]
        assert len(prompt_ids) == 1  # in the choice's first chunk only
        prompt_ids = prompt_ids[0]
        tokens = [t for c in chunks for t in c.logprobs.tokens]
        tops = [t for c in chunks for t in c.logprobs.top_logprobs]
        lps = [t for c in chunks for t in c.logprobs.token_logprobs]
    else:
        (choice,) = client.completions.create(**kw).choices
        ids, prompt_ids = choice.model_extra["token_ids"], choice.model_extra["prompt_token_ids"]
        tokens, tops, lps = choice.logprobs.tokens, choice.logprobs.top_logprobs, choice.logprobs.token_logprobs
    assert prompt_ids == engine.tokenizer.encode(PROMPT)
    assert ids == _greedy_ids(engine, prompt_ids, 6)
    assert tokens == [f"token_id:{t}" for t in ids]
    for token, top, lp in zip(tokens, tops, lps):
        # Labelled by id, alternatives whose texts are alike (pieces of one emoji) stay apart: five of them
        # (the chosen one among them, greedy), and the chosen token's entry is its own logprob.
        assert len(top) == 5 and top[token] == lp


def test_chat_returns_its_token_ids(real):
    engine, client = real
    resp = client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == resp.usage.completion_tokens and len(resp.model_extra["prompt_token_ids"]) == \
        resp.usage.prompt_tokens
    assert [c.token for c in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert engine.tokenizer.decode(ids) == choice.message.content
    assert resp.system_fingerprint is None and "system_fingerprint" in resp.model_dump()


@pytest.fixture(scope="module")
def no_tokenizer():
    engine, srv, client = _server(("--skip-tokenizer-init",))
    yield engine, client
    srv.stop()
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_server_without_a_tokenizer_names_tokens_by_id(no_tokenizer, real, stream):
    """Token-id prompts, logprobs and ``return_token_ids`` work without a tokenizer: the text is empty, the
    tokens come back as ids (the same as the server with a tokenizer computes), logprobs label them by id."""
    engine, client = no_tokenizer
    ref_engine, _ = real
    prompt = ref_engine.tokenizer.encode("The capital of France is")
    want = _greedy_ids(ref_engine, prompt, 5)
    kw = dict(model=engine.model_name, prompt=prompt, max_tokens=5, temperature=0, logprobs=1, stream=stream,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**kw) if c.choices]
        ids = [t for c in chunks for t in c.model_extra["token_ids"]]
        tokens = [t for c in chunks for t in c.logprobs.tokens]
        text = "".join(c.text for c in chunks)
    else:
        (choice,) = client.completions.create(**kw).choices
        ids, tokens, text = choice.model_extra["token_ids"], choice.logprobs.tokens, choice.text
    assert ids == want and tokens == [f"token_id:{t}" for t in want] and text == ""
    echo = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert echo.choices[0].logprobs.tokens == [f"token_id:{t}" for t in prompt]


def test_truncate_prompt_tokens_serves_a_prompt_longer_than_the_context(real):
    """vLLM's ``truncate_prompt_tokens``: a 300-token prompt on a 256-token server runs on its last 10 tokens."""
    engine, client = real
    prompt = engine.tokenizer.encode("one two three four five six seven eight nine ten " * 30)[:300]
    assert len(prompt) == 300
    resp = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True,
                                                 "ignore_eos": True})
    choice = resp.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt[-10:] and resp.usage.prompt_tokens == 10
    assert choice.model_extra["token_ids"] == _greedy_ids(engine, prompt[-10:], 4)


def test_a_truncated_echo_shows_the_tokens_it_ran_on(real):
    """With ``echo``, the text of a truncated prompt is that of the tokens kept, so its logprobs' offsets index it;
    more than the context is refused by name."""

    engine, client = real
    resp = client.completions.create(model=engine.model_name, prompt="one two three four five six", max_tokens=1,
                                      echo=True, logprobs=1, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    choice = resp.choices[0]
    kept = choice.model_extra["prompt_token_ids"]
    echoed = engine.tokenizer.decode(kept)
    assert len(kept) == 2 and choice.text.startswith(echoed) and echoed.strip() == "five six"
    assert choice.logprobs.text_offset[:2] == [0, len(engine.tokenizer.decode(kept[:1]))]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=engine.model_name, prompt="hi", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 100_000})
    assert "greater than max_model_len 256" in str(err.value)


def test_a_chat_stream_sends_its_prompt_ids_once(real):
    engine, client = real
    stream = client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, n=2, stream=True, temperature=0,
                                            extra_body={"return_token_ids": True})
    carried = [c.model_extra["prompt_token_ids"] for c in stream if "prompt_token_ids" in c.model_extra]
    assert len(carried) == 1 and carried[0]
