"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (vLLM's shapes), and chat prompts encoded
the way transformers' ``apply_chat_template(tokenize=True)`` encodes them.

The chat tests use a small word-level tokenizer whose post-processor adds a BOS and whose chat
template starts with ``{{ bos_token }}`` (as Llama 3, Gemma and Mistral do); transformers'
``PreTrainedTokenizerFast`` over the same backend is the reference. The endpoint tests run the real
engine on the embedded SmolLM2 (CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, smollm2_test_engine  # noqa: E402
from http_json import http  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.tokenizer import Tokenizer  # noqa: E402

API_KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT_TEMPLATE = ("{{ bos_token }}{% if greeting is defined %}{{ greeting }} . {% endif %}"
                 "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def _bos_adding_backend() -> Backend:
    words = ["<s>", "</s>", "<unk>", "system", "user", "assistant", ":", ".", "be", "brief", "hello", "there"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>", "<unk>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return backend


@pytest.fixture(scope="module")
def bos_server():
    backend = _bos_adding_backend()
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 chat_template=CHAT_TEMPLATE)
    engine.model_name = "bos-model"
    with ServerThread(create_app(engine, api_key=API_KEY)) as srv:
        yield srv


def _reference_chat_ids(messages, add_generation_prompt=True, **kwargs) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_object=_bos_adding_backend(), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    out = ref.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True,
                                  add_generation_prompt=add_generation_prompt, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


CONTINUED = MESSAGES + [{"role": "assistant", "content": "hello"}]
#: (chat fields, the reference's apply_chat_template arguments, messages)
RENDERINGS = {
    "no generation prompt": (dict(add_generation_prompt=False), dict(add_generation_prompt=False), MESSAGES),
    "continue final message": (dict(add_generation_prompt=False, continue_final_message=True),
                               dict(add_generation_prompt=False, continue_final_message=True), CONTINUED),
    "template kwargs": (dict(chat_template_kwargs={"greeting": "hello"}), dict(greeting="hello"), MESSAGES),
}


@pytest.mark.parametrize("name", list(RENDERINGS))
def test_chat_rendering_fields_follow_transformers(bos_server, name):
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` render as transformers
    renders them, in ``/tokenize`` and in the chat route's prompt (its token count), and change the prompt."""
    fields, ref_args, messages = RENDERINGS[name]
    ref = _reference_chat_ids(messages, **ref_args)
    assert ref != _reference_chat_ids(messages)  # each field changes the default rendering
    status, body = http("POST", bos_server.url + "/tokenize", {"messages": messages, **fields}, AUTH)
    assert status == 200, body
    assert body["tokens"] == ref
    c = openai.OpenAI(base_url=bos_server.url + "/v1", api_key=API_KEY, max_retries=0)
    r = c.chat.completions.create(model="bos-model", messages=messages, max_tokens=1, extra_body=fields)
    assert r.usage.prompt_tokens == len(ref)


@pytest.mark.parametrize("fields,param", [
    (dict(chat_template="{{ 'x' }}"), "chat_template"),
    (dict(continue_final_message=True), "continue_final_message"),  # with the default add_generation_prompt
    (dict(continue_final_message=True, add_generation_prompt=False), "continue_final_message"),  # user last
    (dict(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (dict(echo=True), "echo"),
])
def test_chat_rendering_fields_refused_with_the_field_named(bos_server, fields, param):
    status, body = http("POST", bos_server.url + "/v1/chat/completions",
                        {"messages": MESSAGES, "max_tokens": 1, **fields}, AUTH)
    assert status == 400 and body["error"]["param"] == param, body


def test_chat_prompt_has_one_bos_like_transformers(bos_server):
    ref = _reference_chat_ids(MESSAGES)
    assert ref.count(0) == 1  # the reference itself: the template's BOS only
    status, body = http("POST", bos_server.url + "/tokenize", {"messages": MESSAGES}, AUTH)
    assert status == 200, body
    assert body["tokens"] == ref and body["count"] == len(ref)
    # The chat route feeds the engine the same ids: its prompt token count is the reference's.
    c = openai.OpenAI(base_url=bos_server.url + "/v1", api_key=API_KEY, max_retries=0)
    r = c.chat.completions.create(model="bos-model", messages=MESSAGES, max_tokens=1)
    assert r.usage.prompt_tokens == len(ref)


def test_a_chat_sent_as_prompt_is_tokenized_as_messages(bos_server):
    """lm-evaluation-harness's remote tokenizer with --apply_chat_template sends the chat as ``prompt``."""
    _, as_messages = http("POST", bos_server.url + "/tokenize", {"messages": MESSAGES, "add_special_tokens": False},
                          AUTH)
    status, as_prompt = http("POST", bos_server.url + "/tokenize", {"prompt": MESSAGES, "add_special_tokens": False},
                             AUTH)
    assert status == 200 and as_prompt["tokens"] == as_messages["tokens"] == _reference_chat_ids(MESSAGES)
    status, err = http("POST", bos_server.url + "/tokenize", {"prompt": [1, 2]}, AUTH)  # not a chat
    assert status == 400 and err["error"]["param"] == "prompt"


def test_tokenize_prompt_adds_special_tokens_unless_told_not_to(bos_server):
    status, with_bos = http("POST", bos_server.url + "/tokenize", {"prompt": "hello there"}, AUTH)
    assert status == 200 and with_bos["tokens"] == [0, 10, 11]
    status, plain = http("POST", bos_server.url + "/tokenize",
                         {"prompt": "hello there", "add_special_tokens": False, "return_token_strs": True}, AUTH)
    assert status == 200 and plain["tokens"] == [10, 11] and plain["token_strs"] == ["hello", "there"]
    assert plain["max_model_len"] == 256


def test_tokenizer_routes_need_the_api_key(bos_server):
    for method, path, body in [("POST", "/tokenize", {"prompt": "hello"}), ("POST", "/detokenize", {"tokens": [10]}),
                               ("GET", "/tokenizer_info", None)]:
        status, err = http(method, bos_server.url + path, body)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, err)


# -- the real engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=4)
    with ServerThread(create_app(engine)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


TEXT = "The quick brown fox, 42 times: héllo wörld!"


def test_tokenize_counts_what_completions_count_and_detokenize_inverts_it(server):
    status, tok = http("POST", server.url + "/tokenize", {"model": server.engine.model_name, "prompt": TEXT})
    assert status == 200, tok
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = c.completions.create(model=server.engine.model_name, prompt=TEXT, max_tokens=0, echo=True)
    assert tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens
    status, de = http("POST", server.url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and de["prompt"] == TEXT
    r_ids = c.completions.create(model=server.engine.model_name, prompt=tok["tokens"], max_tokens=0, echo=True)
    assert r_ids.choices[0].text == TEXT


def test_tokenizer_info_names_the_special_tokens(server):
    status, info = http("GET", server.url + "/tokenizer_info")
    assert status == 200
    tok = server.engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 256


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenizer_requests(server, path, body, status, param):
    got, err = http("POST", server.url + path, body)
    assert got == status, err
    assert err["error"]["param"] == param
    ok, _ = http("POST", server.url + "/tokenize", {"prompt": "still serving"})
    assert ok == 200


def test_lm_eval_detects_the_remote_tokenizer(server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    assert remote.decode(remote.encode(TEXT)) == TEXT
    assert remote.eos_token == server.engine.tokenizer.eos_token


@pytest.fixture(scope="module")
def tokenizerless_server():
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = None  # as --skip-tokenizer-init leaves it
    srv = ServerThread(create_app(engine)).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("route,body,field,hint", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, "messages", "chat messages need one"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "prompt", "array of token ids"),
    ("/tokenize", {"messages": MESSAGES}, "messages", "chat messages need one"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens", "detokenizing needs one"),
])
def test_without_a_tokenizer_the_error_names_the_field_and_what_to_do(tokenizerless_server, route, body, field, hint):
    status, out = http("POST", tokenizerless_server.url + route, body)
    assert status == 400 and out["error"]["param"] == field
    assert "no tokenizer" in out["error"]["message"] and hint in out["error"]["message"]
    assert http("GET", tokenizerless_server.url + "/health")[0] == 200
