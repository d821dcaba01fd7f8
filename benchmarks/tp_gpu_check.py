"""TP=2 vs TP=1 on two GPUs (issue 6 item 2): Llama-3.1-8B architecture, dummy weights, fp8 KV,
no --block-size. Prints the chosen block size, per-rank capacity and allocations, and whether the
greedy tokens of TP=2 equal TP=1 (same seed -> same dummy model).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/tp_gpu_check.py [--out result.json]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"


DTYPE = os.environ.get("TP_CHECK_DTYPE", "auto")  # "float32": fp32 weights + fp32 KV, for a logits comparison
KV = "auto" if DTYPE == "float32" else "fp8"


def run(tp: int) -> dict:
    from kvforge import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", tensor_parallel_size=tp, kv_cache_dtype=KV, dtype=DTYPE,
              skip_tokenizer_init=True, max_model_len=8192, kv_cache_memory=16 * 2**30, progress=False,
              enforce_eager=True)
    start = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 120000 + 100 for j in range(40 + 17 * i)]} for i in range(4)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    gen = time.perf_counter() - t0
    plan = llm.plan
    logits = llm.engine.compute_prompt_logits(prompts[1]["prompt_token_ids"]).float().cpu()
    result = {"logits": logits,
        "tp": tp, "block_size": plan.block_size, "block_size_reason": plan.block_size_reason,
        "kv_heads_per_rank": plan.layers[0].kv_heads_per_rank, "bytes_per_token_per_rank": plan.bytes_per_token,
        "num_blocks_per_rank": plan.num_blocks, "capacity_tokens": plan.capacity_tokens,
        "weights_bytes_per_rank": plan.weights_bytes_per_rank,
        "rank_reports": getattr(getattr(llm.engine, "tp", None), "reports", None),
        "tokens": [o.outputs[0].token_ids for o in outs], "startup_s": round(start, 1), "generate_s": round(gen, 2),
    }
    llm.engine.shutdown()
    del llm
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    import torch

    print("GPUs:", torch.cuda.device_count(), flush=True)
    r2 = run(2)
    print(json.dumps({k: v for k, v in r2.items() if k not in ("tokens", "logits")}, default=str), flush=True)
    r1 = run(1)
    same = [a == b for a, b in zip(r1["tokens"], r2["tokens"])]
    match = sum(x == y for a, b in zip(r1["tokens"], r2["tokens"]) for x, y in zip(a, b))
    total = sum(len(a) for a in r1["tokens"])
    diff = (r1.pop("logits") - r2.pop("logits")).abs().max().item()
    summary = {"tp2": {k: v for k, v in r2.items() if k != "tokens"}, "tp1_block_size": r1["block_size"],
               "dtype": DTYPE, "kv": KV, "max_abs_logit_diff_tp1_vs_tp2": diff,
               "tp1_capacity_tokens": r1["capacity_tokens"], "identical_sequences": same,
               "token_agreement": f"{match}/{total}"}
    if len(sys.argv) > 2 and sys.argv[1] == "--out":
        with open(sys.argv[2], "w") as f:
            json.dump({"summary": summary, "tp1": r1, "tp2": r2}, f, indent=2, default=str)
    print("SUMMARY", json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
