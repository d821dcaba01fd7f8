"""Request fields the server does not implement are refused with the field named and a way forward."""

import pytest

from kvforge.server.protocol import InvalidRequestError, parse_chat, parse_completion

MODEL = "m"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_n_above_one_names_the_alternative(parse, body):
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, "n": 3}, MODEL)
    assert err.value.field == "n"
    message = str(err.value)
    assert "only n=1 is supported, got 3" in message
    assert "send 3 requests instead" in message and "repeats the prompt 3 times" in message


def test_n_one_and_best_of_one_are_accepted():
    parsed = parse_completion({"prompt": "hi", "model": MODEL, "n": 1, "best_of": 1}, MODEL)
    assert parsed.params.n == 1


def test_best_of_above_one_says_to_drop_it():
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "best_of": 2}, MODEL)
    assert err.value.field == "best_of" and "drop best_of" in str(err.value)
