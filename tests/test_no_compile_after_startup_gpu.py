"""CUDA: once an engine has started (graphs captured, warm-up run), no request compiles a Triton kernel.

Prompts of many lengths (around the SDPA prefill rule and MLA's absorbed limit, longer than a step), a prefix
that continues a cached one, batches that shrink to one sequence and grow again: every kernel variant they
need must already exist, so a first request never waits on the compiler. Counted with Triton's JIT hook,
which fires on every compilation in the process (a hit in Triton's disk cache included).
"""

from __future__ import annotations

import pytest
import torch
import transformers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled Triton kernels)")

LLAMA = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False)
DEEPSEEK = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=16384, rms_norm_eps=1e-5,
                topk_method="greedy", rope_scaling=None)
PROMPT_LENS = (1, 2, 3, 17, 33, 100, 511, 512, 513, 1000, 2047, 2049, 3000, 9000)


def _save(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**DEEPSEEK))
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


class CompileLog:
    """Records every Triton JIT compilation while installed (restores the previous hook on exit)."""

    def __enter__(self):
        from triton import knobs

        self.names, self.keys, self._prev = [], [], knobs.runtime.jit_cache_hook

        def hook(*, fn, key, **_):
            self.names.append(fn.name)
            self.keys.append(f"{fn.name}: {key}")
            return False  # compile as usual

        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._prev


def _workload(llm):
    from kvforge import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(temperature=0, max_tokens=1 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # One sequence alone, then a prompt continuing a cached prefix beside it.
    llm.generate([{"prompt_token_ids": prompts[5]}], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    cont = prompts[12] + prompts[4]
    llm.generate([{"prompt_token_ids": cont}, {"prompt_token_ids": prompts[3]}],
                 [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, seed=1),
                  SamplingParams(max_tokens=30, ignore_eos=True)], use_tqdm=False)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_triton_compile_after_startup(tmp_path, kind, kv_cache_dtype):
    from kvforge import LLM

    path = _save(tmp_path, kind)
    llm = LLM(path, device="cuda", skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, max_model_len=12000,
              kv_cache_memory=1 << 30, max_num_seqs=32, progress=False)
    try:
        with CompileLog() as log:
            _workload(llm)
        assert log.names == [], "kernels compiled inside requests:\n" + "\n".join(log.keys)
    finally:
        llm.engine.shutdown()
