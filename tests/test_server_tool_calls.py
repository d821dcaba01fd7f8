"""Tool calls forced by ``tool_choice`` (``"required"`` or a named function; kvforge/server/tool_calls.py):
the request's parsing, the tools and earlier calls as a chat template sees them, and the official ``openai``
client against the embedded SmolLM2 (CPU). Arguments are checked with Python's ``json`` against the declared
parameters by hand."""

from __future__ import annotations

import json

import openai
import pytest
from fake_engine import openai_client, smollm2_server

from kvforge.server.protocol import InvalidRequestError, parse_chat, parse_completion
from kvforge.server.tokenization import parse_tokenize, render_chat

pytest.importorskip("xgrammar")

MODEL = "m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(**fields):
    return parse_chat({"model": MODEL, "messages": ASK, **fields}, MODEL)


def _weather_ok(arguments: str) -> bool:
    value = json.loads(arguments)
    return (list(value) == ["city", "unit"] and isinstance(value["city"], str) and len(value["city"]) <= 24
            and value["unit"] in ("celsius", "fahrenheit"))


def _call_ok(call) -> bool:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return _weather_ok(call.function.arguments)
    return call.function.name == "get_time" and list(args) == ["zone"] and args["zone"] in ("UTC", "CET", "PST")


def test_the_choice_sets_the_constraint():
    named = _chat(tools=[WEATHER, TIME], tool_choice=NAMED)
    assert json.loads(named.params.structured_outputs.json) == WEATHER["function"]["parameters"]
    required = json.loads(_chat(tools=[WEATHER, TIME], tool_choice="required").params.structured_outputs.json)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    one = json.loads(_chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
                     .params.structured_outputs.json)
    assert one["maxItems"] == 1
    none = _chat(tools=[WEATHER], tool_choice="none")
    assert none.params.structured_outputs is None and none.tool_choice is None
    assert dict(none.chat_options.template_kwargs)["tools"] == [WEATHER]
    assert _chat(tool_choice="auto").tool_choice is None  # no tools: nothing to call


@pytest.mark.parametrize("fields, field", [
    ({"tools": [WEATHER]}, "tool_choice"),  # OpenAI's default "auto" needs a parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [WEATHER], "tool_choice": "none", "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    # no "type", but a schema of something other than an object: null, a referenced string
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "null"}]}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}}}}], "tool_choice": "none"},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "integer"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_refused_by_name(fields, field):
    with pytest.raises(InvalidRequestError) as err:
        _chat(**fields)
    assert err.value.field == field, err.value


UNIT = {"enum": ["c", "f"], "title": "Unit", "type": "string"}
NESTED = {"type": "function", "function": {"name": "where", "parameters": {
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 20}},
                          "required": ["street"], "title": "Address"}, "Unit": UNIT},
    "type": "object", "properties": {"addr": {"$ref": "#/$defs/Address"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["addr", "unit"]}}}


