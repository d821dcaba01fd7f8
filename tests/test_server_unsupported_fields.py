"""Request fields the server does not implement are refused with the field named and a way forward."""

import pytest

from kvforge.server.protocol import InvalidRequestError, parse_chat, parse_completion

MODEL = "m"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("n", [0, -1, 129])
def test_n_out_of_range_is_refused(parse, body, n):
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, "n": n}, MODEL)
    assert err.value.field == "n" and f"must be an integer in [1, 128], got {n}" in str(err.value)


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_n_and_best_of_equal_to_n_are_accepted(parse, body):
    parsed = parse({**body, "model": MODEL, "n": 3, "best_of": 3}, MODEL)
    assert parsed.n == parsed.params.n == 3
    assert {parsed.params.sample_params(j).n for j in range(3)} == {1}  # one engine request per choice


def test_batch_times_n_is_bounded():
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": ["a"] * 9, "model": MODEL, "n": 128}, MODEL)
    assert err.value.field == "n" and "9 prompts x n=128 is 1152 sequences; at most 1024" in str(err.value)


@pytest.mark.parametrize("n, best_of", [(1, 2), (2, 4), (3, 2)])
def test_best_of_other_than_n_is_refused(n, best_of):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "n": n, "best_of": best_of}, MODEL)
    assert err.value.field == "best_of"
    assert f"only best_of equal to n ({n}) is supported, got {best_of}" in str(err.value)
    assert "drop best_of" in str(err.value)


@pytest.mark.parametrize("seed", [1 << 63, -(1 << 63) - 1])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "seed": seed}, MODEL)
    assert err.value.field == "seed"


def test_sample_seeds_follow_the_request_seed_and_wrap_at_64_bits():
    params = parse_completion({"prompt": "hi", "model": MODEL, "seed": (1 << 63) - 2, "n": 4}, MODEL).params
    seeds = [params.sample_params(j).seed for j in range(4)]
    assert seeds == [(1 << 63) - 2, (1 << 63) - 1, -(1 << 63), -(1 << 63) + 1]
    unseeded = parse_completion({"prompt": "hi", "model": MODEL, "n": 2}, MODEL).params
    assert unseeded.sample_params(1).seed is None


VLLM_EXTRAS_REFUSED = [
    ("length_penalty", 0.5), ("use_beam_search", True),
    ("logits_processors", ["my_module.Processor"]),
]


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", VLLM_EXTRAS_REFUSED, ids=[f for f, _ in VLLM_EXTRAS_REFUSED])
def test_vllm_extra_that_changes_the_output_is_refused(parse, body, field, value):
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, field: value}, MODEL)
    assert err.value.field == field
    assert f"'{field}': is not supported (leave it unset)" in str(err.value)


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_bad_words_reach_the_sampling_params_as_a_list_of_strings(parse, body):
    assert parse({**body, "model": MODEL, "bad_words": ["x", " y z"]}, MODEL).params.bad_words == ("x", " y z")
    assert parse({**body, "model": MODEL}, MODEL).params.bad_words == ()
    for value, why in ((["x", 1], "got an entry of type integer"), ([" "], "a character that is not a space")):
        with pytest.raises(InvalidRequestError, match=why) as err:
            parse({**body, "model": MODEL, "bad_words": value}, MODEL)
        assert err.value.field == "bad_words"


@pytest.mark.parametrize("field, value", [
    ("length_penalty", 1.0),
    ("use_beam_search", False), ("allowed_token_ids", []),  # empty: no restriction
    ("bad_words", []), ("prompt_logprobs", None), ("guided_json", None), ("return_tokens_as_token_ids", False),
    ("logits_processors", []), ("add_special_tokens", True),
])
def test_vllm_extra_at_its_neutral_value_is_accepted(field, value):
    parsed = parse_completion({"prompt": "hi", "model": MODEL, field: value}, MODEL)
    assert parsed.params.max_tokens == 16


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("value", [True, False])
def test_include_stop_str_in_output_reaches_the_sampling_params(parse, body, value):
    parsed = parse({**body, "model": MODEL, "include_stop_str_in_output": value}, MODEL)
    assert parsed.params.include_stop_str_in_output is value
    assert parse({**body, "model": MODEL}, MODEL).params.include_stop_str_in_output is False


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_penalties_reach_the_sampling_params(parse, body):
    parsed = parse({**body, "model": MODEL, "presence_penalty": 0.5, "frequency_penalty": -1.25,
                    "repetition_penalty": 1.3}, MODEL)
    p = parsed.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.25, 1.3)
    p = parse({**body, "model": MODEL}, MODEL).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize("field, value, why", [
    ("presence_penalty", 2.5, r"in \[-2, 2\]"), ("frequency_penalty", -3, r"in \[-2, 2\]"),
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", -1.0, "> 0"),
])
def test_penalty_out_of_range_names_the_field(field, value, why):
    with pytest.raises(InvalidRequestError, match=why) as err:
        parse_completion({"prompt": "hi", "model": MODEL, field: value}, MODEL)
    assert err.value.field == field


