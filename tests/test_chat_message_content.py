"""Chat messages: a system, developer, user or tool message needs its text; an assistant turn may come
without it (OpenAI's schema). Refusals name the field."""

import pytest

from kvforge.server.protocol import InvalidRequestError, parse_chat

MODEL = "m"


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
@pytest.mark.parametrize("message", [{}, {"content": None}], ids=["missing", "null"])
def test_a_message_without_content_is_refused(role, message):
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"model": MODEL, "messages": [{"role": role, **message}]}, MODEL)
    assert err.value.field == "messages[0].content" and f"is required for a {role} message" in str(err.value)


def test_an_assistant_turn_without_content_is_empty_text():
    parsed = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"},
                                                      {"role": "user", "content": [{"type": "text", "text": "go"}]}]},
                        MODEL)
    assert [m["content"] for m in parsed.messages] == ["hi", "", "go"]


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    parsed = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]}, MODEL)
    assert parsed.messages[0]["content"] == "Say\nhi"
