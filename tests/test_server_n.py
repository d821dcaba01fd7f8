"""``n`` choices per prompt on ``/v1/completions`` and ``/v1/chat/completions``, through the official
``openai`` client over real HTTP, streaming and not.

The real engine (embedded SmolLM2, float32 on CPU, prefix caching on) checks the response shape:
choice indices, usage (each prompt once, every completion token once), the prompt blocks the
later samples reuse, and that a client who leaves aborts every sample. The seed rule (sample ``j``
of a request with seed ``s`` is the request with seed ``s + j``) is checked exactly on
``tests/fake_engine.FakeEngine``, whose seeded draws depend on nothing but the seed; the real
engine's float32 logits move in the last bits with the batch, so its samples are compared only
between identical requests.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, smollm2_test_engine  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.metrics import metric_sum, parse_prometheus  # noqa: E402

# Long enough to fill several KV blocks, so the later samples have full prompt blocks to reuse.
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
          "changed how books were made and read across Europe. Printers set each page by hand, letter by "
          "letter, and a single shop could produce more books in a month than a monastery copied in a "
          "lifetime. Within fifty years presses ran in more than two hundred cities, and in the years that "
          "followed,")


@pytest.fixture(scope="module")
def server():
    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=8)
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metrics(server) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        return parse_prometheus(r.read().decode())


def _prompt_tokens(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


SAMPLED = dict(max_tokens=5, temperature=1.0, extra_body={"ignore_eos": True})


def test_completion_n_choices_usage_and_shared_prompt_blocks(server, client):
    name = server.engine.model_name
    hits = "kvforge:prefix_cache_hits_total"
    before = metric_sum(_metrics(server), hits)
    r = client.completions.create(model=name, prompt=PROMPT, n=3, seed=11, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in r.choices)
    assert r.usage.prompt_tokens == _prompt_tokens(server, PROMPT)  # the prompt counts once
    assert r.usage.completion_tokens == 3 * 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 15
    # Samples 1 and 2 are added once sample 0's prompt is computed: each finds its full blocks cached.
    block = server.engine.block_manager.block_size
    full_blocks = (_prompt_tokens(server, PROMPT) - 1) // block
    assert full_blocks >= 2, "the prompt must span several blocks for this check"
    gained = metric_sum(_metrics(server), hits) - before
    assert gained >= 2 * full_blocks * block, gained
    # The same seeded request again gives the same three choices.
    again = client.completions.create(model=name, prompt=PROMPT, n=3, seed=11, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_completion_batch_with_n_orders_choices_by_prompt(server, client):
    name = server.engine.model_name
    prompts = ["One, two, three,", "The capital of France is"]
    r = client.completions.create(model=name, prompt=prompts, n=2, echo=True, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # Choice index = prompt position * n + sample: echo shows which prompt each choice continues.
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2])
    assert r.usage.prompt_tokens == sum(_prompt_tokens(server, p) for p in prompts)
    assert r.usage.completion_tokens == 4 * 5


def test_streamed_completion_n_choices(server, client):
    name = server.engine.model_name
    chunks = list(client.completions.create(model=name, prompt=PROMPT, n=3, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    texts, finishes = {}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.index not in finishes, "a choice finishes once"
            finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and finishes == {0: "length", 1: "length", 2: "length"}
    assert all(texts.values())
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == _prompt_tokens(server, PROMPT) and usage.completion_tokens == 15


def test_chat_n_choices_streaming_and_not(server, client):
    name = server.engine.model_name
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=name, messages=messages, n=2, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 10
    rendered = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = len(rendered) if isinstance(rendered, list) else _prompt_tokens(server, rendered)
    assert r.usage.prompt_tokens == expected

    chunks = list(client.chat.completions.create(model=name, messages=messages, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1], "each choice opens with its role"
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and all(texts.values())
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == expected


def _streamed_tokens(chunks, kind: str) -> dict[int, list[int]]:
    """Per choice, the number of tokens each of its chunks carries (from the chunk's logprobs), in order;
    chunks without logprobs (a chat stream's role chunks) are left out."""
    counts: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is None:
                continue
            got = choice.logprobs.tokens if kind == "completion" else choice.logprobs.content
            counts.setdefault(choice.index, []).append(len(got))
    return counts


@pytest.mark.parametrize("case", ["completion", "chat", "batch"])
def test_every_streamed_chunk_carries_one_step_of_its_choice(server, client, case):
    """As OpenAI and vLLM stream them, each chunk of each choice carries the token of one engine step (no
    speculative decoding here: one token), the first chunk of choice 0 included: the samples added after
    sample 0's prompt was computed (prefix caching) do not make choice 0's first tokens arrive together,
    nor do the prompts of a batch."""
    name = server.engine.model_name
    kw = dict(model=name, max_tokens=4, temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    if case == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], n=3,
                                                     logprobs=True, **kw))
    elif case == "completion":
        chunks = list(client.completions.create(prompt=PROMPT, n=3, logprobs=0, **kw))
    else:
        chunks = list(client.completions.create(prompt=[PROMPT, PROMPT[:40] + " and", PROMPT + " in"], n=2,
                                                logprobs=0, **kw))
    counts = _streamed_tokens(chunks, "chat" if case == "chat" else "completion")
    choices = 6 if case == "batch" else 3
    assert counts == {i: [1, 1, 1, 1] for i in range(choices)}