def test_min_logit_bias_and_allowed_ids_reach_the_sampling_params():
    p = parse_completion({"prompt": "hi", "model": MODEL, "min_tokens": 4, "logit_bias": {"7": -100, "3": 2},
                          "allowed_token_ids": [3, 7, 9]}, MODEL).params
    assert p.min_tokens == 4 and p.logit_bias == ((3, 2.0), (7, -100.0)) and p.allowed_token_ids == (3, 7, 9)
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "min_tokens": 20, "max_tokens": 10}, MODEL)
    assert err.value.field == "min_tokens"


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_unknown_fields_are_logged_as_ignored(parse, body, caplog):
    """A field the route does not know is logged by name; OpenAI's output-neutral fields are not."""
    with caplog.at_level("WARNING", logger="kvforge.server.protocol"):
        parse({**body, "model": MODEL, "user": "u1", "metadata": {"k": "v"}}, MODEL)
        assert not caplog.records
        parse({**body, "model": MODEL, "temprature": 0.5, "top_kk": 1}, MODEL)
    assert [r.getMessage() for r in caplog.records] == [
        "fields present in the request but ignored: temprature, top_kk"]


def test_ignored_field_names_cannot_forge_or_flood_the_log(caplog):
    """A name holding a newline is logged escaped on one line; a long name is cut; past 20 names a count."""
    forged = "x\nERROR kvforge.server: FORGED"
    body = {"prompt": "hi", "model": MODEL, forged: 1, "k" * 10_000: 2, **{f"z{i:02d}": i for i in range(30)}}
    with caplog.at_level("WARNING", logger="kvforge.server.protocol"):
        parse_completion(body, MODEL)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in message and "x\\nERROR kvforge.server: FORGED" in message
    assert len(message) < 1000 and "(and 12 more)" in message


def test_every_field_the_parsers_read_is_known():
    """The known-field sets hold every field name the request parsers read from a body, so a field the
    server does read is never logged as ignored."""
    import inspect
    import re

    from kvforge.server import protocol

    source = inspect.getsource(protocol)
    read = {name for pattern in (r'get_\w+\(body, "(\w+)"', r'body\.get\("(\w+)"', r'body\["(\w+)"\]')
            for name in re.findall(pattern, source)}
    read |= set(protocol._VLLM_EXTRAS_NEUTRAL)
    assert {"prompt", "messages", "temperature", "continue_final_message"} <= read  # the scan finds them
    assert read - (protocol.COMPLETION_FIELDS | protocol.CHAT_FIELDS) == set()


@pytest.mark.parametrize("parse, body, default", [(parse_completion, {"prompt": "hi"}, True), (parse_chat, CHAT, False)],
                         ids=["completions", "chat"])
def test_add_special_tokens_only_at_the_routes_own_rule(parse, body, default):
    parse({**body, "model": MODEL, "add_special_tokens": default}, MODEL)
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, "add_special_tokens": not default}, MODEL)
    assert err.value.field == "add_special_tokens" and f"only {str(default).lower()}" in str(err.value)


