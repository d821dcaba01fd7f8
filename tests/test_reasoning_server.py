"""Reasoning outputs over HTTP (``--reasoning-parser``, kvforge/server/reasoning_split.py): the embedded model
with think tags in its tokenizer (tests/think_tokenizer.py). Each chat's reasoning and answer are checked
against the raw text of the same request on /v1/completions, split here with plain string operations; a
structured output holds the answer, not the reasoning."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import openai_client, serve_refused, smollm2_server  # noqa: E402
from think_tokenizer import END_ID, write_think_tokenizer  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

QUESTION = [{"role": "user", "content": "Is the sky blue? Think, then answer yes or no."}]
# The prompt ends inside the think block: the output starts as reasoning.
THINKING = [*QUESTION, {"role": "assistant", "content": "<think>\nThe sky is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = write_think_tokenizer(tmp_path_factory.mktemp("think"))
    with smollm2_server(extra_args=("--tokenizer", str(tok), "--reasoning-parser", "qwen3")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _raw(server, messages, extra: dict, **params) -> tuple[str, str]:
    """The request's output text as a completion of the same prompt ids, tags and all, and its finish."""
    ids = _post(server.url + "/tokenize", {"messages": messages, **extra})["tokens"]
    body = {"prompt": ids, "temperature": 0, **params}
    choice = _post(server.url + "/v1/completions", body)["choices"][0]
    return choice["text"], choice["finish_reason"]


def _reasoning(message):
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's name and its earlier one
    return extra.get("reasoning")


def _streamed(client, **kw) -> tuple[str, str, list]:
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return reasoning, content, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]


def test_stopped_while_thinking_is_all_reasoning(server, client):
    kw = dict(model=client.models.list().data[0].id, messages=THINKING, max_tokens=20, temperature=0,
              extra_body=CONTINUE)
    raw, finish = _raw(server, THINKING, CONTINUE, max_tokens=20)
    assert "</think>" not in raw and raw.strip()
    choice = client.chat.completions.create(**kw).choices[0]
    assert (_reasoning(choice.message), choice.message.content, choice.finish_reason) == (raw, None, finish)
    assert _streamed(client, **kw) == (raw, "", [finish])


def test_the_constraint_holds_the_answer_after_the_reasoning(server, client):
    # A strong bias closes the block at once; the choice constraint then decides the answer.
    params = dict(max_tokens=20, logit_bias={str(END_ID): 100})
    kw = dict(model=client.models.list().data[0].id, messages=THINKING, temperature=0,
              extra_body={**CONTINUE, "guided_choice": ["yes", "no"]}, **params)
    raw, _ = _raw(server, THINKING, CONTINUE, guided_choice=["yes", "no"], **params)
    reasoning, sep, answer = raw.partition("</think>")
    assert sep and answer.strip() in ("yes", "no")
    assert reasoning == ""  # the bias closes the block at once: an empty think block gives no reasoning
    choice = client.chat.completions.create(**kw).choices[0]
    assert (_reasoning(choice.message), choice.message.content) == (None, answer.lstrip())
    assert _streamed(client, **kw) == ("", answer.lstrip(), ["stop"])


def test_a_tag_in_the_users_message_does_not_open_the_block(server, client):
    """The user's ``<think>`` is the tag token, followed by the end of the user's turn: the output is
    undecided, and its answer held to the choice."""
    messages = [{"role": "user", "content": "What does a <think> tag do in markup? Answer yes or no."}]
    choice = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                            temperature=0, max_tokens=10,
                                            extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert choice.message.content in ("yes", "no") and _reasoning(choice.message) is None


def test_an_answer_without_a_think_block_has_no_reasoning(server, client):
    model = client.models.list().data[0].id
    for extra, params in (({"guided_choice": ["yes", "no"]}, {}), ({}, {"max_tokens": 12})):
        raw, _ = _raw(server, QUESTION, {}, **extra, **params)
        assert not raw.lstrip().startswith("<think>")
        choice = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, extra_body=extra,
                                                **params).choices[0]
        assert choice.message.content == raw and _reasoning(choice.message) is None


def test_include_reasoning_false_drops_it(server, client):
    kw = dict(model=client.models.list().data[0].id, messages=THINKING, max_tokens=8, temperature=0,
              extra_body={**CONTINUE, "include_reasoning": False})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.content is None and "reasoning" not in (choice.message.model_extra or {})
    assert _streamed(client, **kw) == ("", "", [choice.finish_reason])


def test_completions_are_not_split(server):
    text = _post(server.url + "/v1/completions", {"prompt": "<think>a</think>b", "max_tokens": 4,
                                                  "temperature": 0})["choices"][0]
    assert "reasoning" not in text


@pytest.mark.parametrize("argv, says", [
    (["--reasoning-parser", "qwen3"], "'<think>' is not one token of this model's tokenizer"),
    (["--reasoning-parser", "qwen3", "--skip-tokenizer-init"], "needs the tokenizer"),
])
def test_a_tokenizer_without_the_tags_stops_before_weights(monkeypatch, capsys, argv, says):
    assert says in serve_refused(monkeypatch, capsys, argv)


def test_special_tags_keep_special_tokens_in_the_text(tmp_path):
    """A tokenizer whose think tags are special tokens: chat requests are detokenized with them, and a request
    that asks to skip special tokens is refused naming the field."""
    import json as json_

    from kvforge.errors import InvalidRequestError
    from kvforge.reasoning import reasoning_tokens
    from kvforge.server.protocol import parse_chat
    from kvforge.tokenizer import Tokenizer

    directory = write_think_tokenizer(tmp_path)
    spec = json_.loads((directory / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["special"] = token["special"] or token["content"] in ("<think>", "</think>")
    (directory / "tokenizer.json").write_text(json_.dumps(spec))
    tags = reasoning_tokens("qwen3", Tokenizer.from_hf_dir(directory))
    assert tags.tags_special and END_ID not in tags.special_ids
    body = {"model": "m", "messages": QUESTION}
    assert parse_chat(body, "m", reasoning=tags).params.skip_special_tokens is False
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**body, "skip_special_tokens": True}, "m", reasoning=tags)
    assert err.value.field == "skip_special_tokens"
    plain = reasoning_tokens("qwen3", Tokenizer.from_hf_dir(write_think_tokenizer(tmp_path / "plain")))
    assert not plain.tags_special and parse_chat(body, "m", reasoning=plain).params.skip_special_tokens is True


def test_responses_carry_a_reasoning_item(server, client):
    """/v1/responses under the parser: the think block is a reasoning item and its tokens are counted. The bias
    opens the block and keeps the output thinking until the limit."""
    from think_tokenizer import START_ID

    params = dict(max_tokens=4, logit_bias={str(START_ID): 100})
    raw, _ = _raw(server, QUESTION, {}, **params)
    reasoning, answer = raw.removeprefix("<think>"), ""
    assert raw.startswith("<think>") and "</think>" not in raw
    kw = dict(model=client.models.list().data[0].id, input=QUESTION[0]["content"], temperature=0,
              max_output_tokens=4, extra_body={"logit_bias": params["logit_bias"]})
    r = client.responses.create(**kw)
    item, message = r.output
    assert (item.type, item.content[0].text, message.type, r.output_text) == ("reasoning", reasoning, "message",
                                                                              answer)
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 4 and r.status == "incomplete"
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_responses_count_no_reasoning_tokens_when_the_model_answers_at_once(client):
    r = client.responses.create(model=client.models.list().data[0].id, input=QUESTION[0]["content"], temperature=0,
                                max_output_tokens=6)
    assert [o.type for o in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0
