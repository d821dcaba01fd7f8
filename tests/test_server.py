"""The OpenAI-compatible server, end to end over real HTTP.

The module server wraps the real engine (embedded SmolLM2 on CPU). Tests of pure server
mechanics (queue bound, SIGTERM drain) use ``tests/fake_engine.FakeEngine`` explicitly, for its
controllable step time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, serve_refused, smollm2_test_engine  # noqa: E402
from greedy_agreement import FP32_LOGIT_TOL, assert_greedy_agrees, margins_from_logprobs  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.metrics import metric_sum, parse_prometheus  # noqa: E402

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server():
    engine = smollm2_test_engine(max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    app = create_app(engine, api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES, max_queued_requests=512)
    srv = ServerThread(app).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def http(method: str, url: str, body=None, headers=None, timeout=60):
    """(status, headers, parsed JSON or text) with urllib, no exceptions for HTTP errors."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, rh, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, rh, raw = e.code, dict(e.headers), e.read()
    try:
        return status, rh, json.loads(raw)
    except ValueError:
        return status, rh, raw.decode(errors="replace")


def metrics(server) -> dict[str, float]:
    status, _, text = http("GET", server.url + "/metrics")
    assert status == 200
    return parse_prometheus(text)


def model_name(server) -> str:
    return server.engine.model_name


def prompt_len(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


# -- (1) the official openai client ------------------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name(server)]
    status, _, body = http("GET", server.url + "/health")
    assert status == 200 and body["status"] == "ok"


def test_version_ping_and_unknown_routes(server):
    import kvforge

    assert http("GET", server.url + "/version") == (200, http("GET", server.url + "/version")[1],
                                                     {"version": kvforge.__version__})
    assert http("GET", server.url + "/ping")[0] == 200 and http("POST", server.url + "/ping")[0] == 200
    status, _, r = http("POST", server.url + "/v1/embeddings", {"input": "x"}, AUTH)
    assert status == 404 and r["error"]["code"] == "not_found"
    assert "no route POST /v1/embeddings" in r["error"]["message"] and "POST /v1/completions" in r["error"]["message"]


def test_an_error_inside_a_stream_is_an_event_and_the_server_serves_on(server, monkeypatch):
    """Once a stream's 200 has gone out, a failure while building a chunk becomes an error event followed by
    [DONE] (the client sees why it ended), and the server keeps serving."""
    from kvforge.server import app as app_module

    def broken(self, *args, **kwargs):
        raise RuntimeError("chunk builder failed")

    monkeypatch.setattr(app_module._Choice, "logprobs", broken)
    body = {"model": model_name(server), "prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True}
    status, headers, text = http("POST", server.url + "/v1/completions", json.dumps(body).encode(), AUTH)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "RuntimeError: chunk builder failed" in error["message"]
    monkeypatch.undo()
    status, _, r = http("POST", server.url + "/v1/completions", {**body, "stream": False}, AUTH)
    assert status == 200 and r["choices"][0]["logprobs"] is not None


def test_retrieve_model_with_openai_client(server, client):
    m = client.models.retrieve(model_name(server))
    assert m.id == model_name(server) and m.object == "model" and m.owned_by == "kvforge"
    assert m.model_extra["root"] == model_name(server) and m.model_extra["parent"] is None  # vLLM's fields
    assert m.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-17")
    assert exc.value.code == "model_not_found"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-17"}),
])
def test_unknown_model_is_404_model_not_found(server, path, body):
    status, _, r = http("POST", server.url + path, body, AUTH)
    assert status == 404, r
    err = r["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["param"] == "model" and "gpt-17" in err["message"]


def test_bad_words_change_the_text_through_the_openai_client(server, client):
    prompt = "Once upon a time, there was a little"
    kw = dict(model=model_name(server), prompt=prompt, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    assert " Emma" in plain
    banned = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": ["Emma"]}).choices[0].text
    assert "Emma" not in banned and banned != plain


def test_completion_with_openai_client(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name(server), prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == model_name(server) and r.id
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == prompt_len(server, prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    # The same prompt as token ids gives the same greedy text.
    ids = server.engine.tokenizer.encode(prompt)
    r2 = client.completions.create(model=model_name(server), prompt=ids, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == len(ids)


def test_chat_with_openai_client(server, client):
    messages = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=5, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 5
    rendered = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = len(rendered) if isinstance(rendered, list) else prompt_len(server, rendered)
    assert r.usage.prompt_tokens == expected
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # max_completion_tokens is honoured too
    r = client.chat.completions.create(model=model_name(server), messages=messages, max_completion_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streaming_matches_non_streaming(server, client):
    kw = dict(model=model_name(server), max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="Once upon a time", **kw)
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    prompt_tokens = full.usage.prompt_tokens

    messages = [{"role": "user", "content": "Count to three."}]
    full = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # without include_usage there is no usage chunk
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True, **kw))
    assert all(c.usage is None and c.choices for c in chunks)
    # continuous_usage_stats (vLLM's): every chunk carries the usage so far, one more token a step
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kw))
    used = [c.usage.completion_tokens for c in chunks]
    assert used == [*range(1, 8), 7] and {c.usage.prompt_tokens for c in chunks} == {prompt_tokens}
    assert chunks[-1].choices == []
    # with n > 1 a choice's chunk counts that choice's tokens (vLLM's rule); the last usage counts them all
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True, n=2, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kw))
    for index in (0, 1):
        used = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == index]
        assert used == list(range(1, 8)), (index, used)
    assert {c.usage.prompt_tokens for c in chunks} == {prompt_tokens}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14


