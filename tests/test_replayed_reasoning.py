"""Reasoning sent back with earlier assistant turns: a chat message's ``reasoning`` / ``reasoning_content`` and
a Responses ``reasoning`` item reach the chat template as the assistant turn's ``reasoning_content``
(kvforge/server/protocol.py, responses.py), so templates that show it again (Qwen3's, for the turns of a
tool-calling loop) get it; a ``function_call_output`` must answer a call made before it, once; a replayed
refusal part is its turn's text."""

from __future__ import annotations

import pytest
from jinja2 import Template

from kvforge.errors import InvalidRequestError
from kvforge.server import responses
from kvforge.server.protocol import parse_messages
from kvforge.server.responses_store import ResponsesStore

# The part of a Qwen3-style template that matters here: an assistant turn shows its reasoning_content.
TEMPLATE = Template("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                    "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }}]"
                    "{% endfor %}\n{% endfor %}")
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [],
           "content": [{"type": "reasoning_text", "text": "I should look it up."}]}


def _render(messages: list[dict]) -> str:
    return TEMPLATE.render(messages=parse_messages(messages))


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_assistant_turns_reasoning_reaches_the_template(key):
    text = _render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", key: "greet back"}])
    assert text == "<user>Hi\n<assistant><think>greet back</think>Hello\n"


def test_reasoning_of_other_roles_is_not_passed_and_bad_types_are_named():
    assert "think" not in _render([{"role": "user", "content": "Hi", "reasoning": "not the model's"}])
    with pytest.raises(InvalidRequestError) as err:
        parse_messages([{"role": "assistant", "content": "x", "reasoning": ["a"]}])
    assert err.value.field == "messages[0].reasoning"


def test_a_reasoning_item_goes_with_the_call_that_follows_it():
    items = [{"role": "user", "content": "Weather in Paris?"}, THOUGHT, CALL,
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    chat, _, _ = responses.chat_body({"model": "m", "input": items})
    assert TEMPLATE.render(messages=parse_messages(chat["messages"])) == (
        "<user>Weather in Paris?\n<assistant><think>I should look it up.</think>[get_weather]\n<tool>Sunny\n")


def test_a_summary_stands_for_missing_content_and_reasoning_before_a_user_turn_is_dropped():
    summary = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "short"}]}
    messages = responses.input_messages([{"role": "user", "content": "a"}, summary,
                                         {"type": "message", "role": "assistant", "content": "b"},
                                         THOUGHT, {"role": "user", "content": "c"}])
    assert [m.get("reasoning_content") for m in messages] == [None, "short", None]


def test_a_chained_response_keeps_the_reasoning_of_its_call():
    """A stored response whose output is reasoning and a call, continued with the call's output: the next
    prompt holds the reasoning with the call (the store keeps the conversation as input_messages reads it)."""
    store = ResponsesStore(4)
    output = [THOUGHT, {**CALL, "id": "fc_1", "status": "completed"}]
    store.put({"id": "resp_1"}, [{"role": "user", "content": "Weather in Paris?"},
                                 *responses.input_messages(output, "output")])
    chat, _, _ = responses.chat_body({"model": "m", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]}, store)
    assert "<think>I should look it up.</think>[get_weather]" in TEMPLATE.render(
        messages=parse_messages(chat["messages"]))


@pytest.mark.parametrize("items", [
    [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_9", "output": "x"}],
    [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_1", "output": "x"}, CALL],
])
def test_an_output_without_its_call_before_it_is_refused(items):
    with pytest.raises(InvalidRequestError) as err:
        responses.chat_body({"model": "m", "input": items})
    assert err.value.field == "input[1].call_id" and "no function_call with call_id" in str(err.value)


def test_an_empty_reasoning_falls_back_to_reasoning_content():
    assert "<think>rc</think>" in _render([{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello", "reasoning": "",
                                            "reasoning_content": "rc"}])


def test_a_call_sent_twice_or_answered_twice_is_refused():
    """With previous_response_id the stored response's call is in the conversation already: sending its item
    again would render the call twice under one id; a second output of one call likewise."""
    store = ResponsesStore(2)
    store.put({"id": "resp_1"}, [{"role": "user", "content": "Weather in Paris?"},
                                 *responses.input_messages([CALL], "output")])
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}
    for items, at in (([CALL, answer], 0), ([answer, answer], 1)):
        with pytest.raises(InvalidRequestError) as err:
            responses.chat_body({"model": "m", "previous_response_id": "resp_1", "input": items}, store)
        assert err.value.field == f"input[{at}].call_id"
    store.put({"id": "resp_2"}, [*store.get("resp_1").history, *responses.input_messages([answer], "output",
                                                                                         store.get("resp_1").history)])
    with pytest.raises(InvalidRequestError, match="has its output already"):
        responses.chat_body({"model": "m", "previous_response_id": "resp_2", "input": [answer]}, store)


def test_a_replayed_refusal_part_is_the_turns_text():
    messages = responses.input_messages([{"role": "user", "content": "a"}, {
        "type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help."}]}])
    assert messages[1] == {"role": "assistant", "content": "I can't help."}
    with pytest.raises(InvalidRequestError) as err:
        responses.input_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert err.value.field == "input[0].content[0].type"