def test_a_client_that_leaves_aborts_every_sample(server):
    url = server.url + "/v1/completions"
    name = server.engine.model_name

    async def stream_then_leave(http):
        body = {"model": name, "prompt": PROMPT, "n": 4, "max_tokens": 120, "temperature": 1.0,
                "ignore_eos": True, "stream": True}
        resp = await http.post(url, json=body)
        assert resp.status == 200
        got = 0
        async for line in resp.content:
            if line.startswith(b"data:"):
                got += 1
                if got >= 6:
                    break
        resp.close()  # drop the connection mid-stream

    async def wait_then_leave(http):
        body = {"model": name, "prompt": PROMPT + " again", "n": 4, "max_tokens": 120, "temperature": 1.0,
                "ignore_eos": True}
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                await resp.read()

    async def run():
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(stream_then_leave(http), wait_then_leave(http))

    asyncio.run(run())
    deadline = time.time() + 30
    while True:
        m = _metrics(server)
        used = metric_sum(m, "kvforge:kv_blocks_used")
        queued = metric_sum(m, "kvforge:num_requests_running") + metric_sum(m, "kvforge:num_requests_waiting")
        in_flight = metric_sum(m, "kvforge:num_requests_in_flight")
        if used == 0 and queued == 0 and in_flight == 0:
            break
        assert time.time() < deadline, f"still in use: blocks={used} running+waiting={queued} in_flight={in_flight}"
        time.sleep(0.1)


# -- the seed rule, exactly, on the fake engine ------------------------------------------------------


@pytest.fixture(scope="module")
def fake_client():
    srv = ServerThread(create_app(FakeEngine())).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_sample_j_of_a_seeded_request_is_the_request_with_seed_plus_j(fake_client, stream):
    kw = dict(model=FakeEngine.model_name, prompt="abc", max_tokens=12, temperature=1.0)
    if stream:
        texts = ["", "", ""]
        for c in fake_client.completions.create(n=3, seed=40, stream=True, **kw):
            texts[c.choices[0].index] += c.choices[0].text
    else:
        texts = [c.text for c in fake_client.completions.create(n=3, seed=40, **kw).choices]
    solo = [fake_client.completions.create(seed=40 + j, **kw).choices[0].text for j in range(3)]
    assert texts == solo
    assert len(set(texts)) == 3, "different seeds draw different texts here"


def test_unseeded_samples_draw_independently(fake_client):
    r = fake_client.completions.create(model=FakeEngine.model_name, prompt="abc", max_tokens=12, n=4,
                                       temperature=1.0)
    assert len({c.text for c in r.choices}) > 1
