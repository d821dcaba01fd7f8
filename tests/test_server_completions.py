"""``/v1/completions`` as lm-evaluation-harness uses it, through the official ``openai`` client:
batched prompts (strings and token-id arrays), ``echo`` with ``logprobs`` (prompt logprobs) and
``max_tokens=0``. The real engine on the embedded SmolLM2, float32 on CPU.

Echoed prompt logprobs are compared with ``log_softmax`` (float64) of the engine's teacher-forced
scoring path (``LLMEngine.compute_prompt_logits``: every row's logits, no sampler); tests/
test_prompt_logprobs.py holds the engine's prompt logprobs to transformers. Tolerance 1e-4: the
same float32 model on CPU in a different batch, measured below 1e-5.
"""

from __future__ import annotations

import argparse
import time

import openai
import pytest
import torch

from kvforge.config import EngineArgs
from kvforge.engine.llm_engine import LLMEngine
from kvforge.server.app import ServerThread, create_app

TOL = 1e-4


@pytest.fixture(scope="module")
def server():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8", "--no-progress"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _reference_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of the engine's scoring logits; row p scores token p + 1."""
    return torch.log_softmax(engine.compute_prompt_logits(ids).double(), dim=-1)


PROMPTS = ["The capital of France is", "One, two, three, four,", "Water boils at"]


