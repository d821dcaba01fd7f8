"""``LLM``: offline generation with vLLM's shapes (``LLM(...).generate(prompts, params)``)."""

from __future__ import annotations

import itertools

from kvforge.config import EngineArgs
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams


class LLM:
    """Owns one LLMEngine. ``model=None`` is the embedded SmolLM2-135M-Instruct.

    ``with LLM(...) as llm:`` shuts the engine down on exit (``shutdown()``: the KV pool, CUDA
    graphs, weights and tensor-parallel workers are released at once).

    Keyword arguments are EngineArgs fields (kv_cache_dtype, block_size,
    max_model_len, dtype, seed, load_format, skip_tokenizer_init, ...).
    """

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.setdefault("progress", kwargs.pop("use_tqdm", True))
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Free the engine's device memory now (``LLMEngine.shutdown``); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def plan(self):
        return self.engine.plan

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; a prompt is a string or {"prompt_token_ids": [...]}.

        Results come back in prompt order. Invalid requests raise before any is run.
        """
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm and self.engine.args.progress)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted and out.request_id not in done:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        missing = [i for i in ids if i not in done]
        if missing:
            raise RuntimeError(f"engine stopped with unfinished requests {missing}")
        return [done[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation (list of {"role", "content"}) or a list of them."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built without one")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        # The template already holds the special tokens: encode without adding BOS again.
        ids = [{"prompt_token_ids": self.engine.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(ids, sampling_params, use_tqdm)