def test_stream_options_continuous_usage_and_unknown_keys(caplog):
    body = {"prompt": "hi", "model": MODEL, "stream": True}
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_completion({**body, "stream_options": both}, MODEL).continuous_usage
    # as in vLLM, only with include_usage
    assert not parse_completion({**body, "stream_options": {"continuous_usage_stats": True}}, MODEL).continuous_usage
    with caplog.at_level("WARNING"):
        parse_chat({**CHAT, "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "usage": 1}}, MODEL)
    assert "stream_options fields present in the request but ignored: usage" in caplog.text


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_vllm_token_id_options_reach_the_request(parse, body):
    plain = parse({**body, "model": MODEL}, MODEL)
    assert not plain.tokens_as_ids and not plain.return_token_ids
    both = parse({**body, "model": MODEL, "return_tokens_as_token_ids": True, "return_token_ids": True}, MODEL)
    assert both.tokens_as_ids and both.return_token_ids
    with pytest.raises(InvalidRequestError) as err:
        parse({**body, "model": MODEL, "return_token_ids": "yes"}, MODEL)
    assert err.value.field == "return_token_ids"


HUGE = 10**400


@pytest.mark.parametrize("field, value, why", [
    ("temperature", HUGE, "expected a finite number"), ("presence_penalty", -HUGE, "expected a finite number"),
    ("top_p", HUGE, "expected a finite number"), ("n", 1e300, "signed 64-bit integer"), ("top_k", 1e300, "signed 64-bit integer"),
    ("seed", 10**30, "signed 64-bit integer"), ("min_tokens", HUGE, "signed 64-bit integer"),
])
def test_numbers_beyond_their_range_name_the_field_briefly(field, value, why):
    """An integer literal past float's range (JSON allows it) is a 400 naming the field, not an overflow;
    the message does not echo hundreds of digits."""
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, field: value}, MODEL)
    assert err.value.field == field and why in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1\u00b2", "12345678901234567890123", "-1", "a"])
def test_logit_bias_keys_are_ascii_decimal_token_ids(key):
    """``str.isdigit`` takes a superscript two and an Arabic-Indic three; neither is a token id."""
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "logit_bias": {key: 1}}, MODEL)
    assert err.value.field == "logit_bias" and "keys must be token ids" in str(err.value)


def test_truncate_prompt_tokens_reaches_the_sampling_params():
    assert parse_completion({"prompt": "hi", "model": MODEL, "truncate_prompt_tokens": 8}, MODEL).params \
        .truncate_prompt_tokens == 8
    assert parse_chat({**CHAT, "model": MODEL}, MODEL).params.truncate_prompt_tokens is None
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "truncate_prompt_tokens": 0}, MODEL)
    assert err.value.field == "truncate_prompt_tokens"


def test_content_parts_are_text_only_and_named():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": parts}]}, MODEL)
    assert req.messages[0]["content"] == "a\nb"  # joined by newlines, as vLLM's string format joins them
    for part, field, says in (
            ({"type": "image_url", "image_url": {"url": "x"}}, "messages[0].content[0].type",
             'only text content parts are supported, got "image_url"'),
            ({"type": "text"}, "messages[0].content[0].text", "expected a string, got null"),
            ({"type": "text", "text": 5}, "messages[0].content[0].text", "expected a string, got integer"),
            ("hi", "messages[0].content[0]", "expected a content part (an object), got string"),
            (None, "messages[0].content[0]", "expected a content part (an object), got null")):
        with pytest.raises(InvalidRequestError) as err:
            parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [part]}]}, MODEL)
        assert err.value.field == field and f"'{field}': {says}" == str(err.value)


@pytest.mark.parametrize("field, value, why", [
    ("user", 5, "expected a string"), ("metadata", "x", "expected an object"), ("metadata", {"k": 1}, "strings"),
    ("store", "yes", "expected a boolean"), ("service_tier", 1, "expected a string"),
])
def test_openai_passthrough_fields_keep_their_types(field, value, why):
    """Fields that change no output are still typed, as OpenAI's API types them (the Responses route too)."""
    for parse, body in ((parse_completion, {"prompt": "hi"}), (parse_chat, CHAT)):
        with pytest.raises(InvalidRequestError) as err:
            parse({**body, "model": MODEL, field: value}, MODEL)
        assert err.value.field.startswith(field) and why in str(err.value)
    assert parse_chat({**CHAT, "model": MODEL, "user": "u1", "metadata": {"k": "v"}, "store": False}, MODEL)


def test_seed_out_of_range_names_the_range():
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "seed": 2**63}, MODEL)
    assert "[-9223372036854775808, 9223372036854775807]" in str(err.value) and "9223372036854775808" in str(err.value)


@pytest.mark.parametrize("best_of, advice", [(0, False), (3, True)])
def test_best_of_advice_names_only_a_valid_n(best_of, advice):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"prompt": "hi", "model": MODEL, "best_of": best_of}, MODEL)
    assert err.value.field == "best_of" and ("send n=" in str(err.value)) == advice