def test_batched_string_prompts_match_single_requests(server, client):
    name = server.engine.model_name
    kw = dict(model=name, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=PROMPTS, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    singles = [client.completions.create(prompt=p, **kw).choices[0] for p in PROMPTS]
    # Greedy on the same float32 CPU engine; a batch of three shares steps, which may flip a near-tie:
    # compare the texts and accept a difference only after the first token agrees.
    for got, want in zip(batch.choices, singles):
        assert got.finish_reason == "length"
        assert got.text == want.text or got.text[:1] == want.text[:1]
    tok = server.engine.tokenizer
    assert batch.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert batch.usage.completion_tokens == 15


def test_batched_token_id_prompts(server, client):
    tok = server.engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    r = client.completions.create(model=server.engine.model_name, prompt=ids, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_echo_logprobs_max_tokens_zero(server, client, as_ids):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens=0, a batch of prompts."""
    tok = server.engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    r = client.completions.create(model=server.engine.model_name, prompt=ids if as_ids else PROMPTS,
                                  max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)
    for choice in r.choices:
        prompt_ids = ids[choice.index]
        lp = choice.logprobs
        assert choice.finish_reason == "length"
        assert choice.text == (tok.decode(prompt_ids) if as_ids else PROMPTS[choice.index])
        assert lp.tokens == [tok.decode([t]) for t in prompt_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _reference_logprobs(server.engine, prompt_ids)
        for i in range(1, len(prompt_ids)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, prompt_ids[i]].item()) <= TOL
            top = ref[i - 1].topk(2)
            want = {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
            # The top 2 and the prompt token itself (vLLM's rule): 2 entries, or 3 when it is not in the top 2.
            want.setdefault(tok.decode([prompt_ids[i]]), ref[i - 1, prompt_ids[i]].item())
            assert len(lp.top_logprobs[i]) == len(want)
            for piece, v in lp.top_logprobs[i].items():
                assert piece in want and abs(v - want[piece]) <= TOL
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_generated_tokens(server, client):
    """lm-eval's older form: echo with max_tokens=1; the generated token follows the prompt's."""
    tok = server.engine.tokenizer
    prompt = PROMPTS[0]
    n = len(tok.encode(prompt))
    r = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=1, echo=True,
                                  logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=1, logprobs=1,
                                      temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == prompt + plain.choices[0].text
    assert len(c.logprobs.tokens) == n + 1 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.tokens[-1] == plain.choices[0].logprobs.tokens[0]
    assert abs(c.logprobs.token_logprobs[-1] - plain.choices[0].logprobs.token_logprobs[0]) <= TOL
    assert r.usage.completion_tokens == 1


def test_streamed_batch_with_echo(server, client):
    name = server.engine.model_name
    stream = client.completions.create(model=name, prompt=PROMPTS[:2], max_tokens=4, temperature=0, echo=True,
                                       stream=True, extra_body={"ignore_eos": True})
    texts, finish = {0: "", 1: ""}, {}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    plain = client.completions.create(model=name, prompt=PROMPTS[:2], max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert finish == {0: "length", 1: "length"}
    for c in plain.choices:
        assert texts[c.index].startswith(PROMPTS[c.index])
        assert len(texts[c.index]) > len(PROMPTS[c.index])
        assert c.text.startswith(PROMPTS[c.index])


MAX_LEN = 256  # the server fixture's --max-model-len


def _ids_of_length(tok, n: int) -> list[int]:
    ids = tok.encode(" ".join(PROMPTS) * 40)
    assert len(ids) >= n + 1
    return ids[:n]


def _post(server, body: dict):
    from http_json import http

    return http("POST", server.url + "/v1/completions", {"model": server.engine.model_name, **body}, timeout=120)


def test_echo_max_tokens_zero_takes_a_prompt_that_fills_the_context(server, client):
    """With echo and max_tokens=0 nothing is generated, so a prompt of exactly --max-model-len tokens is
    served (as vLLM serves it): the echoed prompt with every prompt token's logprob, each against the
    scoring path's log-softmax. One token more is a 400 naming the prompt; so is the full prompt when a
    token is to be generated."""
    tok = server.engine.tokenizer
    ids = _ids_of_length(tok, MAX_LEN)
    r = client.completions.create(model=server.engine.model_name, prompt=[ids, ids[:10]], max_tokens=0,
                                  echo=True, logprobs=2)
    full, short = r.choices
    assert r.usage.prompt_tokens == MAX_LEN + 10 and r.usage.completion_tokens == 0
    assert full.finish_reason == "length" and full.text == tok.decode(ids)
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_LEN
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference_logprobs(server.engine, ids)
    for i in range(1, MAX_LEN):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) <= TOL, i
        top = ref[i - 1].topk(2)
        want = {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        want.setdefault(tok.decode([ids[i]]), ref[i - 1, ids[i]].item())
        assert lp.top_logprobs[i].keys() == want.keys(), i
        assert all(abs(v - want[piece]) <= TOL for piece, v in lp.top_logprobs[i].items()), i
    assert short.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:10], abs=TOL)
    streamed = [c for chunk in client.completions.create(model=server.engine.model_name, prompt=ids, max_tokens=0,
                                                          echo=True, logprobs=0, stream=True)
                for c in chunk.choices]
    assert "".join(c.text for c in streamed) == full.text
    streamed_lps = [t for c in streamed for t in c.logprobs.token_logprobs]
    assert streamed_lps[0] is None and streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)

    status, body = _post(server, {"prompt": ids + ids[:1], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert str(MAX_LEN + 1) in body["error"]["message"] and str(MAX_LEN) in body["error"]["message"]
    status, body = _post(server, {"prompt": ids, "max_tokens": 1, "echo": True})
    assert status == 400 and body["error"]["param"] == "prompt"


@pytest.mark.parametrize("body,field", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),  # OpenAI's forms (and vLLM's schema) keep one kind per batch
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": ["fine", "long " * 300]}, "prompt[1]"),
])
def test_bad_batches_and_echo(server, body, field):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": server.engine.model_name, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=60)
    assert exc.value.code == 400
    err = json.loads(exc.value.read())["error"]
    assert err["param"] == field and field in err["message"]
    # Nothing of a refused batch stays in the engine (the aborts of its admitted prompts land on the next
    # turn of the engine loop).
    deadline = time.monotonic() + 10
    while server.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine.has_unfinished_requests()


def test_echo_max_tokens_zero_with_min_tokens_names_the_clients_max_tokens(server):
    """Echo with max_tokens 0 runs in the engine as one forced token, yet a min_tokens above 0 is refused
    against the client's own max_tokens (0), not the engine's 1; min_tokens 0 is served."""
    status, body = _post(server, {"prompt": "One, two, three", "max_tokens": 0, "echo": True, "min_tokens": 3})
    err = body["error"]
    assert status == 400 and err["param"] == "min_tokens"
    assert "3 is above max_tokens 0" in err["message"] and "max_tokens 1" not in err["message"]
    status, body = _post(server, {"prompt": "One, two, three", "max_tokens": 0, "echo": True, "min_tokens": 0})
    assert status == 200 and body["choices"][0]["text"] == "One, two, three"


def test_lm_eval_loglikelihood_request(server):
    """The exact request lm-evaluation-harness's local-completions model sends for loglikelihood (token-id
    prompts in a batch, max_tokens=1, logprobs=1, echo, seed), read the way it reads the answer: the sum of
    ``token_logprobs[ctxlen:-1]`` and whether each continuation token is the top-1 alternative."""
    import json
    import urllib.request

    tok = server.engine.tokenizer
    pairs = [("Question: What color is the sky? Answer:", " blue"), ("The opposite of hot is", " cold"),
             ("2 + 2 =", " 5")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx = tok.encode(context)
        prompts.append(ctx + tok.encode(continuation, add_special_tokens=False))
        ctxlens.append(len(ctx))
    body = {"model": server.engine.model_name, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens):
        token_lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(token_lps) == len(ids) - ctxlen
        ref = _reference_logprobs(server.engine, ids)
        want = sum(ref[p - 1, ids[p]].item() for p in range(ctxlen, len(ids)))
        assert abs(sum(token_lps) - want) <= TOL * len(token_lps)
        greedy = all(lp == max(top.values()) for lp, top in zip(token_lps, tops))
        ref_greedy = all(ref[p - 1].argmax().item() == ids[p] for p in range(ctxlen, len(ids)))
        margins = [ref[p - 1].topk(2).values.diff().abs().item() for p in range(ctxlen, len(ids))]
        if min(margins) > TOL:  # not a near-tie: the greedy flag must agree with the reference
            assert greedy == ref_greedy


def test_second_app_in_process_with_a_slash_in_its_model_name(server):
    """A model name with a slash (as Hugging Face ids have) is retrievable; two apps in one process keep
    their own metrics (each series names its app's model)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with ServerThread(create_app(server.engine, served_model_name="org/tiny-model")) as other:
        c = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0)
        assert c.models.retrieve("org/tiny-model").id == "org/tiny-model"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("org/other-model")
        for srv, name in ((other, "org/tiny-model"), (server, server.engine.model_name)):
            with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
                text = r.read().decode()
            labels = {s.labels.get("model_name") for f in text_string_to_metric_families(text) for s in f.samples}
            assert labels == {name}


MULTIBYTE = "I love 🍕 and 日本語, é"


def test_text_offsets_count_characters_of_multibyte_text(server, client):
    """Tokens that end inside a multi-byte character decode alone to U+FFFD; offsets still index the
    choice's text: every whole token sits at its offset, and the tokens of one character share the
    character's offset. Streamed chunks carry the same offsets as the whole response."""
    r = client.completions.create(model=client.models.list().data[0].id, prompt=MULTIBYTE,
                                  max_tokens=0, echo=True, logprobs=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == MULTIBYTE
    assert any("\ufffd" in t for t in lp.tokens)  # the case this is about
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(MULTIBYTE)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in token:
            assert MULTIBYTE[offset:offset + len(token)] == token, (token, offset)
    assert lp.text_offset[lp.tokens.index(" and")] == MULTIBYTE.index(" and")
    args = dict(model=client.models.list().data[0].id, prompt=MULTIBYTE, max_tokens=6, echo=True, logprobs=0,
                temperature=0)
    whole = client.completions.create(**args).choices[0].logprobs.text_offset
    streamed = [o for c in client.completions.create(stream=True, **args) if c.choices
                for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert streamed == whole


def _check_prompt_logprobs(server, entries, prompt_ids, k):
    """vLLM's ``prompt_logprobs`` of one prompt against the engine's teacher-forced scoring logits: each
    entry holds the top ``k`` (ranks 1..k) and the prompt token with its vocabulary rank."""
    tok = server.engine.tokenizer
    ref = _reference_logprobs(server.engine, prompt_ids)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for i in range(1, len(prompt_ids)):
        row, tid = ref[i - 1], prompt_ids[i]
        entry = entries[i]
        top = row.topk(k)
        assert set(entry) == {str(t) for t in top.indices.tolist()} | {str(tid)}
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert abs(entry[str(t)]["logprob"] - v) <= TOL
            if t != tid:
                assert entry[str(t)]["rank"] == r
        assert next(iter(entry)) == str(tid)  # the prompt token first, as vLLM orders an entry
        target = row[tid].item()
        got = entry[str(tid)]
        assert abs(got["logprob"] - target) <= TOL
        # Its rank: the tokens at least as likely, itself included (one within 2 x TOL may fall either side).
        assert 1 + int((row > target + 2 * TOL).sum()) <= got["rank"] <= int((row > target - 2 * TOL).sum())
        # Each token's own text, special tokens (the chat template's) included, as logprobs show tokens.
        assert all(e["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False) for t, e in entry.items())


def test_vllm_prompt_logprobs_on_completions_and_chat(server, client):
    """vLLM's ``prompt_logprobs`` field: per choice on completions (each of a prompt's n choices alike),
    once for the chat's rendered prompt."""
    tok = server.engine.tokenizer
    name = server.engine.model_name
    r = client.completions.create(model=name, prompt=PROMPTS[:2], max_tokens=2, n=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3, "ignore_eos": True})
    choices = [c.model_dump() for c in r.choices]
    for c in choices:
        _check_prompt_logprobs(server, c["prompt_logprobs"], tok.encode(PROMPTS[c["index"] // 2]), 3)
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == chat.usage.prompt_tokens
    _check_prompt_logprobs(server, body["prompt_logprobs"], body["prompt_token_ids"], 0)
    plain = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=1).choices[0].model_dump()
    assert "prompt_logprobs" in plain and plain["prompt_logprobs"] is None  # vLLM sends null unrequested
    plain_chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=1).model_dump()
    assert "prompt_logprobs" in plain_chat and plain_chat["prompt_logprobs"] is None
    # return_tokens_as_token_ids names the tokens of logprobs, not prompt_logprobs' texts (as in vLLM).
    named = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=1, logprobs=1, extra_body={
        "prompt_logprobs": 1, "return_tokens_as_token_ids": True}).choices[0].model_dump()
    assert named["logprobs"]["tokens"][0].startswith("token_id:")
    _check_prompt_logprobs(server, named["prompt_logprobs"], tok.encode(PROMPTS[0]), 1)


@pytest.mark.parametrize("extra,says", [
    ({"prompt_logprobs": 2, "stream": True}, "not available when 'stream' is true"),
    ({"prompt_logprobs": 2, "echo": True, "logprobs": 2}, "cannot be combined with 'echo'"),
    ({"prompt_logprobs": -1}, "-1 (every token of the vocabulary) is not supported"),
    ({"prompt_logprobs": 21}, "must be an integer in [0, 20]"),
], ids=["stream", "echo", "whole-vocabulary", "too-many"])
def test_vllm_prompt_logprobs_refusals_name_the_field(server, extra, says):
    from kvforge.errors import InvalidRequestError
    from kvforge.server.protocol import parse_completion

    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"model": "m", "prompt": "hi", **extra}, "m")
    assert err.value.field == "prompt_logprobs" and says in str(err.value)


def test_streamed_prompt_logprobs_zero_is_accepted_without_effect(client, server):
    """vLLM accepts a streamed ``prompt_logprobs`` of 0 and drops it."""
    from kvforge.server.protocol import parse_completion

    assert parse_completion({"model": "m", "prompt": "hi", "prompt_logprobs": 0, "stream": True},
                            "m").params.prompt_logprobs is None
    chunks = list(client.completions.create(model=server.engine.model_name, prompt="hi", max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 0}))
    assert chunks and all("prompt_logprobs" not in c.choices[0].model_dump() for c in chunks if c.choices)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_its_content_type(server, content_type):
    """`curl -d '{...}'` without a header sends a form content type: the body is still the request."""
    import json
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/completions", method="POST", headers={"Content-Type": content_type},
                                 data=json.dumps({"model": server.engine.model_name, "prompt": "Hi",
                                                  "max_tokens": 1}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 1