def test_logprobs_and_stop(server, client):
    r = client.completions.create(model=model_name(server), prompt="One, two, three,", max_tokens=4,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(model=model_name(server), messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) <= 2 for c in content)
    # A stop string cuts the text and reports finish_reason "stop".
    base = client.completions.create(model=model_name(server), prompt="The cat", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base.strip()) >= 2, f"the case needs a completion to cut, got {base!r}"
    stop = base.strip()[:2]
    r = client.completions.create(model=model_name(server), prompt="The cat", max_tokens=8, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    assert base.startswith(r.choices[0].text)


def test_seeded_sampling_is_reproducible(server, client):
    kw = dict(model=model_name(server), prompt="Write a word:", max_tokens=6, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


# -- (2) concurrency: 200 requests at 32, each equal to its solo greedy output -----------------------


def test_concurrent_requests_match_solo(server):
    """Batched under concurrency, each request's greedy tokens follow its solo run until a near-tie
    of the solo run's logits (tests/greedy_agreement.py): another batch composition moves float32
    logits in the last bits."""
    base = server.url + "/v1/completions"
    # 8 distinct prompts x 25 copies: the solo baseline stays cheap on CPU, and the copies also exercise
    # prefix-cache sharing under batching.
    n_prompts, n_requests, concurrency, max_tokens = 8, 200, 32, 8
    prompts = [f"Request {i}: the {w} of the story is" for i, w in
               enumerate(["start", "end", "middle", "hero", "moral", "place", "time", "villain"])]

    def body(p):
        return {"model": model_name(server), "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 2}

    # Served alone, one at a time.
    solo = {}
    for p in prompts:
        status, _, r = http("POST", base, body(p), AUTH)
        assert status == 200, r
        solo[p] = r["choices"][0]["logprobs"]

    async def run():
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:
            async def one(i):
                p = prompts[i % n_prompts]
                async with sem, session.post(base, json=body(p), headers=AUTH) as resp:
                    return p, resp.status, await resp.json()
            return await asyncio.gather(*(one(i) for i in range(n_requests)))

    t0 = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    print(f"\n[test_server] {n_requests} requests at concurrency {concurrency}: {elapsed:.1f}s")
    assert all(status == 200 for _, status, _ in results), [r for _, s, r in results if s != 200][:3]
    agreed = 0
    for p, _, r in results:
        got = r["choices"][0]["logprobs"]
        agreed += assert_greedy_agrees(got["tokens"], solo[p]["tokens"], margins_from_logprobs(solo[p]["top_logprobs"]),
                                       FP32_LOGIT_TOL, what=p)
    assert agreed >= 0.9 * n_requests * max_tokens
    assert all(r["usage"]["completion_tokens"] == max_tokens for _, _, r in results)


# -- (3) bad input: 400 naming the field, server keeps serving; auth 401; limits --------------------


def _too_long_prompt(server) -> str:
    return "hello " * (MAX_MODEL_LEN + 10)


BAD_COMPLETIONS = [
    ("malformed_json", b'{"prompt": "hi", ', "body"),
    ("not_an_object", b'["prompt"]', "body"),
    ("temperature_type", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("max_tokens_type", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("max_tokens_zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("top_p_range", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("negative_temperature", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("top_k_range", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("min_p_range", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("n_zero", {"prompt": "hi", "n": 0}, "n"),
    ("best_of_over_n", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("logprobs_range", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("stop_type", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("stop_token_ids_type", {"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ("seed_type", {"prompt": "hi", "seed": "x"}, "seed"),
    ("ignore_eos_type", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("stream_type", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("missing_prompt", {"max_tokens": 3}, "prompt"),
    ("prompt_type", {"prompt": 42}, "prompt"),
    ("empty_prompt", {"prompt": ""}, "prompt"),
    ("lone_surrogate", {"prompt": "\ud800abc"}, "prompt"),
    ("lone_surrogate_in_batch", {"prompt": ["fine", "\udfff"]}, "prompt[1]"),
    ("token_id_out_of_vocab", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("prompt_too_long", "TOO_LONG", "prompt"),
    ("max_tokens_over_context", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("logit_bias_range", {"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
    ("logit_bias_out_of_vocab", {"prompt": "hi", "logit_bias": {str(10**9): 5}}, "logit_bias"),
    ("allowed_token_ids_out_of_vocab", {"prompt": "hi", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
    ("stop_token_ids_out_of_vocab", {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("bad_words_spaces", {"prompt": "hi", "bad_words": ["  "]}, "bad_words"),
    ("include_usage_type", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
]


@pytest.mark.parametrize("name,body,field", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_requests(server, name, body, field):
    if body == "TOO_LONG":
        body = {"prompt": _too_long_prompt(server)}
    if isinstance(body, dict):
        body = {"model": model_name(server), **body}
    status, _, r = http("POST", server.url + "/v1/completions", body, AUTH)
    assert status == 400, r
    err = r["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field
    assert err["message"]
    if field:
        assert field in err["message"]
    status, _, h = http("GET", server.url + "/health")
    assert status == 200 and h["status"] == "ok"


BAD_CHAT = [
    ("missing_messages", {}, "messages"),
    ("messages_type", {"messages": "hi"}, "messages"),
    ("bad_role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("missing_role", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("lone_surrogate", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ("content_type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("max_completion_tokens_zero", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("top_logprobs_without_logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("prompt_too_long", "TOO_LONG", "messages"),
    ("logit_bias_type", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": ["42"]}, "logit_bias"),
    ("json_schema_missing", {"messages": [{"role": "user", "content": "hi"}],
                             "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ("structural_tag", {"messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "structural_tag"}}, "response_format.type"),
    ("tools_auto", {"messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ("tool_choice_required_without_tools", {"messages": [{"role": "user", "content": "hi"}],
                                            "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("name,body,field", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests(server, name, body, field):
    if body == "TOO_LONG":
        body = {"messages": [{"role": "user", "content": _too_long_prompt(server)}]}
    body = {"model": model_name(server), **body}
    status, _, r = http("POST", server.url + "/v1/chat/completions", body, AUTH)
    assert status == 400, r
    assert r["error"]["param"] == field and field in r["error"]["message"]


def test_neutral_values_of_unsupported_features_are_accepted(server, client):
    r = client.chat.completions.create(model=model_name(server), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0, logit_bias={}, response_format={"type": "text"},
                                       tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_input_with_openai_client_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name(server), prompt="hi", temperature=-3)
    assert "temperature" in str(exc.value)
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="hi")
    assert exc.value.code == "model_not_found"
    r = client.completions.create(model=model_name(server), prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_api_key(server):
    url = server.url + "/v1/completions"
    body = {"model": model_name(server), "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, r = http("POST", url, body, headers)
        assert status == 401, r
        assert r["error"]["code"] == "invalid_api_key" and r["error"]["type"] == "invalid_request_error"
    status, _, _ = http("GET", server.url + "/v1/models")
    assert status == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # health and metrics stay open (load balancers, Prometheus)
    assert http("GET", server.url + "/health")[0] == 200
    assert http("GET", server.url + "/metrics")[0] == 200


def test_request_body_limit(server):
    body = {"model": model_name(server), "prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    status, _, r = http("POST", server.url + "/v1/completions", body, AUTH)
    assert status == 413 and r["error"]["code"] == "request_too_large"
    assert http("GET", server.url + "/health")[0] == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_its_content_encoding_does_not_decode_is_a_400(server, encoding):
    """The body is refused naming the header, and the connection is closed (its stream is spent); the next
    request on the same connection would otherwise read a reset. A body the header does describe is read."""
    import gzip
    import http.client as http_client
    import zlib

    host, port = server.url.removeprefix("http://").split(":")
    conn = http_client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=b"not compressed",
                 headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": encoding})
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 400 and error["param"] == "body" and repr(encoding) in error["message"]
    assert response.getheader("Connection") == "close"
    conn.close()
    body = json.dumps({"model": model_name(server), "prompt": "hi", "max_tokens": 1}).encode()
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    status, _, r = http("POST", server.url + "/v1/completions", packed, {**AUTH, "Content-Encoding": encoding})
    assert status == 200 and r["usage"]["completion_tokens"] == 1


def test_json_nested_past_the_parser_is_a_400(server):
    depth = 20_000  # 40 KB, under this server's body limit; the parser's recursion stops far earlier
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, _, r = http("POST", server.url + "/v1/completions", body, AUTH)
    assert status == 400, r
    assert r["error"]["param"] == "body" and "nested too deeply" in r["error"]["message"]
    assert http("GET", server.url + "/health")[0] == 200


def test_unknown_route_is_json_404(server):
    status, _, r = http("GET", server.url + "/v1/nothing-here", headers=AUTH)
    assert status == 404 and "error" in r


# -- (4) clients that disconnect mid-stream free their KV blocks ------------------------------------


def test_disconnects_free_kv_blocks(server, caplog):
    """Clients that leave mid-stream or while waiting free their KV blocks, and a stream that loses its client
    ends without an error in the log (a write after the client left once raised out of the handler, which
    aiohttp logged with a traceback)."""
    caplog.set_level(logging.ERROR, logger="aiohttp")
    url = server.url + "/v1/completions"
    before = metrics(server)
    n_stream, n_plain = 20, 4

    async def stream_then_leave(session, i):
        body = {"model": model_name(server), "prompt": f"Tell me a long story number {i}.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        resp = await session.post(url, json=body, headers=AUTH)
        assert resp.status == 200
        got = 0
        async for line in resp.content:
            if line.startswith(b"data:"):
                got += 1
                if got >= 2:
                    break
        resp.close()  # drop the connection mid-stream
        return got

    async def wait_then_leave(session, i):
        body = {"model": model_name(server), "prompt": f"Another story {i}.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(url, json=body, headers=AUTH,
                                    timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                await resp.read()

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            got = await asyncio.gather(*(stream_then_leave(session, i) for i in range(n_stream)),
                                       *(wait_then_leave(session, i) for i in range(n_plain)))
            return got[:n_stream]

    got = asyncio.run(run())
    assert all(g >= 2 for g in got)
    deadline = time.time() + 30
    while True:
        m = metrics(server)
        used = metric_sum(m, "kvforge:kv_blocks_used")
        running = metric_sum(m, "kvforge:num_requests_running") + metric_sum(m, "kvforge:num_requests_waiting")
        in_flight = metric_sum(m, "kvforge:num_requests_in_flight")
        if used == 0 and running == 0 and in_flight == 0:
            break
        assert time.time() < deadline, f"still in use: blocks={used} running+waiting={running} in_flight={in_flight}"
        time.sleep(0.1)
    key = f'kvforge:request_success_total{{finished_reason="abort",model_name="{model_name(server)}"}}'
    aborted = m[key] - before[key]
    # Every streaming client is aborted. A non-streaming client that gives up while its request is still
    # queued may be dropped before it ever reaches the engine (then it is not an engine abort), so those
    # four only bound the count from above; the KV check above is what matters.
    assert n_stream <= aborted <= n_stream + n_plain
    assert http("GET", server.url + "/health")[0] == 200
    assert not [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR]


def test_metrics_exposition(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=model_name(server), prompt="metrics", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    status, headers, text = http("GET", server.url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {
        "kvforge:num_requests_running": "gauge", "kvforge:num_requests_waiting": "gauge",
        "kvforge:num_requests_in_flight": "gauge", "kvforge:kv_cache_usage_perc": "gauge",
        "kvforge:kv_blocks_used": "gauge", "kvforge:kv_blocks_total": "gauge",
        "kvforge:prefix_cache_queries": "counter", "kvforge:prefix_cache_hits": "counter",
        "kvforge:num_preemptions": "counter", "kvforge:prompt_tokens": "counter",
        "kvforge:generation_tokens": "counter", "kvforge:request_success": "counter",
        "kvforge:request_rejected": "counter", "kvforge:http_requests": "counter",
        "kvforge:time_to_first_token_seconds": "histogram", "kvforge:inter_token_latency_seconds": "histogram",
        "kvforge:request_time_per_output_token_seconds": "histogram",
        "kvforge:e2e_request_latency_seconds": "histogram", "kvforge:request_prompt_tokens": "histogram",
        "kvforge:request_generation_tokens": "histogram", "kvforge:request_queue_time_seconds": "histogram",
        "kvforge:request_prefill_time_seconds": "histogram", "kvforge:request_decode_time_seconds": "histogram",
        "kvforge:request_inference_time_seconds": "histogram", "kvforge:request_params_n": "histogram",
        "kvforge:request_params_max_tokens": "histogram",
    }
    assert {name: families[name].type for name in kinds if name in families} == kinds
    for family in families.values():  # every series names the model
        for sample in family.samples:
            assert sample.labels.get("model_name") == model_name(server), sample
    m = parse_prometheus(text)
    label = f'model_name="{model_name(server)}"'
    assert m[f"kvforge:kv_blocks_total{{{label}}}"] == server.engine.stats()["kv_blocks_total"] > 0
    assert m[f"kvforge:time_to_first_token_seconds_count{{{label}}}"] >= 1
    assert m[f'kvforge:time_to_first_token_seconds_bucket{{le="+Inf",{label}}}'] == m[
        f"kvforge:time_to_first_token_seconds_count{{{label}}}"]
    assert m[f"kvforge:request_generation_tokens_sum{{{label}}}"] >= 3


def test_request_phase_histograms_split_each_finished_request(server, client):
    """vLLM's request phases: queue (arrival to first scheduling) + inference (first scheduling to the last
    token) is the end-to-end latency, and inference is prefill (to the first token) + decode; one observation
    per finished choice. The request's n and output limit are observed once per prompt."""
    before = metrics(server)
    client.completions.create(model=model_name(server), prompt="Phases of a request", max_tokens=5, n=2, seed=3,
                              temperature=1, extra_body={"ignore_eos": True})
    after = metrics(server)

    def moved(name):
        return metric_sum(after, name) - metric_sum(before, name)

    phases = ("queue_time", "prefill_time", "decode_time", "inference_time")
    for phase in phases:
        assert moved(f"kvforge:request_{phase}_seconds_count") == 2, phase
    queue, prefill, decode, inference = (moved(f"kvforge:request_{p}_seconds_sum") for p in phases)
    assert min(queue, prefill, decode, inference) >= 0 and prefill > 0 and decode > 0
    # each phase's sum is a sum of differences of the same clock readings: equal up to float rounding
    assert abs(prefill + decode - inference) < 1e-6
    assert abs(queue + inference - moved("kvforge:e2e_request_latency_seconds_sum")) < 1e-6
    assert moved("kvforge:request_params_n_count") == 1 and moved("kvforge:request_params_n_sum") == 2
    assert moved("kvforge:request_params_max_tokens_count") == 1
    assert moved("kvforge:request_params_max_tokens_sum") == 5


def test_token_counters_count_a_prompt_only_request_as_its_usage(server, client):
    """Echo with max_tokens 0 (a loglikelihood request) runs in the engine as the prompt less its last token
    plus that token forced; the token counters count what its usage bills: the whole prompt, no token
    generated (and so does a one-token prompt, which the engine runs as itself plus a dropped token)."""
    names = ("kvforge:prompt_tokens_total", "kvforge:generation_tokens_total", "kvforge:request_prompt_tokens_sum",
             "kvforge:request_generation_tokens_sum")
    for prompt in ("The quick brown fox jumps", [42]):
        before = metrics(server)
        r = client.completions.create(model=model_name(server), prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        after = metrics(server)
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 0
        moved = [metric_sum(after, n) - metric_sum(before, n) for n in names]
        assert moved == [r.usage.prompt_tokens, 0, r.usage.prompt_tokens, 0], (prompt, moved)


def test_metrics_of_two_apps_in_one_process_are_separate():
    from prometheus_client.parser import text_string_to_metric_families

    from kvforge.server.metrics import ServerMetrics

    a, b = ServerMetrics("model-a"), ServerMetrics("model-b")
    a.on_reject("invalid")
    a.on_reject("invalid")
    b.on_reject("queue_full")
    stats = {"num_running": 3, "num_waiting": 1, "kv_blocks_used": 5, "kv_blocks_total": 20,
             "prefix_cache_queries": 40, "prefix_cache_hits": 10, "num_preemptions": 2,
             "prompt_tokens_total": 70, "generation_tokens_total": 90}
    text_a = a.render(stats, in_flight=4).decode()
    text_b = b.render({}, in_flight=0).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text_a) for s in f.samples}
    la = (("model_name", "model-a"),)
    assert got[("kvforge:num_requests_running", la)] == 3
    assert got[("kvforge:num_requests_waiting", la)] == 1
    assert got[("kvforge:num_requests_in_flight", la)] == 4
    assert got[("kvforge:kv_cache_usage_perc", la)] == 0.25
    assert got[("kvforge:prefix_cache_hits_total", la)] == 10
    assert got[("kvforge:prompt_tokens_total", la)] == 70
    assert got[("kvforge:generation_tokens_total", la)] == 90
    assert got[("kvforge:request_rejected_total", (("model_name", "model-a"), ("reason", "invalid")))] == 2
    assert "model-b" not in text_a and "model-a" not in text_b
    assert not any(k[0] == "kvforge:request_rejected_total" and ("reason", "invalid") in k[1]
                   for k in {(s.name, tuple(s.labels.items())): 0
                             for f in text_string_to_metric_families(text_b) for s in f.samples})


# -- server mechanics on the fake engine: queue bound, SIGTERM -------------------------------------


def _at_once(url: str, bodies: list[dict]) -> list[tuple[int, str | None, dict]]:
    """POST every body at once; (status, Retry-After, JSON body) of each, in order."""
    async def run():
        async with aiohttp.ClientSession() as http_client:
            async def one(body):
                async with http_client.post(url, json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()
            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(run())


def test_queue_bound_returns_503_with_retry_after():
    engine = FakeEngine(max_num_seqs=1, step_delay=0.02)
    with ServerThread(create_app(engine, max_queued_requests=2)) as srv:
        url = srv.url + "/v1/completions"
        results = _at_once(url, [{"prompt": f"p{i}", "max_tokens": 20, "ignore_eos": True} for i in range(12)])
        statuses = [s for s, _, _ in results]
        assert 200 in statuses and 503 in statuses, statuses
        for status, retry, body in results:
            if status == 503:
                assert retry is not None and int(retry) >= 1
                assert body["error"]["code"] == "queue_full"
        # once drained, it serves again
        status, _, r = http("POST", url, {"prompt": "again", "max_tokens": 2})
        assert status == 200, r
        assert engine.stats()["kv_blocks_used"] == 0


def test_queue_bound_counts_what_waits_beyond_the_run_slots():
    """With 4 run slots and a bound of 3, eight requests sent at once: seven are held (four running, three
    waiting) and the eighth is refused, naming what waits beyond the run slots."""
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    with ServerThread(create_app(engine, max_queued_requests=3)) as srv:
        url = srv.url + "/v1/completions"
        results = _at_once(url, [{"prompt": f"p{i}", "max_tokens": 60, "ignore_eos": True} for i in range(8)])
        assert sorted(status for status, _, _ in results) == [200] * 7 + [503], [s for s, _, _ in results]
        (refused,) = [body for status, _, body in results if status == 503]
        assert "(3 waiting beyond the 4 running, limit 3, this request 1)" in refused["error"]["message"]


def test_queue_bound_takes_a_request_of_n_sequences_at_once():
    """The bound is checked once per client request for all its sequences (prompts x n): on an idle server a
    request of as many sequences as the bound runs, where counting each sample as queued refused its second;
    one that can never fit is a 400 naming n, not a 503 that asks for a retry."""
    engine = FakeEngine(max_num_seqs=1, step_delay=0.01)
    with ServerThread(create_app(engine, max_queued_requests=2)) as srv:
        url = srv.url + "/v1/completions"
        status, _, r = http("POST", url, {"prompt": "p", "max_tokens": 2, "n": 2})
        assert status == 200 and len(r["choices"]) == 2, r
        status, _, r = http("POST", url, {"prompt": ["a", "b"], "max_tokens": 2})
        assert status == 200 and len(r["choices"]) == 2, r
        status, _, r = http("POST", url, {"prompt": ["a", "b"], "max_tokens": 2, "n": 2})
        assert status == 400 and r["error"]["param"] == "n", r
        assert "4 sequences" in r["error"]["message"] and "--max-queued-requests 2 queued" in r["error"]["message"]
        status, _, r = http("POST", url, {"prompt": ["a", "b", "c", "d"], "max_tokens": 2})  # n is 1: the prompts
        assert status == 400 and r["error"]["param"] == "prompt", r
        assert r["error"]["message"].endswith("send fewer prompts")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_FAKE = """
import sys, logging
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from kvforge.server.app import create_app, serve
logging.basicConfig(level=logging.INFO)
sys.exit(serve(create_app(FakeEngine(step_delay=0.02), shutdown_grace_s=30), "127.0.0.1", {port}))
"""



def _wait_healthy(proc, base: str, timeout_s: float, poll_s: float) -> None:
    """Poll ``base``/health until it answers 200; fail with the server's output if it exits or times out."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if http("GET", base + "/health", timeout=1)[0] == 200:
                return
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
        time.sleep(poll_s)

SERVE_FAKE_DYING = """
import sys, logging
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from kvforge.server.app import create_app, serve

class DyingEngine(FakeEngine):
    steps = 0

    def step(self):
        DyingEngine.steps += 1
        if DyingEngine.steps > 10:
            raise RuntimeError("the device fell off the bus")
        return super().step()

logging.basicConfig(level=logging.INFO)
sys.exit(serve(create_app(DyingEngine(step_delay=0.02), shutdown_grace_s=30), "127.0.0.1", {port}))
"""


def _start_fake_server(code: str = SERVE_FAKE) -> tuple[subprocess.Popen, int]:
    """``code`` (``SERVE_FAKE``) in a process of its own (signals reach its serve loop), and its port."""
    port = _free_port()
    code = code.format(tests=str(Path(__file__).parent), port=port)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT), port


def test_sigterm_drains_in_flight_and_exits_zero():
    proc, port = _start_fake_server()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, 30, 0.1)

        async def run():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "drain me", "max_tokens": 40, "ignore_eos": True, "stream": True}
                async with session.post(base + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    lines = []
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            lines.append(line)
                            if len(lines) == 2:
                                proc.send_signal(signal.SIGTERM)
                    return lines

        lines = asyncio.run(run())
        assert lines[-1].strip() == b"data: [DONE]"
        texts = [json.loads(x[5:])["choices"][0] for x in lines[:-1]]
        assert texts[-1]["finish_reason"] == "length"  # the in-flight request finished
        assert len(texts) == 40
        assert proc.wait(timeout=30) == 0
        with pytest.raises(OSError):  # no longer accepting
            http("GET", base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_server_exits_with_1_when_its_engine_fails():
    """The stream the failure cut gets its engine_dead event and [DONE]; then the process exits 1 (a supervisor
    restarts it) instead of answering 503 engine_dead forever."""
    proc, port = _start_fake_server(SERVE_FAKE_DYING)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, 30, 0.1)
        body = {"prompt": "die", "max_tokens": 400, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            lines = [line for line in resp if line.startswith(b"data:")]
        assert lines[-1].strip() == b"data: [DONE]"
        assert json.loads(lines[-2][5:])["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=20) == 1
        out = proc.stdout.read().decode()
        assert "the engine failed (RuntimeError: the device fell off the bus): the server exits" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_while_draining_open_connections_get_503_and_a_second_signal_aborts_the_rest():
    """After SIGTERM a connection the client already holds (a pooled keep-alive one) is answered at once:
    /health and a new completion get 503 shutting_down, not silence until the grace ends; a second signal
    aborts the stream still running (an error event, then [DONE]) and the server exits long before its
    30 s grace."""
    import http.client

    proc, port = _start_fake_server()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, 30, 0.1)
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        kept.request("GET", "/health")
        assert kept.getresponse().read()
        streamed: list[bytes] = []
        started = threading.Event()

        def stream():
            body = {"prompt": "drain me", "max_tokens": 400, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                for line in resp:
                    if line.startswith(b"data:"):
                        streamed.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        kept.request("GET", "/health")
        health = kept.getresponse()
        assert health.status == 503 and json.loads(health.read())["status"] == "shutting_down"
        kept.request("POST", "/v1/completions", body=json.dumps({"prompt": "late", "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        late = kept.getresponse()
        assert late.status == 503 and json.loads(late.read())["error"]["code"] == "shutting_down"
        assert time.monotonic() - t0 < 5  # answered, not held until the grace ends
        assert reader.is_alive()  # the stream is still draining
        proc.send_signal(signal.SIGINT)  # the second signal
        reader.join(20)
        assert not reader.is_alive() and streamed[-1].strip() == b"data: [DONE]"
        assert b"shutting_down" in streamed[-2] and len(streamed) < 400
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the `kvforge serve` entry point ---------------------------------------------

def test_serve_main_plan_error_stops_before_weights(monkeypatch, capsys):
    assert "max-model-len" in serve_refused(monkeypatch, capsys, ["--max-model-len", "100000000"])


def test_request_size_bound_takes_sizes_as_the_memory_flags_do(monkeypatch, capsys):
    import argparse

    from kvforge.server.cli import add_serve_args

    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args(["--max-request-bytes", "2MiB"]).max_request_bytes == 2 << 20
    assert parser.parse_args(["--max-request-bytes", "4096"]).max_request_bytes == 4096
    # The default takes a batch of long token-id prompts (lm-eval's loglikelihood: 80 x 2000 ids is ~1 MB of JSON).
    assert parser.parse_args([]).max_request_bytes == 128 << 20
    assert "max-request-bytes" in serve_refused(monkeypatch, capsys, ["--max-request-bytes", "512"])



@pytest.mark.parametrize("what", ["missing", "empty"])
def test_serve_main_bad_tokenizer_stops_before_weights(monkeypatch, capsys, tmp_path, what):
    """``--tokenizer`` naming nothing, or a folder without a tokenizer, fails naming the flag; the model's own
    tokenizer is never silently dropped."""
    path = tmp_path / "nothing" if what == "missing" else tmp_path
    err = serve_refused(monkeypatch, capsys, ["--tokenizer", str(path)])
    assert f"--tokenizer {path}" in err and ("does not exist" if what == "missing" else "holds no tokenizer") in err


def test_serve_main_port_in_use_stops_before_weights(monkeypatch, capsys):
    import kvforge.engine.llm_engine
    from kvforge.server.cli import serve_main

    def boom(*a, **k):
        raise AssertionError("the engine was built although the port is taken")

    monkeypatch.setattr(kvforge.engine.llm_engine.LLMEngine, "from_engine_args", boom)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = serve_main(["--device", "cpu", "--port", str(port)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err and "Traceback" not in err


def test_serve_main_unresolvable_host_stops_before_weights(monkeypatch, capsys):
    import kvforge.engine.llm_engine
    from kvforge.server.cli import serve_main

    def boom(*a, **k):
        raise AssertionError("the engine was built although the host does not resolve")

    monkeypatch.setattr(kvforge.engine.llm_engine.LLMEngine, "from_engine_args", boom)
    rc = serve_main(["--device", "cpu", "--host", "256.0.0.1", "--port", str(_free_port())])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot listen on 256.0.0.1" in err and "--host" in err and "Traceback" not in err


@pytest.mark.parametrize("missing", ["aiohttp", "prometheus_client"])
def test_serve_main_missing_server_dependency_stops_before_weights(monkeypatch, capsys, missing):
    import kvforge.engine.llm_engine
    from kvforge.server.cli import serve_main

    def boom(*a, **k):
        raise AssertionError("the engine was built although the server cannot import")

    monkeypatch.setattr(kvforge.engine.llm_engine.LLMEngine, "from_engine_args", boom)
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")
                 or m.startswith("kvforge.server.app") or m.startswith("kvforge.server.metrics")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import of it raises ImportError
    rc = serve_main(["--device", "cpu", "--port", str(_free_port())])
    assert rc == 2
    err = capsys.readouterr().err
    assert missing in err and "Traceback" not in err


def test_serve_main_real_engine_sigterm():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "kvforge.server.cli", "--device", "cpu", "--max-model-len", "256",
           "--no-progress", "--port", str(port), "--api-key", "k"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, 120, 0.2)
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        stream = c.completions.create(model=c.models.list().data[0].id, prompt="Hello", max_tokens=12,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                proc.send_signal(signal.SIGTERM)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        assert log.count("KV plan for ") == 1 and "shutdown complete" in log  # the plan, once
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_tensor_parallel_2_cpu(tmp_path):
    """`kvforge serve --tensor-parallel-size 2` (gloo on CPU, tiny dummy Llama without a tokenizer): token-id
    prompts get 200s, /metrics works, SIGTERM stops the server and its worker process."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvforge.server.cli", str(tmp_path), "--device", "cpu", "--load-format", "dummy",
           "--tensor-parallel-size", "2", "--skip-tokenizer-init", "--max-model-len", "128", "--no-progress",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        _wait_healthy(proc, base, 120, 0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        workers = [int(x) for x in children.read_text().split()] if children.exists() else []
        assert len(workers) == 1, f"expected one TP worker process under the server, found {workers}"
        name = http("GET", base + "/v1/models")[2]["data"][0]["id"]
        for i in range(3):
            status, _, r = http("POST", base + "/v1/completions", {"model": name, "prompt": [5 + i, 17, 42, 9],
                                                                  "max_tokens": 6, "temperature": 0,
                                                                  "ignore_eos": True})
            assert status == 200, r
            assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                                  "prompt_tokens_details": None}  # null unless --enable-prompt-tokens-details
        status, _, r = http("POST", base + "/v1/completions", {"model": name, "prompt": "text needs a tokenizer"})
        assert status == 400, r
        m = parse_prometheus(http("GET", base + "/metrics")[2])
        assert metric_sum(m, "kvforge:generation_tokens_total") == 18
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        assert "tensor parallel: 2 ranks" in log and "shutdown complete" in log
        for pid in workers:  # the worker went away with the server
            for _ in range(50):
                if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"worker {pid} still running")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
