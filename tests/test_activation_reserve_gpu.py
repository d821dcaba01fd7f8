"""A full-budget prefill step of the dummy Llama-3.1-8B fits beside the KV cache the plan sized (CUDA only).

With a budget of 262,144 tokens, 8 prompts of 32,768 tokens fill one step. The plan sets the step's
activations aside before sizing the KV cache from the device, so the step runs; its peak allocation above
what the engine held before it is at most the plan's reserve.
"""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUDGET = 262_144
SEQS = 8


def test_full_budget_prefill_step_fits_beside_the_planned_kv_cache():
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", max_num_batched_tokens=BUDGET,
              long_prefill_token_threshold=0, max_model_len=32_808, max_num_seqs=SEQS, progress=False)
    try:
        reserve = llm.plan.activations
        assert reserve is not None and reserve.tokens == BUDGET
        total = torch.cuda.mem_get_info()[1]
        assert llm.plan.weights_bytes_per_rank + llm.plan.capacity.kv_cache_memory + reserve.bytes <= total
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(0, 128_000, (BUDGET // SEQS,), generator=g).tolist()}
                   for _ in range(SEQS)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert [len(o.outputs[0].token_ids) for o in outs] == [1] * SEQS
        print(f"step peak {peak / 2**30:.2f} GiB above the engine's, reserve {reserve.describe()}")
        assert peak <= reserve.bytes, (peak, reserve)
    finally:
        llm.shutdown()
