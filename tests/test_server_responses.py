"""OpenAI's Responses API, ``POST /v1/responses`` (kvforge/server/responses.py, responses_output.py), driven by the
official openai client: each response is checked against the chat completion of the same conversation
(greedy), its stream against the whole response, and bad requests against the field they name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import openai_client, smollm2_server  # noqa: E402

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def client():
    with smollm2_server() as srv:
        yield openai_client(srv)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def _events(client, **kw) -> list:
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    return events


def test_text_equals_the_chat_answer_whole_and_streamed(client, model):
    kw = dict(model=model, input="Say hello in French.", instructions="Be brief.", max_output_tokens=12,
              temperature=0)
    chat = _chat(client, model, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Say hello in French."}], max_completion_tokens=12)
    r = client.responses.create(**kw)
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and r.output_text == \
        chat.choices[0].message.content
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    events = _events(client, **kw)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == r.output_text and final.status == r.status
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in final.output]  # the final object holds the streamed items
    with client.responses.stream(**kw) as stream:  # the SDK's helper ends on response.completed
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == r.output_text


def test_input_items_are_the_conversation(client, model):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped: earlier reasoning is not shown again
             {"role": "user", "content": "And of Italy?"}]
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    r = client.responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
    chat = _chat(client, model, messages, max_completion_tokens=8)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_function_call_and_its_output_are_history(client, model):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "Sunny, 21 C"}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, 21 C"}]
    r = client.responses.create(model=model, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=10,
                                temperature=0)
    chat = _chat(client, model, messages, tools=[CHAT_WEATHER], tool_choice="none", max_completion_tokens=10)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_calls_are_function_call_items(client, model, choice):
    kw = dict(model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=60,
              temperature=0, parallel_tool_calls=False)
    chat_choice = choice if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    expected = _chat(client, model, [{"role": "user", "content": "Weather in Paris?"}], tools=[CHAT_WEATHER],
                     tool_choice=chat_choice, max_completion_tokens=60, parallel_tool_calls=False)
    (chat_call,) = expected.choices[0].message.tool_calls
    r = client.responses.create(**kw)
    (call,) = r.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", chat_call.function.arguments)
    assert call.call_id.startswith("call_") and json.loads(call.arguments)["city"]
    events = _events(client, **kw)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (streamed,) = events[-1].response.output
    assert "".join(deltas) == streamed.arguments == call.arguments
    assert len(deltas) > 1  # the arguments stream as they are generated, a "required" array's too


def test_json_schema_format_holds_the_text(client, model):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="Give a number as JSON.", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "number", "schema": schema}})
    chat = _chat(client, model, [{"role": "user", "content": "Give a number as JSON."}], max_completion_tokens=30,
                 response_format={"type": "json_schema", "json_schema": {"name": "number", "schema": schema}})
    assert r.output_text == chat.choices[0].message.content and isinstance(json.loads(r.output_text)["n"], int)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("kw, param", [
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
    (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
    (dict(input="hi", previous_response_id="resp_1"), "previous_response_id"),  # nothing stored here
    (dict(input="hi", tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(input="hi", tools=[{**WEATHER, "name": "bad name"}]), "tools[0].name"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
    (dict(input=[]), "input"),
    (dict(input="hi", text={"format": {"type": "grammar"}}), "text.format"),
    (dict(input="hi", temperature=-1), "temperature"),
    (dict(input="hi", max_output_tokens=10**6), "max_output_tokens"),  # refused when queued, past the context
    (dict(input="hi " * 600), "input"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}),
     "text.format.schema"),
    (dict(input="hi", text={"format": {"type": "json_schema", "schema": {"type": "object"}}}), "text.format.name"),
    (dict(input="hi", tools=[{"type": "function", "function": {"name": "f"}}]), "tools[0]"),
    (dict(input="hi", user=5), "user"),
    (dict(input="hi", metadata={"a": 1}), "metadata.a"),
    (dict(input="hi", extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(input="hi", extra_body={"n": 2}), "n"),
    (dict(input="hi", extra_body={"max_tokens": 5}), "max_tokens"),
    (dict(input="hi", include=["message.output_text.logprobs"]), "include"),
])
def test_bad_requests_name_their_field(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, **kw)
    assert err.value.body["param"] == param, err.value.body
    assert client.responses.create(model=model, input="hi", max_output_tokens=1).status  # still serving


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")


def test_auto_tools_without_a_parser_are_refused_in_the_apis_terms(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="hi", tools=[WEATHER])
    assert err.value.body["param"] == "tool_choice" and '{"type": "function", "name": ...}' in err.value.message


HERMES_SCRIPT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                 ' Done, checking now.')


def _scripted(script: str, **app_kwargs):
    from fake_engine import ScriptedEngine

    from kvforge.server.app import ServerThread, create_app

    return ServerThread(create_app(ScriptedEngine(script), **app_kwargs))


def _items(output) -> list[tuple]:
    return [(o.type, o.status, getattr(o, "name", None), getattr(o, "arguments", None),
             "".join(c.text for c in getattr(o, "content", None) or [])) for o in output]


def test_parsed_calls_come_after_the_message_whole_and_streamed():
    """A scripted output with text around a hermes call: one message (the text around the call) and then the
    call, in both forms."""
    with _scripted(HERMES_SCRIPT, tool_parser="hermes") as srv:
        client = openai_client(srv)
        kw = dict(model="fake-model", input="Weather?", tools=[WEATHER], max_output_tokens=200)
        whole = _items(client.responses.create(**kw).output)
        streamed = _items(_events(client, **kw)[-1].response.output)
    assert whole == streamed == [
        ("message", "completed", None, None, "Let me check.  Done, checking now."),
        ("function_call", "completed", "get_weather", '{"city": "Paris"}', "")]


@pytest.mark.parametrize("choice, kind", [("none", "message"), ({"type": "function", "name": "get_weather"},
                                                                 "function_call")])
def test_items_the_limit_cut_are_incomplete(choice, kind):
    with _scripted('{"city": "Paris"}') as srv:
        client = openai_client(srv)
        kw = dict(model="fake-model", input="Weather?", tools=[WEATHER], tool_choice=choice, max_output_tokens=5)
        whole = client.responses.create(**kw)
        streamed = _events(client, **kw)[-1].response
    assert whole.status == streamed.status == "incomplete"
    assert _items(whole.output) == _items(streamed.output) and [(o.type, o.status) for o in whole.output] == \
        [(kind, "incomplete")]


def test_objects_and_events_validate_against_the_sdk_types(client, model):
    """Every Response and streamed event as the wire carries it, validated by the openai SDK's own types (the
    client itself builds them leniently)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": model, "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 8,
            "tool_choice": {"type": "function", "name": "get_weather"}, "metadata": {"k": "v"}, "user": "u"}
    raw = client.responses.with_raw_response.create(**body)
    Response.model_validate(json.loads(raw.text))
    events = TypeAdapter(ResponseStreamEvent)
    with client.responses.with_streaming_response.create(**{**body, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.validate_python(json.loads(line[len("data: "):]))


def test_stored_responses_continue_their_conversation(model):
    """``--responses-store-size``: a response names its predecessor and continues its conversation (the prompt is
    the chat of the whole conversation, instructions not carried over); stored ones can be read and deleted;
    ``store: false`` keeps one out; the oldest leave first."""
    with smollm2_server(responses_store_size=2) as srv:
        client = openai_client(srv)
        first = client.responses.create(model=model, input="Name a colour.", instructions="Answer in one word.",
                                        max_output_tokens=6, temperature=0)
        second = client.responses.create(model=model, input="And another?", previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0, stream=True)
        second = [e for e in second][-1].response
        chat = client.chat.completions.create(model=model, temperature=0, max_completion_tokens=6, messages=[
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}])
        assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
        assert second.usage.input_tokens == chat.usage.prompt_tokens and second.store
        assert client.responses.retrieve(first.id).output_text == first.output_text
        (item,) = client.responses.input_items.list(second.id).data  # the request's own input, not the chain's
        assert (item.type, item.role, item.content[0].text) == ("message", "user", "And another?")
        unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        client.responses.delete(second.id)
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=model, input="x", previous_response_id=second.id, max_output_tokens=2)
        assert err.value.body["param"] == "previous_response_id"
        third = client.responses.create(model=model, input="Hi", max_output_tokens=2)
        client.responses.create(model=model, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):  # two kept: the first left when the fourth stored one came
            client.responses.retrieve(first.id)
        assert client.responses.retrieve(third.id).id == third.id


