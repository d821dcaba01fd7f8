"""Tool calls the model chooses to make (``tool_choice`` ``"auto"``, ``--enable-auto-tool-choice
--tool-call-parser hermes|llama3_json``; kvforge/server/tool_parsers.py): the parsers on whole outputs, each
streamed parse against the whole one at every split, and the server with the official ``openai`` client. The embedded
SmolLM2 never writes a call by itself, so the end-to-end calls come from a regular expression that holds its
output to the Hermes syntax (structured outputs), and a free output is the plain-text case."""

from __future__ import annotations

import json
import re

import openai
import pytest
from fake_engine import smollm2_test_engine

from kvforge.server.app import ServerThread, create_app
from kvforge.server.cli import add_serve_args, check_server_flags
from kvforge.server.tool_parsers import (
    PARSERS,
    HermesStream,
    parse_calls,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_openai,
    parse_pythonic,
    stream_calls,
)

pytest.importorskip("xgrammar")

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "parameters": {"zone": "UTC"}}\n</tool_call>')
BROKEN = 'a <tool_call>\n{"name": oops}\n</tool_call> b <tool_call>{"name": "x", "arguments": {}}'


def test_whole_outputs():
    assert parse_hermes(TWO_CALLS) == ("Let me check.", [("get_weather", '{"city": "Paris"}'),
                                                          ("get_time", '{"zone": "UTC"}')])
    assert parse_hermes("just text <tool") == ("just text <tool", [])
    assert parse_hermes(BROKEN) == (BROKEN, [])  # a block that is not a call, and one left open: content
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>') == ("", [("f", "{}")])
    stringified = '<tool_call>{"name": "f", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert parse_hermes(stringified) == ("", [("f", '{"tz": "UTC"}')])  # arguments sent as their JSON text
    for not_a_call in ('{"name": "f"}', '{"name": "f", "arguments": "UTC"}', '{"name": "f", "arguments": [1]}'):
        text = f"<tool_call>{not_a_call}</tool_call>"
        assert parse_hermes(text) == (text, [])


LLAMA_CALLS = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def test_llama3_json_whole_outputs():
    assert parse_llama3_json(LLAMA_CALLS) == ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert parse_llama3_json('<|python_tag|>{"name": "f", "arguments": {"a": 1}}') == ("", [("f", '{"a": 1}')])
    for text in ("The weather is fine.", '{"name": "f", "parameters": {}} and then text', '{"city": "Paris"}',
                 "{not json", '{"name": "Alice", "age": 30}', '{"name": "f", "parameters": "UTC"}'):
        assert parse_llama3_json(text) == (text, [])  # an answer that is JSON is not a call


PYTHONIC_CALLS = ' [get_weather(city="Paris", days=(1, 2), metric=True, note=None), get_time()]\n'


def test_pythonic_whole_outputs():
    assert parse_pythonic(PYTHONIC_CALLS) == ("", [
        ("get_weather", '{"city": "Paris", "days": [1, 2], "metric": true, "note": null}'), ("get_time", "{}")])
    assert parse_pythonic("[f(text='Météo ☀', n=-3.5, d={'a': [1]})]") == (
        "", [("f", '{"text": "Météo ☀", "n": -3.5, "d": {"a": [1]}}')])
    for text in ("The weather is fine.", "[1, 2, 3]", "[]", "[f(x)]", "[f(**kw)]", "[f(a=g())]", "[f(a=x)]",
                 "[f(a={1, 2})]", "[f(a=b'x')]", "[obj.f(a=1)]", "[f(a=1)] and then text", "[f(a=1)",
                 "text [f(a=1)]", "[f(a=1), 2]"):
        assert parse_pythonic(text) == (text, [])  # not a list of calls with literal keywords: content


MISTRAL_V3 = 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
             '{"name": "get_time", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


