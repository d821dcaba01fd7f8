"""``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) reach the chat template as the variable
``reasoning_effort`` (gpt-oss's template writes it into its system message); ``chat_template_kwargs`` and
the request's own field win over ``--default-chat-template-kwargs``; bad values are refused naming the field."""

from __future__ import annotations

import pytest

from kvforge.errors import InvalidRequestError
from kvforge.server import responses
from kvforge.server.protocol import parse_chat_template_options
from kvforge.server.request_defaults import RequestDefaults

MESSAGES = [{"role": "user", "content": "Hi"}]


def _kwargs(body: dict) -> dict:
    return dict(parse_chat_template_options(body, MESSAGES).template_kwargs)


def test_the_effort_is_a_template_variable_and_chat_template_kwargs_win():
    assert _kwargs({"reasoning_effort": "high"}) == {"reasoning_effort": "high"}
    assert _kwargs({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}}) == {
        "reasoning_effort": "low", "x": 1}
    assert _kwargs({}) == {}


def test_the_requests_effort_wins_over_the_servers_default():
    defaults = RequestDefaults(chat_template_kwargs={"reasoning_effort": "high", "enable_thinking": True})
    body = defaults.apply({"messages": MESSAGES, "reasoning_effort": "low"}, chat=True)
    assert _kwargs(body) == {"reasoning_effort": "low", "enable_thinking": True}
    assert _kwargs(defaults.apply({"messages": MESSAGES}, chat=True))["reasoning_effort"] == "high"


@pytest.mark.parametrize("effort", ["max", 3, ""])
def test_an_unknown_effort_is_refused(effort):
    with pytest.raises(InvalidRequestError) as err:
        _kwargs({"reasoning_effort": effort})
    assert err.value.field == "reasoning_effort" and "low" in str(err.value)


def test_responses_reasoning_runs_as_the_chat_effort_and_is_repeated_in_the_response():
    chat, meta, _ = responses.chat_body({"model": "m", "input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert chat["reasoning_effort"] == "low" and meta.reasoning_effort == "low"
    assert _kwargs(chat) == {"reasoning_effort": "low"}
    chat, meta, _ = responses.chat_body({"model": "m", "input": "Hi"})
    assert "reasoning_effort" not in chat and meta.reasoning_effort is None


@pytest.mark.parametrize("reasoning, field", [({"effort": "max"}, "reasoning.effort"), ("low", "reasoning"),
                                              ({"effort": "low", "budget": 3}, "reasoning.budget")])
def test_bad_responses_reasoning_is_refused(reasoning, field):
    with pytest.raises(InvalidRequestError) as err:
        responses.chat_body({"model": "m", "input": "Hi", "reasoning": reasoning})
    assert err.value.field == field


def test_the_response_object_validates_with_the_effort():
    types = pytest.importorskip("openai.types.responses")
    from kvforge.engine.sampling_params import SamplingParams

    _, meta, _ = responses.chat_body({"model": "m", "input": "Hi", "reasoning": {"effort": "high"}})
    obj = responses.response_object("resp_1", 0, "m", meta, SamplingParams(), "completed", [], None)
    assert types.Response.model_validate(obj).reasoning.effort == "high"


def test_the_response_repeats_the_effort_the_template_gets():
    """chat_template_kwargs, or the server's default template variables, set the effort where reasoning.effort
    does not, or override it: the Response says the one that reached the template."""
    body = {"model": "m", "input": "Hi", "reasoning": {"effort": "high"},
            "chat_template_kwargs": {"reasoning_effort": "low"}}
    chat, meta, _ = responses.chat_body(body)
    assert responses.with_template_effort(meta, parse_chat_template_options(chat, MESSAGES)).reasoning_effort == "low"
    chat, meta, _ = responses.chat_body({"model": "m", "input": "Hi"})
    chat = RequestDefaults(chat_template_kwargs={"reasoning_effort": "medium"}).apply(chat, chat=True)
    options = parse_chat_template_options(chat, MESSAGES)
    assert responses.with_template_effort(meta, options).reasoning_effort == "medium"
    assert responses.with_template_effort(meta, parse_chat_template_options({}, MESSAGES)).reasoning_effort is None
