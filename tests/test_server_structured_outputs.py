"""Structured outputs through the OpenAI-compatible server: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, with the official ``openai`` client against the
embedded SmolLM2 (CPU). Outputs are checked with Python's ``json`` and ``re``; refusals are 400s naming the
field, and the server goes on serving."""

from __future__ import annotations

import json
import re

import openai
import pytest
from fake_engine import openai_client, smollm2_server

from kvforge.server.protocol import InvalidRequestError, parse_chat, parse_completion

pytest.importorskip("xgrammar")

MODEL = "m"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"]}


@pytest.fixture(scope="module")
def server():
    with smollm2_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _model(client) -> str:
    return client.models.list().data[0].id


def _city_ok(text: str) -> bool:
    value = json.loads(text)
    return (list(value) == ["city", "population"] and isinstance(value["city"], str) and len(value["city"]) <= 20
            and type(value["population"]) is int and value["population"] >= 0)


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_every_spelling_gives_one_constraint(parse, body):
    spellings = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
         {"json": CITY}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"guided_json": json.dumps(CITY)}, {"json": CITY}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "xgrammar"}, {"grammar": 'root ::= "x"'}),
        ({"response_format": {"type": "text"}}, None),
    ]
    for fields, want in spellings:
        got = parse({**body, "model": MODEL, **fields}, MODEL).params.structured_outputs
        if want is None:
            assert got is None
        else:
            assert got is not None and got.kind == next(iter(want)), fields
            value = getattr(got, got.kind)
            assert (json.loads(value) if got.kind == "json" else list(value) if got.kind == "choice"
                    else value) == next(iter(want.values()))


@pytest.mark.parametrize("fields, field", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_constraints_are_refused_by_name(fields, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**CHAT, "model": MODEL, **fields}, MODEL)
    assert err.value.field == field, err.value


@pytest.mark.parametrize("fields, field", [
    ({"guided_json": {"type": "number", "maximum": 1e400}}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "number", "maximum": 1e400}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number",
                                                                                          "maximum": 1e400}}}},
     "response_format.json_schema.schema"),
])
def test_a_schema_number_beyond_a_double_is_refused_when_parsed(fields, field):
    """A body's 1e400 reads as infinity: refused as the request is read, naming the field and the number's place."""
    body = json.loads(json.dumps({**CHAT, "model": MODEL, **fields}))  # as the server decodes a body
    with pytest.raises(InvalidRequestError, match=re.escape(f"{field} holds a number that is not finite (inf) at "
                                                            "#/maximum")) as err:
        parse_chat(body, MODEL)
    assert err.value.field == field


@pytest.mark.parametrize("fields, field", [
    ({"guided_json": {"type": "integer", "minimum": 1.5}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer",
                                                                                          "minimum": 1.5}}}},
     "response_format.json_schema.schema"),
])
def test_a_schema_xgrammar_cannot_compile_is_refused_when_parsed(fields, field):
    with pytest.raises(InvalidRequestError, match=re.escape(f"{field} is a schema xgrammar cannot compile: minimum 1.5 "
                                                            f'at #/minimum: an integer\'s bound must be a whole number; '
                                                            f'give "minimum": 2')) as err:
        parse_chat({**CHAT, "model": MODEL, **fields}, MODEL)
    assert err.value.field == field


def test_two_constraints_are_refused_naming_both():
    with pytest.raises(InvalidRequestError, match="a request takes one output constraint, but guided_regex and "
                                                  "guided_choice both give one: send one of them"):
        parse_chat({**CHAT, "model": MODEL, "guided_regex": "a", "guided_choice": ["a"]}, MODEL)


def test_openai_client_json_schema_and_choice(client):
    model = _model(client)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a large city and its population as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert r.choices[0].finish_reason == "stop" and _city_ok(r.choices[0].message.content), r.choices[0]
    r = client.completions.create(model=model, prompt="The sentiment of 'I love it' is", max_tokens=5,
                                  temperature=0, extra_body={"structured_outputs": {"choice": ["good", "bad"]}})
    assert r.choices[0].text in ("good", "bad") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model, prompt="A date:", max_tokens=20, temperature=0.9, seed=3, n=2,
                                  extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert all(re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", c.text) for c in r.choices), r.choices


def test_streamed_json_schema(client):
    stream = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=60,
        temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _city_ok(text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
])
def test_a_refused_constraint_names_the_field_the_request_used(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, extra_body=fields)
    assert err.value.body["param"] == param and param in err.value.message, err.value.body
    assert "/project/" not in err.value.message  # xgrammar's source position is not the client's business


def test_uncompilable_constraint_is_a_400_and_the_server_goes_on(client):
    model = _model(client)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "(open"})
    assert err.value.body["param"] == "guided_regex" and "could not be compiled" in err.value.message
    r = client.completions.create(model=model, prompt="Yes or no:", max_tokens=4, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_prompt_only_echo_ignores_the_constraint(client):
    """echo with max_tokens 0 generates nothing: a constraint changes none of the prompt's logprobs (its last
    token, forced, is one the constraint would refuse first)."""
    model = _model(client)
    kw = dict(model=model, prompt="The sky is blue", max_tokens=0, echo=True, logprobs=1, temperature=0)
    plain = client.completions.create(**kw).choices[0]
    constrained = client.completions.create(**kw, extra_body={"guided_regex": "[0-9]+"}).choices[0]
    assert constrained.text == plain.text == "The sky is blue"
    assert constrained.logprobs.token_logprobs == plain.logprobs.token_logprobs