def test_errors_speak_of_responses_fields_in_their_text_too():
    """A chat parser's message naming a chat field other than its own (here under tool_choice) says the
    Responses name, text.format."""
    from kvforge.errors import InvalidRequestError
    from kvforge.server.responses import responses_field

    error = responses_field(InvalidRequestError("forces a call and constrains its output too (response_format or "
                                                "structured_outputs)", field="tool_choice"))
    assert error.field == "tool_choice" and "(text.format or structured_outputs)" in str(error)


def test_input_items_list_back_as_the_sdk_reads_them():
    """``GET /v1/responses/{id}/input_items`` lists a stored response's input: every item kind with an id,
    checked against the SDK's item types; pages by limit, order (desc by default) and after."""
    types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter

    from kvforge.server.responses import input_items

    items = input_items([{"role": "user", "content": "Weather?"},
                         {"type": "reasoning", "id": "rs_1", "summary": []},
                         {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                         {"type": "message", "role": "assistant", "content": [
                             {"type": "output_text", "text": "Ok"}, {"type": "refusal", "refusal": "No more."}]}])
    adapter = TypeAdapter(types.ResponseItem)
    assert [adapter.validate_python(item).type for item in items] == [
        "message", "reasoning", "function_call", "function_call_output", "message"]
    assert len({item["id"] for item in items}) == 5 and items[2]["id"] == "fc_1"
    assert [part["type"] for part in items[4]["content"]] == ["output_text", "refusal"]  # parts kept apart
    with smollm2_server(responses_store_size=1) as srv:
        client = openai_client(srv)
        model = client.models.list().data[0].id
        inputs = [{"role": "user", "content": f"Say {w}."} for w in ("one", "two", "three")]
        r = client.responses.create(model=model, input=inputs, max_output_tokens=2)
        texts = [i.content[0].text for i in client.responses.input_items.list(r.id).data]
        assert texts == ["Say three.", "Say two.", "Say one."]
        page = client.responses.input_items.list(r.id, order="asc", limit=2)
        assert [i.content[0].text for i in page.data] == ["Say one.", "Say two."] and page.has_more
        rest = client.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
        assert [i.content[0].text for i in rest.data] == ["Say three."] and not rest.has_more
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(r.id, limit=0)
        assert err.value.body["param"] == "limit"
