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


VLLM_EXTRAS_REFUSED = [
    ("min_tokens", 3), ("repetition_penalty", 1.2), ("length_penalty", 0.5), ("use_beam_search", True),
    ("include_stop_str_in_output", True), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("prompt_logprobs", 1), ("truncate_prompt_tokens", 8), ("guided_json", {"type": "object"}),
    ("guided_regex", "[0-9]+"), ("guided_choice", ["yes", "no"]), ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"choice": ["a"]}),
]


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", VLLM_EXTRAS_REFUSED, ids=[f for f, _ in VLLM_EXTRAS_REFUSED])
def test_vllm_extra_that_changes_the_output_is_refused(parse, body, field, value):
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, field: value}, MODEL)
    assert err.value.field == field
    assert f"'{field}': is not supported (leave it unset)" in str(err.value)


@pytest.mark.parametrize("field, value", [
    ("min_tokens", 0), ("repetition_penalty", 1.0), ("repetition_penalty", 1), ("length_penalty", 1.0),
    ("use_beam_search", False), ("include_stop_str_in_output", False), ("allowed_token_ids", []),
    ("bad_words", []), ("prompt_logprobs", None), ("guided_json", None),
])
def test_vllm_extra_at_its_neutral_value_is_accepted(field, value):
    parsed = parse_completion({"prompt": "hi", "model": MODEL, field: value}, MODEL)
    assert parsed.params.max_tokens == 16
