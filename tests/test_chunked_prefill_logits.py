"""A prompt prefilled over several steps: only its last chunk samples, so the chunks before it compute no
logits at all (they used to compute the whole vocabulary for every token of the chunk: 64 x 49,152 float32
here, 8,192 x 128,256 for Llama-3.1-8B, beyond the plan's activation reserve)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

from kvforge.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made and read across Europe. ") * 10


@pytest.fixture(scope="module")
def engine():
    engine = smollm2_test_engine(max_model_len=512, max_num_seqs=4,
                                 extra_args=("--max-num-batched-tokens", "64", "--kv-cache-memory", "64M",
                                             "--no-enable-prefix-caching"))
    yield engine
    engine.shutdown()


def test_chunks_before_the_last_compute_no_logits(engine):
    model = engine.runner.model
    rows_seen = []
    compute = model.compute_logits

    def recording(hidden):
        rows_seen.append(hidden.shape[0])
        return compute(hidden)

    model.compute_logits = recording
    try:
        prompt_len = len(engine.tokenizer.encode(PROMPT))
        assert prompt_len > 3 * 64  # several chunks of the 64-token budget
        engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
    finally:
        model.compute_logits = compute
    chunks = -(-prompt_len // 64)
    # one step per chunk, then two decode steps: logits only where a token is sampled
    assert rows_seen == [0] * (chunks - 1) + [1, 1, 1]
    assert len(tokens) == 3