def test_required_keeps_each_functions_definitions_at_the_root():
    """pydantic writes nested models and enums under $defs, referenced from the root: in the required array
    the definitions move to its root, where those references resolve; a clash of two definitions is refused."""
    other = {"type": "function", "function": {"name": "units", "parameters": {
        "$defs": {"Unit": UNIT}, "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "required": ["u"]}}}
    schema = json.loads(_chat(tools=[NESTED, other], tool_choice="required").params.structured_outputs.json)
    assert schema["$defs"] == NESTED["function"]["parameters"]["$defs"]
    assert all("$defs" not in c["properties"]["parameters"] for c in schema["items"]["anyOf"])
    clash = {"type": "function", "function": {"name": "clash", "parameters": {
        "$defs": {"Unit": {"enum": ["k"]}}, "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}}}}
    with pytest.raises(InvalidRequestError, match=r"define \$defs/Unit differently"):
        _chat(tools=[NESTED, clash], tool_choice="required")


def test_completions_refuse_tools():
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"model": MODEL, "prompt": "hi", "tools": [WEATHER], "tool_choice": "required"}, MODEL)
    assert err.value.field == "tools" and "/v1/chat/completions" in str(err.value)


def test_tools_and_earlier_calls_reach_the_template():
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_model_path())
    tokenizer.use_chat_template(
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = parse_chat({"model": MODEL, "messages": history, "tools": [WEATHER, TIME], "tool_choice": "none"}, MODEL)
    assert req.messages[1]["tool_calls"][1]["function"]["arguments"] == {}  # no arguments: an empty object
    text = render_chat(tokenizer, req.messages, req.chat_options)
    assert text.startswith("[tool get_weather][tool get_time]<user>")
    assert "<assistant>[call call_1 get_weather Paris][call call_2 get_time ]<tool>sunny[result of call_1]" in text
    tokenize = parse_tokenize({"model": MODEL, "messages": history, "tools": [WEATHER]}, MODEL)
    assert dict(tokenize.chat_options.template_kwargs)["tools"] == [WEATHER]


def test_llm_chat_renders_tools():
    from kvforge import LLM, SamplingParams

    with LLM(progress=False, max_model_len=256, kv_cache_memory=64 << 20,
             chat_template="{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                           "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>") as llm:
        out = llm.chat(ASK, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False, tools=[WEATHER])[0]
    assert out.prompt.startswith("[tool get_weather]<user>")


@pytest.fixture(scope="module")
def client():
    with smollm2_server() as srv:
        yield openai_client(srv)


@pytest.fixture(scope="module")
def served(client) -> str:
    return client.models.list().data[0].id


def test_named_function(client, served):
    r = client.chat.completions.create(model=served, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                                       max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert _weather_ok(call.function.arguments), call.function.arguments
    stream = client.chat.completions.create(model=served, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                                            max_tokens=60, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    fragments = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert fragments[0].id and fragments[0].function.name == "get_weather" and fragments[0].type == "function"
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments[1:])
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments
    assert not any(d.content for d in deltas)
    # Cut by the limit inside the arguments, streamed with continuous usage: the last step's arguments go in a
    # chunk before the finish's, and both count every token of the output.
    chunks = list(client.chat.completions.create(
        model=served, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    finish = next(k for k, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    assert chunks[finish].choices[0].finish_reason == "length" and chunks[finish - 1].choices[0].delta.tool_calls
    assert [c.usage.completion_tokens for c in chunks[finish - 1:]] == [5, 5, 5]


def test_named_function_without_arguments_streams_its_call(client, served):
    """A stop string that ends the output before its first character: the call comes back with the (empty)
    arguments generated, whole and streamed alike."""
    kw = dict(model=served, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=20, temperature=0,
              stop=["{"])
    (call,) = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert (call.function.name, call.function.arguments) == ("get_weather", "")
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("get_weather", "")]


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, served, parallel):
    kw = dict(model=served, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
              temperature=0, parallel_tool_calls=parallel)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(_call_ok(c) for c in calls) and (parallel or len(calls) == 1)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    with_calls = [k for k, c in enumerate(chunks) if c.choices[0].delta.tool_calls]
    # Arguments arrive as they are generated, in many chunks; the finish comes in a chunk after the calls
    # (OpenAI's order: the SDK closes calls on the finish).
    assert len(with_calls) > 1 and all(chunks[k].choices[0].finish_reason is None for k in with_calls)
    assert [c.choices[0].finish_reason for c in chunks[with_calls[-1] + 1:]] == ["tool_calls"]
    joined: dict[int, list] = {}
    for k in with_calls:
        for piece in chunks[k].choices[0].delta.tool_calls:
            if piece.index not in joined:  # a call's first fragment: its id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                joined[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                assert piece.id is None and piece.function.name is None
                joined[piece.index][1] += piece.function.arguments
    assert [tuple(joined[k]) for k in sorted(joined)] == [(c.function.name, c.function.arguments) for c in calls]


def test_nested_definitions_and_no_parameters(client, served):
    r = client.chat.completions.create(model=served, messages=ASK, tools=[NESTED], tool_choice="required",
                                       max_tokens=80, temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "where" and args["unit"] in ("c", "f") and isinstance(args["addr"]["street"], str)
    bare = {"type": "function", "function": {"name": "get_time"}}  # no parameters: OpenAI's empty list
    r = client.chat.completions.create(model=served, messages=ASK, tools=[bare], max_tokens=20, temperature=0.8,
                                       seed=4, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}


def test_a_compile_error_names_the_function(client, served):
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served, messages=ASK, tools=tools, tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tools[1].function.parameters"
    assert "tools[1].function.parameters#/properties/a" in err.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},  # the compiler's message: no path
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},  # a path into the array's shared $defs
     "$defs": {"A": {"$ref": "#/$defs/A"}}},
])
def test_a_compile_error_without_a_path_names_the_function(client, served, choice, parameters):
    tools = [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served, messages=ASK, tools=tools, tool_choice=choice, max_tokens=4)
    assert err.value.body["param"] == "tools[1].function.parameters", err.value.message
    assert "- tools[1].function.parameters could not be compiled" in err.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}, "harmony"])
@pytest.mark.parametrize("schema, told", [
    ({"type": "integer", "minimum": 1.5}, 'minimum 1.5 at tools[1].function.parameters#/properties/a/minimum: an '
                                          'integer\'s bound must be a whole number; give "minimum": 2'),
    ({"type": "number", "maximum": 1e400}, "not finite (inf) at tools[1].function.parameters#/properties/a/maximum"),
])
def test_a_parameters_schema_refused_when_parsed_names_its_own_path(choice, schema, told):
    """A value refused as the request is read is told at its path inside the function's parameters, not
    inside the schema a "required" array of calls is held to."""
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": schema}}}}]
    body = json.loads(json.dumps({"model": MODEL, "messages": ASK, "tools": tools,
                                  "tool_choice": "required" if choice == "harmony" else choice}))
    from kvforge.server.tool_calls import parse_tools

    with pytest.raises(InvalidRequestError) as err:
        parse_tools(body, harmony=True) if choice == "harmony" else parse_chat(body, MODEL)
    assert err.value.field == "tools[1].function.parameters", err.value
    assert told in str(err.value) and "items/anyOf" not in str(err.value), err.value


def test_cut_short_required_comes_back_as_text(client, served):
    r = client.chat.completions.create(model=served, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=5, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.startswith("[")


def test_a_conversation_with_a_call_and_its_result_goes_on(client, served):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=served, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
