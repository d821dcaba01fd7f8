"""``--enable-prompt-tokens-details`` (vLLM's flag): usage names the prompt tokens the prefix cache served,
``prompt_tokens_details.cached_tokens``, whole and streamed; without the flag usage is OpenAI's three counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def engine():
    engine = smollm2_test_engine(max_model_len=512, max_num_seqs=8, extra_args=("--kv-cache-memory", "256M"))
    yield engine
    engine.shutdown()


def _client(engine, details: bool):
    from kvforge.server.app import ServerThread, create_app

    srv = ServerThread(create_app(engine, prompt_tokens_details=details)).start()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def test_cached_prompt_tokens_are_counted(engine):
    srv, client = _client(engine, True)
    try:
        block = engine.plan.block_size
        kw = dict(model=client.models.list().data[0].id, prompt=PROMPT + "Once", max_tokens=2, temperature=0)
        first = client.completions.create(**kw).usage
        assert first.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
        again = client.completions.create(**kw).usage
        # Every whole block of the prompt but the one holding its last token, which is computed again.
        assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // block * block > 0
        two = client.completions.create(**{**kw, "n": 2, "seed": 1, "temperature": 1}).usage  # counted once
        assert two.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
        stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True})
        *chunks, last = list(stream)
        assert last.usage.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
        assert chunks and all(c.usage.prompt_tokens_details is None for c in chunks)  # known at the end
    finally:
        srv.stop()


def test_without_the_flag_usage_has_three_counts(engine):
    srv, client = _client(engine, False)
    try:
        usage = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=1).usage
        assert usage.prompt_tokens_details is None and usage.total_tokens == usage.prompt_tokens + 1
    finally:
        srv.stop()