def test_mistral_whole_outputs():
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert parse_mistral(MISTRAL_V3) == ("Let me look.", calls)
    assert parse_mistral(MISTRAL_V11) == ("", calls)
    assert parse_mistral('[TOOL_CALLS] {"name": "f", "arguments": {"a": 1}}') == ("", [("f", '{"a": 1}')])
    for text in ("The weather is fine.", "[TOOL_CALLS]", "[TOOL_CALLS][1, 2]", '[TOOL_CALLS]{"city": "Paris"}',
                 "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]f[ARGS]{broken", "[TOOL_CALLS]f[ARGS][1]",
                 '[TOOL_CALLS]f{"a": 1}', 'x [TOOL_CALLS][{"name": "f", "arguments": {}}] and more'):
        assert parse_mistral(text) == (text, [])  # not calls only after the tag: all content


HARMONY_CALL = ('Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                '<|message|>{"city": "Paris"}')


def test_openai_whole_outputs():
    """gpt-oss's harmony calls, as the harmony split leaves them in the answer (kvforge/server/harmony_split.py)."""
    assert parse_openai(HARMONY_CALL) == ("Checking.", [("get_weather", '{"city": "Paris"}')])
    before = '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|end|>'
    assert parse_openai(before + HARMONY_CALL) == ("Checking.", [("f", '{"a": 1}'), ("get_weather",
                                                                                    '{"city": "Paris"}')])
    for text in ("It is sunny.", "<|channel|>commentary to=browser.search<|message|>{}"):
        assert parse_openai(text) == (text, [])  # not a function call: content as written
    # a function call cut short (or broken) is dropped with its markers: no markup reaches the content
    assert parse_openai("Checking.<|channel|>commentary to=functions.f<|message|>{\"city\": \"Pa") == ("Checking.", [])
    assert parse_openai("\nLet me.<|channel|>commentary to=functions.f<|message|>{}") == ("\nLet me.", [("f", "{}")])


@pytest.mark.parametrize("parser, text", [
    ("openai", HARMONY_CALL), ("openai", "plain <|sta text"), ("openai", "x<|channel|>commentary to=functions.f"),
    ("openai", "\n  Let me.<|channel|>commentary to=functions.f<|message|>{}"),
    ("openai", "Go.<|channel|>commentary to=functions.f<|message|>{\"a\": 1<|end|>tail"),
    ("mistral", MISTRAL_V3), ("mistral", MISTRAL_V11), ("mistral", "plain [TOOL_CAL text [ and [TOOL"),
    ("mistral", "  hi [TOOL_CALLS]broken  "), ("mistral", "Météo ☀  \n[TOOL_CALLS]f[ARGS]{}"),
    ("pythonic", PYTHONIC_CALLS), ("pythonic", "  plain text ["), ("pythonic", "[1, 2"), ("pythonic", "[f(x)]"),
    ("pythonic", "\n[f(a=1)]"),
    ("hermes", TWO_CALLS), ("hermes", BROKEN), ("hermes", "plain <tool_cal text < and <"), ("hermes", "x" * 5),
    ("hermes", 'Ok.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone here. '),
    ("hermes", '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
               '</tool_call>\n'),
    ("hermes", 'Météo ☀ <tool_call>{"name": "f", "arguments": {}}</tool_call>'), ("hermes", "  hi there  \n"),
    ("llama3_json", LLAMA_CALLS), ("llama3_json", "  plain text {"), ("llama3_json", "{broken"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}'), ("llama3_json", "<|pyt and text"),
])
def test_streamed_parse_equals_the_whole_one(parser, text):
    """Fed every prefix in turn (one character at a time), the stream hands out the whole parse's calls and
    exactly its content."""
    stream, content, calls = PARSERS[parser].stream(), [], []
    for end in range(1, len(text)):
        new, found = stream.feed(text[:end])
        content.append(new)
        calls.extend(found)
    new, found = stream.finish(text)
    content.append(new)
    calls.extend(found)
    assert stream.calls == len(calls)
    whole_content, whole_calls = PARSERS[parser].parse(text)
    assert calls == whole_calls
    assert "".join(content) == whole_content
    if parser == "hermes":
        assert HermesStream().feed("text <tool_") == ("text", [])  # a tail that may open a block waits, as do spaces


@pytest.mark.parametrize("parser, text", [("hermes", TWO_CALLS), ("llama3_json", LLAMA_CALLS),
                                          ("pythonic", PYTHONIC_CALLS), ("mistral", MISTRAL_V11)])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, text):
    """``parallel_tool_calls`` false: the first call of the whole parse, whole or streamed, the content as it was."""
    content, calls = PARSERS[parser].parse(text)
    assert len(calls) == 2
    assert parse_calls(parser, text, parallel=False) == (content, calls[:1])
    stream, streamed, found = stream_calls(parser, parallel=False), [], []
    for end in range(1, len(text)):
        new, more = stream.feed(text[:end])
        streamed.append(new)
        found.extend(more)
    new, more = stream.finish(text)
    assert ("".join(streamed) + new, found + more) == (content, calls[:1]) and stream.calls == 1


