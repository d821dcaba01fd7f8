"""A ``"required"`` array of calls read as it grows (kvforge/server/tool_calls.py ``array_calls``,
``ToolCallStream``): at every cut of the output, each begun call's arguments are a prefix of its final
arguments, a call is complete exactly when its arguments object closed, and the streamed fragments join to
the whole response's calls. The whole arrays are written by ``json.dumps`` (an independent writer) with the
whitespace the constraint allows."""

from __future__ import annotations

import json

import pytest

from kvforge.server.tool_calls import ToolCallStream, ToolChoice, array_calls

CALLS = [{"name": "get_weather", "parameters": {"city": "Par}is \"{[", "days": [1, {"x": None}]}},
         {"name": "get_time", "parameters": {}}]
CHOICE = ToolChoice(None, (("get_weather", "{}"), ("get_time", "{}")))


def _texts() -> list[str]:
    return [json.dumps(CALLS), json.dumps(CALLS, indent=2), json.dumps(CALLS, separators=(",", ":")),
            json.dumps(CALLS[:1], ensure_ascii=False)]


def _final_arguments(text: str) -> list[tuple[str, str]]:
    """Each call's name and arguments as json.dumps wrote them (the arguments' own text)."""
    return [(name, arguments) for name, arguments, done in array_calls(text) if done]


@pytest.mark.parametrize("text", _texts())
def test_whole_arrays_give_every_call_with_arguments_that_parse(text):
    calls = array_calls(text)
    assert [name for name, _, _ in calls] == [c["name"] for c in json.loads(text)]
    assert all(done for _, _, done in calls)
    assert [json.loads(arguments) for _, arguments, _ in calls] == [c["parameters"] for c in json.loads(text)]


@pytest.mark.parametrize("text", _texts())
def test_every_cut_gives_prefixes_of_the_final_calls(text):
    final = _final_arguments(text)
    for cut in range(len(text) + 1):
        calls = array_calls(text[:cut])
        assert len(calls) <= len(final)
        for k, (name, arguments, done) in enumerate(calls):
            assert name == final[k][0] and final[k][1].startswith(arguments)
            assert done == (arguments == final[k][1])
            if k < len(calls) - 1:
                assert done  # only the last begun call can be open


@pytest.mark.parametrize("text", _texts())
def test_streamed_fragments_join_to_the_whole_calls(text):
    stream = ToolCallStream(CHOICE)
    joined: dict[int, list[str]] = {}
    steps = range(0, len(text) + 1, 3)
    for cut in [*steps, len(text)]:
        delta = stream.delta("", text[:cut], cut == len(text))
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in joined
                joined[piece["index"]] = [piece["function"]["name"], piece["function"]["arguments"]]
            else:
                joined[piece["index"]][1] += piece["function"]["arguments"]
    whole = CHOICE.calls(text)
    assert [tuple(v) for _, v in sorted(joined.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert CHOICE.finish_reason("stop", text) == "tool_calls"


@pytest.mark.parametrize("text", _texts())
def test_a_call_begins_once_its_name_is_written(text):
    """The name's closing quote begins the call (its arguments "" until they start): whatever comes between
    the name and "parameters" can neither drop nor delay it."""
    at = 0
    for k, call in enumerate(json.loads(text)):
        at = text.index(f'"{call["name"]}"', text.index('"name"', at)) + len(call["name"]) + 2
        assert len(array_calls(text[:at - 1])) == k
        assert array_calls(text[:at])[k] == (call["name"], "", False)
    spaced = '[{\n\n"name": "get_weather"\n\n,"paramet'
    assert array_calls(spaced) == [("get_weather", "", False)]
    assert CHOICE.calls(spaced)[0]["function"] == {"name": "get_weather", "arguments": ""}


def test_a_cut_array_keeps_its_begun_calls_and_one_cut_before_any_name_is_content():
    text = json.dumps(CALLS)
    cut = text[:text.index('"days"')]
    calls = CHOICE.calls(cut)
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and CHOICE.last_call_open(cut)
    assert CHOICE.finish_reason("stop", cut) == "stop"  # not a whole array: the engine's reason stays
    assert CHOICE.calls('[{"na') is None
    assert ToolCallStream(CHOICE).delta("", '[{"na', True) == {"content": '[{"na'}
    assert not CHOICE.last_call_open(text)


def test_a_call_left_unfinished_is_an_incomplete_responses_item_whatever_ended_the_output():
    """A stop string ends the output inside a call's arguments as the limit does: that item is incomplete,
    the calls before it complete (kvforge/server/responses.py ``output_items``)."""
    from kvforge.server.responses import ResponseParts, output_items

    named = ToolChoice("get_weather", CHOICE.parameters)
    assert named.last_call_open('{"city": "Pa') and not named.last_call_open('{"city": "Paris"}')
    text = json.dumps(CALLS)
    cut = text[:text.index('"get_time"') + len('"get_time", "parameters": {')]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in CHOICE.calls(cut)]
    for limit in (False, True):  # a stop string, then the limit
        items = output_items(ResponseParts(None, False, "", calls, CHOICE.last_call_open(cut), limit))
        assert [i["status"] for i in items] == ["completed", "incomplete"]
    items = output_items(ResponseParts(None, False, "", calls[:1], CHOICE.last_call_open(text), False))
    assert [i["status"] for i in items] == ["completed"]
