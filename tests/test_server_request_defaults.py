"""Server-wide request defaults (kvforge/server/request_defaults.py; vLLM's flags ``--default-chat-template-kwargs``,
``--return-tokens-as-token-ids``, ``--exclude-tools-when-tool-choice-none``) and ``--enable-request-id-headers``:
a request's own field always wins."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import openai_client, serve_refused, smollm2_server  # noqa: E402

from kvforge.server.request_defaults import RequestDefaults  # noqa: E402

openai = pytest.importorskip("openai")

TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }} {{ t.function.description }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<{{ flavor | default('plain') }}>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city, "
                                                                                  "with many words " * 4}}
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    defaults = RequestDefaults({"flavor": "sweet"}, tokens_as_ids=True, exclude_tools_when_none=True)
    with smollm2_server(extra_args=("--chat-template", TEMPLATE), request_defaults=defaults,
                        request_id_headers=True) as srv:
        yield srv


def _post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                   **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read()), dict(r.headers)


def test_default_template_kwargs_under_the_requests_own(server):
    model = openai_client(server).models.list().data[0].id
    rendered, _ = _post(server.url + "/tokenize", {"model": model, "messages": ASK, "return_token_strs": True})
    own, _ = _post(server.url + "/tokenize", {"model": model, "messages": ASK,
                                              "chat_template_kwargs": {"flavor": "sour"}})
    text = lambda ids: _post(server.url + "/detokenize", {"model": model, "tokens": ids})[0]["prompt"]  # noqa: E731
    assert text(rendered["tokens"]).endswith("<sweet>") and text(own["tokens"]).endswith("<sour>")


def test_tokens_as_ids_by_default(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="Hello", max_tokens=2, temperature=0, logprobs=1)
    by_default = client.completions.create(**kw).choices[0].logprobs.tokens
    by_text = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False}).choices[0]
    assert all(t.startswith("token_id:") for t in by_default)
    assert not any(t.startswith("token_id:") for t in by_text.logprobs.tokens)


def test_tool_choice_none_renders_without_tools(server):
    client = openai_client(server)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, max_tokens=1, temperature=0)
    bare = client.chat.completions.create(**kw).usage.prompt_tokens
    none = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="none").usage.prompt_tokens
    assert none == bare


def test_request_id_headers(server):
    model = openai_client(server).models.list().data[0].id
    _, given = _post(server.url + "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1},
                     {"X-Request-Id": "trace-42"})
    _, made = _post(server.url + "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 1})
    assert given["X-Request-Id"] == "trace-42" and len(made["X-Request-Id"]) == 32
    body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1, "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                        "X-Request-Id": "stream-7"})
    with urllib.request.urlopen(req, timeout=60) as r:  # a stream's headers go out before its first event
        assert r.headers["X-Request-Id"] == "stream-7" and b"[DONE]" in r.read()


@pytest.mark.parametrize("value, says", [("{bad", "must be a JSON object"), ("[1]", "must be a JSON object, got array"),
                                         ('{"messages": 1}', "may not set messages")])
def test_bad_default_template_kwargs_stop_before_weights(monkeypatch, capsys, value, says):
    assert says in serve_refused(monkeypatch, capsys, ["--default-chat-template-kwargs", value])