@pytest.mark.parametrize("argv, says", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser is read only with --enable-auto-tool-choice"),
])
def test_flags_need_each_other(argv, says):
    import argparse

    from kvforge.errors import ConfigError

    ns = add_serve_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ConfigError, match=says):
        check_server_flags(ns)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def servers():
    """``servers(parser)``: an openai client of a server on the embedded model with that tool-call parser,
    started on first use; all stopped when the module's tests are done."""
    running = {}

    def client_for(parser):
        if parser not in running:
            engine = smollm2_test_engine(max_model_len=512, max_num_seqs=8, extra_args=("--kv-cache-memory", "256M"))
            running[parser] = engine, ServerThread(create_app(engine, tool_parser=parser)).start()
        url = running[parser][1].url
        return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    yield client_for
    for engine, srv in running.values():
        srv.stop()
        engine.shutdown()


@pytest.fixture
def client(servers):
    return servers("hermes")


def test_auto_choice_parses_the_models_calls(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[WEATHER], max_tokens=150, temperature=0,
              extra_body={"guided_regex": HERMES})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and re.fullmatch(r"[A-Z][a-z]{2,9}",
                                                                json.loads(call.function.arguments)["city"])
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert text.strip() == "Checking." and [(t.index, t.function.name, t.function.arguments) for t in calls] == \
        [(0, "get_weather", call.function.arguments)]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"] and chunks[-1].choices[0].delta.tool_calls is None


def test_auto_choice_without_a_call_is_text(client):
    model = client.models.list().data[0].id
    choice = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=12, temperature=0).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


LLAMA = r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,9}"\}\}'


PYTHONIC = r'\[get_weather\(city="[A-Z][a-z]{2,9}"\)\]'


@pytest.mark.parametrize("parser, pattern", [("llama3_json", LLAMA), ("pythonic", PYTHONIC)])
def test_whole_output_formats_auto_choice(servers, parser, pattern):
    """Formats whose calls are the whole output: calls and no content, whole or streamed."""
    client = servers(parser)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0,
              extra_body={"guided_regex": pattern})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", call.function.arguments)]
    assert not any(c.choices[0].delta.content for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_parallel_tool_calls_false_under_auto(servers):
    client = servers("pythonic")
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0, parallel_tool_calls=False,
              extra_body={"guided_regex": r'\[get_weather\(city="Paris"\), get_weather\(city="Rome"\)\]'})
    (call,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.arguments) for t in calls] == [(0, call.function.arguments)]
    kw["parallel_tool_calls"] = True
    assert len(client.chat.completions.create(**kw).choices[0].message.tool_calls) == 2


def test_mistral_requests_keep_special_tokens():
    """The mistral parser reads ``[TOOL_CALLS]``, a special token: its requests detokenize with special tokens
    unless they say otherwise; other parsers' requests keep the default."""
    from kvforge.server.protocol import parse_chat

    body = {"model": "m", "messages": ASK, "tools": [WEATHER]}
    assert parse_chat(body, "m", tool_parser="mistral").params.skip_special_tokens is False
    assert parse_chat({**body, "skip_special_tokens": True}, "m", tool_parser="mistral").params.skip_special_tokens
    assert parse_chat(body, "m", tool_parser="hermes").params.skip_special_tokens
    assert parse_chat({**body, "tool_choice": "none"}, "m", tool_parser="mistral").params.skip_special_tokens
