"""``LLM``: offline generation with vLLM's shapes (``LLM(...).generate(prompts, params)``)."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import re
import time
from collections.abc import Sequence

from kvforge.cli_vllm_flags import engine_keyword_args
from kvforge.config import EngineArgs
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.errors import InvalidRequestError, KVForgeError
from kvforge.metrics_reader import Metric, read_registry
from kvforge.server.metrics import RequestTimes, ServerMetrics
from kvforge.speculative.stats import SpeculativeStats


class LLM:
    """Owns one LLMEngine. ``model=None`` is the embedded SmolLM2-135M-Instruct.

    ``with LLM(...) as llm:`` shuts the engine down on exit (``shutdown()``: the KV pool, CUDA
    graphs, weights and tensor-parallel workers are released at once).

    Keyword arguments are EngineArgs fields (kv_cache_dtype, block_size,
    max_model_len, dtype, seed, load_format, skip_tokenizer_init, ...), sizes
    as integers or strings ("8GiB"); vLLM's keywords kvforge answers from its
    flag table (kvforge/cli_vllm_flags.py): ``swap_space``,
    ``disable_log_stats``, ... accepted without effect, ``kv_cache_memory_bytes``
    an alias, ``quantization`` and the like refused with the reason.
    """

    def __init__(self, model: str | None = None, **kwargs):
        kwargs.setdefault("progress", kwargs.pop("use_tqdm", True))
        fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        try:
            self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_keyword_args(kwargs, fields)))
        except KVForgeError as e:
            _note_keywords(e, fields)
            raise
        self._ids = itertools.count()
        # The series of the server's /metrics, fed by generate() as outputs come (the HTTP ones stay empty).
        self._metrics = ServerMetrics(self.engine.model_name)
        self._steps_seen = self.engine.step_log.total

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name for it (``LLM.engine`` here)."""
        return self.engine

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's): the next requests compute their prompts in full. False, with
        nothing forgotten, while a request is unfinished."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The series of ``/metrics`` as of now (docs/SERVER.md), as vLLM's ``LLM.get_metrics()`` returns them:
        the engine's gauges and counters (and, while speculating, the per-position acceptance), the requests'
        latency and size histograms and finish counters over every ``generate`` / ``chat`` call so far, and the
        engine steps' histograms; as ``Counter``, ``Gauge``, ``Histogram`` and ``Vector`` of
        kvforge/metrics_reader.py, named ``kvforge:...`` (a counter without ``_total``), each labelled with
        ``model_name``. A request arrives when its call does. Every request the LLM accepted is in the engine,
        so ``num_requests_in_flight`` is its running and waiting requests."""
        stats = self.engine.stats()
        self._observe_steps()
        self._metrics.engine.stats = stats
        self._metrics.engine.in_flight = stats["num_running"] + stats["num_waiting"]
        return read_registry(self._metrics.registry)

    def _observe_steps(self) -> None:
        log = self.engine.step_log
        self._metrics.on_steps(log.since(self._steps_seen))
        self._steps_seen = log.total

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters of a ``generate`` call without any: SamplingParams' defaults with the model's
        generation config over them (``--generation-config``, kvforge/engine/generation_defaults.py)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; a prompt is a string, {"prompt": str}, {"prompt_token_ids": [...]}
        or (in a list) a list of token ids. ``priority``: one integer per prompt, lower served first (needs
        ``scheduling_policy="priority"``), as vLLM's ``LLM.generate`` takes it. ``lora_request`` is vLLM's
        argument in vLLM's place: None is taken, an adapter is refused (kvforge serves no LoRA adapters).

        Results come back in prompt order, one ``RequestOutput`` per prompt whose ``outputs`` hold its
        ``n`` samples (``index`` 0 .. n - 1). Each sample is its own engine request
        (``SamplingParams.sample_params``: a seeded sample ``j`` uses ``seed + j``); with prefix caching
        on, samples 1 .. n - 1 are added once sample 0's prompt is computed, so they reuse its KV blocks.
        Invalid requests raise before any is run.
        """
        if lora_request is not None:
            raise InvalidRequestError("lora_request: kvforge serves no LoRA adapters; merge the adapter into the "
                                      "weights, or pass None", field="lora_request")
        single = isinstance(prompts, (str, dict))
        if not single and not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', or a "
                                      f"list of those or of token-id lists; got {type(prompts).__name__}",
                                      field="prompt")
        prompts = [prompts] if single else list(prompts)
        if prompts and all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in prompts):
            raise InvalidRequestError('prompts is a list of ints: pass token ids as {"prompt_token_ids": [...]} '
                                      "(one prompt) or as a list of token-id lists", field="prompt")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams (or one per prompt), got "
                                f"{type(p).__name__}: build it as SamplingParams(temperature=..., max_tokens=...)")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)):
            raise TypeError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
        elif len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        arrival = time.monotonic()
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        samples = [[rid] + [f"{rid}.{j}" for j in range(1, p.n)] for rid, p in zip(ids, params)]
        # Samples 1 .. n - 1 of a prompt, keyed by the request of its sample 0, to add once that has an output.
        later = {rid: [(sid, prompt, p.sample_params(j), rank) for j, sid in enumerate(sids) if j]
                 for rid, sids, prompt, p, rank in zip(ids, samples, prompts, params, priority) if p.n > 1}
        added = []
        try:
            for rid, prompt, p, rank in zip(ids, prompts, params, priority):
                self.engine.add_request(rid, prompt, p.sample_params(0), priority=rank)
                added.append(rid)
            if not self.engine.block_manager.enable_prefix_caching:  # nothing to reuse: add them all now
                for rid in list(later):
                    added += self._add_all(later.pop(rid))
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        requests = self.engine.scheduler.requests
        for rid, p in zip(ids, params):  # the output limit as resolved: None runs to the end of the context
            seq = requests.get(rid)
            if p.max_tokens is not None:
                self._metrics.on_request(p.n, p.max_tokens)
            elif seq is not None:
                self._metrics.on_request(p.n, self.engine.max_model_len - seq.num_prompt_tokens)
        times = {sid: RequestTimes(arrival) for sids in samples for sid in sids}
        done = self._run([sid for sids in samples for sid in sids], later, use_tqdm and self.engine.args.progress,
                         times)
        return [done[sids[0]] if len(sids) == 1 else _merge_samples(rid, [done[sid] for sid in sids])
                for rid, sids in zip(ids, samples)]

    def _add_all(self, requests) -> list[str]:
        added = []
        for rid, prompt, p, rank in requests:
            self.engine.add_request(rid, prompt, p, priority=rank)
            added.append(rid)
        return added

    def _run(self, ids: list[str], later: dict, use_tqdm: bool,
             times: dict[str, RequestTimes]) -> dict[str, RequestOutput]:
        wanted = set(ids)
        metrics = self._metrics
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                now = time.monotonic()
                self._observe_steps()
                for out in outputs:
                    if out.request_id in later:  # its prompt is computed: its other samples reuse the blocks
                        self._add_all(later.pop(out.request_id))
                    clock = times.get(out.request_id)
                    if clock is not None:
                        metrics.on_output(clock, out, now)
                    if out.finished and out.request_id in wanted and out.request_id not in done:
                        done[out.request_id] = out
                        if clock is not None:
                            metrics.on_finish(clock, out, now)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in wanted - set(done):
                self.engine.abort_request(rid)
                metrics.on_abort(times.get(rid))
            raise
        finally:
            if bar is not None:
                bar.close()
        missing = [i for i in ids if i not in done]
        if missing:
            raise RuntimeError(f"engine stopped with unfinished requests {missing}")
        return done

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None, tools=None,
             chat_template_content_format: str = "auto", mm_processor_kwargs: dict | None = None,
             lora_request=None):
        """One conversation (a list of ``{"role", "content"}`` messages, content a string or OpenAI text parts)
        or a list of them, rendered by the model's chat template as the server renders a chat request:
        ``add_generation_prompt`` opens an assistant turn, ``continue_final_message`` (with
        ``add_generation_prompt=False``) continues the last assistant message, ``chat_template_kwargs`` are
        extra template variables (e.g. ``enable_thinking``). Each output's ``prompt`` is the rendered text.
        A bad message raises InvalidRequestError naming it (``messages[i].content``, ...); text parts are joined
        by newlines, and the text reaches the template as a string (``chat_template_content_format`` "string";
        "auto": the engine's ``chat_template_content_format``, read from the template by default) or as a list
        of one text part ("openai"). ``tools`` (OpenAI's
        function tools) reach the template as its ``tools`` variable, as vLLM's ``LLM.chat`` passes them; to hold
        the output to a call, give ``SamplingParams(structured_outputs=...)`` the function's parameters.
        ``chat_template``, ``mm_processor_kwargs`` and ``lora_request`` are vLLM's arguments kvforge does not
        take: a per-call template is refused (pass ``chat_template=`` to ``LLM(...)``), and so are multimodal
        inputs and adapters (None is taken)."""
        from kvforge.server.protocol import parse_chat_template_options, parse_messages
        from kvforge.server.tokenization import render_chat
        from kvforge.server.tool_calls import with_tools

        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built without one")
        if chat_template is not None:
            raise InvalidRequestError("chat_template per call is not taken: give chat_template= to LLM(...) "
                                      "(a file or the template text), which renders every conversation",
                                      field="chat_template")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError("chat_template_content_format must be auto (the engine's "
                                      "--chat-template-content-format), string or openai, got "
                                      f"{chat_template_content_format!r}", field="chat_template_content_format")
        if mm_processor_kwargs:
            raise InvalidRequestError("multimodal inputs are not supported (leave mm_processor_kwargs unset)",
                                      field="mm_processor_kwargs")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            convs = [list(c) for c in messages]
        else:
            convs = [list(messages) if isinstance(messages, tuple) else messages]
        body = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                "chat_template_kwargs": chat_template_kwargs}
        ids, prompts = [], []
        for conv in convs:
            clean = parse_messages(conv)
            options = with_tools(parse_chat_template_options(body, clean), tools)
            if chat_template_content_format != "auto":
                options = dataclasses.replace(options, content_format=chat_template_content_format)
            text = render_chat(tokenizer, clean, options)
            # The template already holds the special tokens: encode without adding BOS again.
            ids.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
            prompts.append(text)
        outs = self.generate(ids, sampling_params, use_tqdm, lora_request)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt  # the rendered conversation, as vLLM's chat reports it
        return outs


def _merge_samples(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples (each its own finished request, sample 0 first) as one RequestOutput with
    ``outputs[j]`` the sample ``j``; the prompt's fields come from sample 0, speculative counts are summed."""
    first = outs[0]
    spec = [o.speculative for o in outs if o.speculative is not None]
    speculative = None
    if spec:
        speculative = SpeculativeStats(sum(s.num_drafts for s in spec), sum(s.num_draft_tokens for s in spec),
                                       sum(s.num_accepted_tokens for s in spec))
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        outputs=[dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)], finished=True,
        num_cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs, speculative=speculative,
        first_scheduled_time=first.first_scheduled_time,
    )


def _note_keywords(error: Exception, fields: set[str]) -> None:
    """Engine errors name the command line's flags; add a note giving the ``LLM(...)`` keyword of each."""
    notes = {}
    for negated, flag in re.findall(r"--(no-)?([a-z][a-z0-9-]*)", str(error)):
        key = flag.replace("-", "_")
        if key in fields:
            notes.setdefault(f"--{negated}{flag}", f"{key}=False" if negated else f"{key}=")
    if notes:
        error.add_note("as LLM(...) keywords: " + ", ".join(f"{flag} is {kw}" for flag, kw in notes.items()))
