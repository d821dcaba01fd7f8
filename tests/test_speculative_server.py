"""The server with speculative decoding (embedded SmolLM2, CPU): streams deliver a step's accepted
tokens together, text and logprobs equal the non-streaming response and speculation off's, and
/metrics carries the spec_decode counters."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.metrics import parse_prometheus  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. The early bird catches the worm."
PROMPT = f"Repeat this text exactly: {TEXT}\nRepeated: {TEXT}\nRepeated:"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def server():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    engine = smollm2_test_engine(max_model_len=512, max_num_seqs=4, extra_args=("--speculative-config", spec))
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()


def test_stream_equals_speculation_off_and_metrics(server):
    ref = LLM(device="cpu", progress=False, max_model_len=512).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=server.engine.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert full.choices[0].text == ref.outputs[0].text
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
    streamed_tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert len(streamed_tokens) == MAX_TOKENS == len(full.choices[0].logprobs.tokens)
    assert len(chunks) < MAX_TOKENS  # some chunks carry several accepted tokens
    with urllib.request.urlopen(server.url + "/metrics") as r:
        parsed = parse_prometheus(r.read().decode())
    name = server.engine.model_name
    assert parsed[f'kvforge:spec_decode_num_accepted_tokens_total{{model_name="{name}"}}'] > 0
    assert parsed[f'kvforge:spec_decode_num_draft_tokens_total{{model_name="{name}"}}'] >= \
        parsed[f'kvforge:spec_decode_num_accepted_tokens_total{{model_name="{name}"}}']
