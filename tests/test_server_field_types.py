"""Request fields keep their JSON types: a value of another type is a 400 naming the field and the type it takes
(never read through Python's truthiness or ``True == 1``), fields served only at a value that changes nothing are
type-checked first, and a request value an error shows is JSON, cut short."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402
from http_json import http  # noqa: E402

from kvforge.errors import InvalidRequestError  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.protocol import parse_chat, parse_completion  # noqa: E402
from kvforge.server.responses import chat_body  # noqa: E402

MODEL = "m"
PROMPT = {"model": MODEL, "prompt": "hi"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _refused(parse, body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        parse(body, MODEL)
    return err.value


BOTH_ROUTES = [(parse_completion, PROMPT), (parse_chat, CHAT)]
WRONG_TYPES = [  # (field, value, the type the message names, the type the value has)
    ("length_penalty", True, "a number", "boolean"),
    ("use_beam_search", 0, "a boolean", "integer"),
    ("bad_words", "", "an array", "string"),
    ("logits_processors", {}, "an array", "object"),
    ("add_special_tokens", 1, "a boolean", "integer"),
    ("parallel_tool_calls", "yes", "a boolean", "string"),
    ("guided_decoding_backend", 5, "a string", "integer"),
]


@pytest.mark.parametrize("parse, body", BOTH_ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize("field, value, wanted, got", WRONG_TYPES, ids=[case[0] for case in WRONG_TYPES])
def test_a_value_of_another_type_is_refused_naming_the_type(parse, body, field, value, wanted, got):
    if field == "add_special_tokens" and parse is parse_chat:
        value = 0  # False == 0: the chat route's own value, as an integer
    error = _refused(parse, {**body, field: value})
    assert error.field == field and str(error) == f"'{field}': expected {wanted}, got {got}"


@pytest.mark.parametrize("field, wanted", [("suffix", "a string"), ("tools", "an array"), ("functions", "an array")])
@pytest.mark.parametrize("value, got", [(0, "integer"), (False, "boolean"), ({}, "object"), ("", "string")])
def test_completion_fields_served_at_their_empty_value_are_typed(field, wanted, value, got):
    if field == "suffix" and value == "":
        assert parse_completion({**PROMPT, field: value}, MODEL)  # the empty suffix: nothing to add
        return
    error = _refused(parse_completion, {**PROMPT, field: value})
    assert error.field == field and str(error) == f"'{field}': expected {wanted}, got {got}"


@pytest.mark.parametrize("parse, body", BOTH_ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize("fields", [
    {"length_penalty": 1}, {"length_penalty": 1.0}, {"length_penalty": None}, {"use_beam_search": False},
    {"bad_words": []}, {"logits_processors": None}, {"parallel_tool_calls": False}, {"parallel_tool_calls": None},
    {"guided_decoding_backend": "xgrammar"}, {"guided_decoding_backend": None}, {"logit_bias": {"12": 1}},
])
def test_neutral_and_null_values_are_still_accepted(parse, body, fields):
    assert parse({**body, **fields}, MODEL)


@pytest.mark.parametrize("fields", [{"suffix": None}, {"suffix": ""}, {"tools": []}, {"tools": None},
                                    {"functions": []}])
def test_completion_neutral_values_are_still_accepted(fields):
    assert parse_completion({**PROMPT, **fields}, MODEL)


def test_logit_bias_keys_are_digits_alone():
    for key in (" 1", "1 ", "\t7"):
        error = _refused(parse_completion, {**PROMPT, "logit_bias": {key: 5}})
        assert error.field == "logit_bias" and f"got {key!r}".replace("'", '"') in str(error)


@pytest.mark.parametrize("message, field, says", [
    ({"role": "user", "content": "hi", "name": 5}, "messages[0].name", "expected a string, got integer"),
    ({"role": "assistant", "content": "", "name": True}, "messages[0].name", "expected a string, got boolean"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id", "expected a string, got integer"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": 7}}]}, "messages[0].tool_calls[0].function.arguments",
     "expected a string or an object, got integer"),
])
def test_message_fields_keep_their_types(message, field, says):
    error = _refused(parse_chat, {**CHAT, "messages": [message, {"role": "user", "content": "go"}]})
    assert error.field == field and str(error) == f"'{field}': {says}"


@pytest.mark.parametrize("arguments, template_gets", [('{"a": 1}', {"a": 1}), ({"a": 1}, {"a": 1}), ("", {}),
                                                      (None, {}), ("not json", "not json")])
def test_call_arguments_as_openai_and_vllm_take_them(arguments, template_gets):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    req = parse_chat({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "user", "content": "go", "name": "ann"}]}, MODEL)
    assert req.messages[0]["tool_calls"][0]["function"]["arguments"] == template_gets


RESPONSES_WRONG_TYPES = [  # (field, value, the type the message names, the type the value has)
    ("include", False, "an array", "boolean"), ("include", "", "an array", "string"),
    ("include", {}, "an array", "object"), ("top_logprobs", False, "an integer", "boolean"),
    ("max_tool_calls", False, "an integer", "boolean"), ("max_tokens", "", "an integer", "string"),
    ("prompt", False, "an object", "boolean"), ("prompt", "", "an object", "string"),
    ("background", 0, "a boolean", "integer"), ("background", {}, "a boolean", "object"),
    ("n", True, "an integer", "boolean"), ("conversation", False, "a string or an object", "boolean"),
    ("truncation", 0, "a string", "integer"),
]


@pytest.mark.parametrize("field, value, wanted, got", RESPONSES_WRONG_TYPES)
def test_responses_fields_served_at_one_value_are_typed(field, value, wanted, got):
    with pytest.raises(InvalidRequestError) as err:
        chat_body({"model": MODEL, "input": "hi", field: value})
    assert err.value.field == field and str(err.value) == f"'{field}': expected {wanted}, got {got}"


@pytest.mark.parametrize("fields", [{"include": []}, {"include": None}, {"top_logprobs": 0}, {"background": False},
                                    {"n": 1}, {"n": None}, {"max_tokens": None}, {"prompt": None},
                                    {"truncation": "disabled"}, {"max_tool_calls": None}])
def test_responses_neutral_values_are_still_accepted(fields):
    assert chat_body({"model": MODEL, "input": "hi", **fields})


@pytest.mark.parametrize("part", [{"type": "input_text"}, {"type": "input_text", "text": None}])
def test_a_responses_text_part_without_text_names_text(part):
    with pytest.raises(InvalidRequestError) as err:
        chat_body({"model": MODEL, "input": [{"role": "user", "content": [part]}]})
    assert err.value.field == "input[0].content[0].text"
    assert str(err.value) == "'input[0].content[0].text': expected a string, got null"


BIG = "x" * 100_000


@pytest.mark.parametrize("fields, field", [
    ({"model": BIG}, "model"), ({"tool_choice": BIG}, "tool_choice"), ({"guided_decoding_backend": BIG},
                                                                        "guided_decoding_backend"),
    ({"reasoning_effort": BIG}, "reasoning_effort"), ({"logit_bias": {BIG: 1}}, "logit_bias"),
    ({"messages": [{"role": BIG, "content": "hi"}]}, "messages[0].role"),
    ({"response_format": {"type": BIG}}, "response_format.type"),
])
def test_a_request_value_is_shown_cut_short(fields, field):
    error = _refused(parse_chat, {**CHAT, **fields})
    assert error.field == field and len(str(error)) < 400 and '"xxxx' in str(error) and 'xxx..."' not in str(error)


@pytest.mark.parametrize("fields, shown", [
    ({"reasoning_effort": True}, "got true"), ({"guided_decoding_backend": "outlines"}, 'got "outlines"'),
    ({"tool_choice": "any"}, 'got "any"'), ({"messages": [{"role": None, "content": "hi"}]}, "is required"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "unknown role 5"),
    ({"logit_bias": {"1": None}}, "got null for token 1"),
])
def test_a_request_value_is_shown_as_json(fields, shown):
    assert shown in str(_refused(parse_chat, {**CHAT, **fields}))


def test_type_names_are_json_names():
    assert str(_refused(parse_chat, {**CHAT, "tools": "x"})) == "'tools': expected an array, got string"
    error = _refused(parse_chat, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": 5}}})
    assert str(error) == "'tool_choice.function.name': expected a string, got integer"


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(FakeEngine(max_model_len=64))) as srv:
        yield srv


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
@pytest.mark.parametrize("body, got", [([1], "array"), (b"null", "null"), (b"7", "integer"), (b'"hi"', "string")])
def test_a_body_that_is_not_an_object_names_body(server, path, body, got):
    status, reply = http("POST", server.url + path, body)
    assert status == 400 and reply["error"]["param"] == "body"
    assert reply["error"]["message"] == f"'body': expected a JSON object, got {got}"


def test_a_prompt_too_long_for_the_context_says_the_instructions_count(server):
    status, reply = http("POST", server.url + "/v1/responses", {"input": "hi", "instructions": "Be brief. " * 10})
    assert status == 400 and reply["error"]["param"] == "input"
    assert "the prompt (the instructions, any earlier turns and the input together) has" in reply["error"]["message"]


def test_shown_values_are_json_and_short():
    from kvforge.server.request_fields import SHOWN_CHARS, shown

    assert [shown(v) for v in (True, None, 1.5, "a", {"k": [1]})] == ["true", "null", "1.5", '"a"', '{"k": [1]}']
    assert shown(BIG) == '"' + "x" * (SHOWN_CHARS - 1) + "..." and len(shown(list(range(10**4)))) == SHOWN_CHARS + 3
