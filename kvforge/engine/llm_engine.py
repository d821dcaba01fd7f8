"""LLMEngine: plan -> (only then) weights -> KV pool -> schedule/run/sample loop.

Order of startup is the point of kvforge: the model spec is read from config
metadata, the KV plan is resolved and checked, and only when it is valid are
the tokenizer and weights opened. Every KV decision the engine uses comes from
``self.plan``; the pool allocates exactly the plan's bytes.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
import time
from pathlib import Path

import torch

from kvforge.config import (
    DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
    DEFAULT_STATE_SNAPSHOT_INTERVAL,
    EngineArgs,
)
from kvforge.engine.bad_words import always_banned, banned_next_tokens, encode_bad_words, longest_prefix
from kvforge.engine.block_manager import BlockManager
from kvforge.engine.config_checks import check_engine_plan
from kvforge.engine.engine_plan import cache_config, pick_device, plan_engine
from kvforge.engine.gc_freeze import collect_dropped_engines, freeze_after_startup, thaw
from kvforge.engine.generation_defaults import eos_token_ids, sampling_defaults
from kvforge.engine.kv_pool import KVPool
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.overlap import InflightStep, copy_tokens_to_host, default_async_scheduling
from kvforge.engine.prompt_ids import check_prompt_dict, check_prompt_token_ids, truncate_prompt
from kvforge.engine.prompt_scoring import PromptScoring
from kvforge.engine.sampler import PendingLogprobs, Sampler
from kvforge.engine.sampling_params import SamplingParams, plain_int
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.engine.step_log import Stamp, StepLog
from kvforge.errors import ConfigError, InvalidRequestError
from kvforge.host_copies import values_to_device
from kvforge.planner.inputs import (
    gpu_memory_flag_ignored_on_cpu,
)
from kvforge.spec.embedded import embedded_model_path
from kvforge.spec.presets import PRESETS
from kvforge.speculative.device_proposals import UNREAD
from kvforge.speculative.stats import SpeculativeStats
from kvforge.structured.token_masks import proposal_bitmask

logger = logging.getLogger("kvforge.engine")

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Greedy sequences' proposals from a proposer that picks them on the device (the MTP layer) stay there until
#: verification reads them with the target's argmax (kvforge/speculative/device_proposals.py): one host wait a
#: verify step instead of two. False: the proposer reads them before the schedule (the path of sampled
#: sequences and tensor parallelism).
READ_PROPOSALS_WITH_VERIFICATION = True


def _with_unread(placeholders, rows: list[int], unread: torch.Tensor):
    """``HostStep.placeholders`` that also fill ``rows`` from ``unread`` (their proposals, in order), beside the
    in-flight tokens ``placeholders`` may already fill (one source tensor: theirs, then ``unread``)."""
    if placeholders is None:
        return rows, list(range(len(rows))), unread
    ph_rows, ph_src, tokens = placeholders
    return (ph_rows + rows, ph_src + list(range(tokens.shape[0], tokens.shape[0] + len(rows))),
            torch.cat([tokens, unread]))


def _is_file(value: str) -> bool:
    """Whether ``value`` names an existing file (False for text no file system takes as a path)."""
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a name over the file system's limit, a NUL byte
        return False


class LLMEngine:
    """The engine: one step per step() call, synchronous or overlapped (async scheduling); see
    docs/ENGINE_API.md for the contract and kvforge/engine/overlap.py for the overlap."""

    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self.args = args
        self.device = pick_device(args.device)
        platform = self.device.type

        # 1. Spec and plan: config metadata only; no weight file is opened here.
        cache = cache_config(args, self.device)
        ignored = platform == "cpu" and gpu_memory_flag_ignored_on_cpu(  # said once the values are valid
            args.kv_cache_memory, args.gpu_memory, args.gpu_memory_utilization)
        if ignored:
            logger.warning("%s", ignored)
        planned = plan_engine(args, self.device, cache)
        self.spec, self.draft_spec, self.plan = planned.spec, planned.draft_spec, planned.plan
        model_dtype = planned.model_dtype
        self.with_mtp = planned.mtp_layers is not None
        speculative = args.speculative_config
        from kvforge.models.registry import resolve_architecture

        resolve_architecture(self.spec.hf_config)  # unsupported model code -> ConfigError, still before weights
        # Linear-attention layers (Qwen3-Next, Kimi-Linear): one state slot per running sequence, from the plan.
        self.has_linear_state = any(layer.kind == "state" for layer in self.plan.layers)
        batched = check_engine_plan(args, self.spec, self.plan, platform)
        self.speculative = args.speculative_config
        self.model_path, self.load_format = self._weights_location(args.model, args.load_format)
        #: Default SamplingParams fields of requests that do not set them (``--generation-config``).
        self.sampling_defaults = sampling_defaults(args.generation_config, self.model_path)
        if self.sampling_defaults:
            logger.info("default sampling parameters from the model's generation config: %s (--generation-config "
                        "vllm for none)", self.sampling_defaults)
        if self.with_mtp and self.load_format != "dummy":
            from kvforge.weights import detect_load_format

            fmt = detect_load_format(self.model_path) if self.load_format == "auto" else self.load_format
            if fmt != "safetensors":
                raise ConfigError(f"--speculative-config method mtp loads the MTP layer from HF safetensors "
                                  f"(model.layers.N.* tensors), not from {fmt}; use the checkpoint's HF directory "
                                  f"or another method")
        if self.draft_spec is not None:  # the draft's weights follow the target's load format (dummy or real)
            self.draft_location = self._weights_location(speculative.model,
                                                         "dummy" if self.load_format == "dummy" else "auto")
            if self.draft_location[1] == "dummy" and self.load_format != "dummy":
                raise ConfigError(f"the draft model {speculative.model!r} is a preset without weights but the target "
                                  f"{self.spec.name} loads real weights: a draft with random weights would propose "
                                  f"nothing useful; give the draft's checkpoint directory or .gguf file (or run both "
                                  f"with --load-format dummy)")
            resolve_architecture(self.draft_spec.hf_config)
        logger.info("%s", self.plan.summary())
        has_mla = any(layer.kind == "mla" for layer in self.plan.layers)
        if has_mla and platform == "cuda":
            logger.info("  MLA prefill mode %s (--mla-prefill-mode)", args.mla_prefill_mode)
        for note in args.settings_without_effect(platform, has_mla):
            logger.warning("%s", note)

        # An engine dropped without shutdown() is frozen (engine/gc_freeze.py): free it before memory is counted.
        collect_dropped_engines()
        if platform == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if platform == "cuda" and args.tensor_parallel_size == 1:  # the device holds what the plan sets aside
            # (under tensor parallelism each rank checks its own GPU, kvforge/distributed/launcher.py)
            from kvforge.engine.device_memory import check_device_memory

            check_device_memory(self.plan, self.device, kv_from_flag=args.kv_cache_memory is not None,
                                utilization=args.gpu_memory_utilization, planned_device_bytes=args.gpu_memory)

        if platform == "cpu":  # the host holds the weights and the KV cache of every rank
            from kvforge.engine.host_memory import check_host_memory

            check_host_memory(self.plan, args.tensor_parallel_size)

        # The planned backends' implementations, imported before any weight is read: one that cannot
        # load here (a missing dependency, a bad KVFORGE_* setting) fails now, not after the weights.
        self._import_backends()

        # 2. Tokenizer, model, weights (only now).
        self.tokenizer = None if args.skip_tokenizer_init else self._load_tokenizer(args)
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.spec.vocab_size:
            logger.warning("the tokenizer has %d ids but the model's vocabulary %d: text that encodes to an id past "
                           "%d is refused; is --tokenizer the model's own?", self.tokenizer.vocab_size,
                           self.spec.vocab_size, self.spec.vocab_size - 1)
        if args.chat_template is not None:
            self._use_chat_template(args.chat_template)
        if self.tokenizer is not None:
            self._choose_content_format(args.chat_template_content_format)
        #: The reasoning model's think-block tags (kvforge/reasoning.py), None without --reasoning-parser.
        self.reasoning = None
        if args.reasoning_parser is not None:
            from kvforge.reasoning import reasoning_tokens

            self.reasoning = reasoning_tokens(args.reasoning_parser, self.tokenizer)
        from kvforge.models.registry import build_model
        from kvforge.models.shared_expert_fold import fold_shared_experts
        from kvforge.weights import load_weights

        self.tp = None
        if args.tensor_parallel_size > 1:
            # One process per rank (kvforge/distributed): every rank builds its model slice, loads its
            # shards and allocates its KV pool from this plan; rank 0 checks their KV bytes against it.
            from kvforge.distributed.launcher import TPLauncher

            draft = (dict(hf_config=self.draft_spec.hf_config, model_path=self.draft_location[0],
                          load_format=self.draft_location[1]) if self.draft_spec is not None else None)
            self.tp = TPLauncher(args, self.plan, self.spec.hf_config, model_dtype, self.device,
                                 self.model_path, self.load_format, draft=draft, with_mtp=self.with_mtp)
            self.model, self.pool, self.device = self.tp.model, self.tp.pool, self.tp.device
        else:
            torch.manual_seed(args.seed)
            self.model = build_model(self.spec.hf_config, TORCH_DTYPES[model_dtype], self.device,
                                     with_mtp=self.with_mtp)
            load_weights(self.model, self.model_path, self.load_format, seed=args.seed, progress=args.progress)
            fold_shared_experts(self.model, self.device)

            # 3. KV pool exactly as planned.
            layouts = getattr(self.model, "linear_state_layouts", None)
            self.pool = KVPool(self.plan, self.device, layouts() if layouts is not None else None)
        # Block manager, scheduler, runner.
        prefix_caching = args.enable_prefix_caching and self.plan.prefix_caching
        if args.enable_prefix_caching and not self.plan.prefix_caching:
            logger.warning("prefix caching %s", self.plan.prefix_caching_reason)
        self.block_manager = BlockManager(self.plan.num_blocks, self.pool.block_size, prefix_caching,
                                          group_windows=self.pool.group_windows)
        self.max_model_len = self.plan.max_model_len
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()
        eos |= set(self._config_eos())
        eos |= set(eos_token_ids(args.generation_config))
        max_num_seqs = args.max_num_seqs
        self.state_slots = None
        ring_rows = ring_row_bytes = 0
        if self.spec.rings or self.has_linear_state:
            from kvforge.engine.state_slots import StateSlots

            # Every running request holds a slot: the plan's state slots are its max concurrency, admitted exactly.
            self.state_slots = StateSlots(self.pool.state_slots)
            if max_num_seqs > self.pool.state_slots:
                logger.info("running sequences capped at the plan's %d state slots (--max-num-seqs %d)",
                            self.pool.state_slots, max_num_seqs)
            max_num_seqs = min(max_num_seqs, self.pool.state_slots)
        if self.spec.rings:
            ring_rows = self.spec.rings[0].rows(self.plan.num_speculative_tokens)
            ring_row_bytes = self.spec.rings[0].row_bytes
        threshold = args.long_prefill_token_threshold
        if threshold is None:
            threshold = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD if args.enable_chunked_prefill else 0
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, batched, self.max_model_len,
                                   args.enable_chunked_prefill, eos_token_ids=eos, tokenizer=self.tokenizer,
                                   long_prefill_token_threshold=threshold, policy=args.scheduling_policy)
        if self.tp is not None:
            self.runner = self.tp.runner  # broadcasts each step to the other ranks
        else:
            verify = 1 + self.speculative.num_speculative_tokens if self.speculative is not None else 1
            self.runner = ModelRunner(self.model, self.pool, self.plan, self.device,
                                      calibrate=args.calculate_kv_scales, scale_multiplier=args.kv_scale_multiplier,
                                      enforce_eager=args.enforce_eager, max_num_seqs=max_num_seqs,
                                      graph_sizes=args.graph_sizes(), ring_rows=ring_rows,
                                      ring_row_bytes=ring_row_bytes,
                                      mla_prefill_mode=args.mla_prefill_mode, verify_query_len=verify)
        if prefix_caching and self.has_linear_state:  # hits resume the state from kept snapshots
            from kvforge.engine.state_prefix import StatePrefixCache

            interval = args.state_snapshot_interval
            self.scheduler.state_prefix = StatePrefixCache(
                self.state_slots, self.block_manager, self.runner.copy_state_slots,
                DEFAULT_STATE_SNAPSHOT_INTERVAL if interval is None else interval)
        self.sampler = Sampler(eos)
        self._eos_token_ids = frozenset(eos)
        self._grammars = None  # structured outputs' GrammarBackend, built by the first request that has one
        self._grammars_lock = threading.Lock()
        self.grammar_tokens_fed_ahead = 0  # in-flight tokens fed to grammars before they resolved (async)
        self.model_name = args.served_model_name or (args.model if args.model else self.spec.name)
        self.model_aliases = tuple(args.served_model_aliases)  # more names the server answers to
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.prefill_tokens_computed = 0
        self.async_scheduling = (bool(args.async_scheduling) if args.async_scheduling is not None
                                 else default_async_scheduling(platform, self.tp is not None, bool(self.spec.rings)))
        # Speculative decoding (kvforge/speculative): proposals before each schedule, verification after the step.
        self.proposer = self.spec_counters = self.draft_runner = self.spec_backoff = None
        self.num_launches = 0  # steps launched (the clock of the proposal back-off)
        self._observes = False  # a proposer that sees every step's tokens (MTP): every step verifies, synchronously
        self._unread = None  # DeviceProposals of the step being scheduled, where they stay on the device
        if self.speculative is not None:
            from kvforge.speculative.proposer import build_proposer
            from kvforge.speculative.stats import SpecDecodeCounters

            draft = (self._build_draft(args, model_dtype, max_num_seqs, batched) if self.draft_spec is not None
                     else None)
            mtp = self._build_mtp(args, max_num_seqs) if self.with_mtp else None
            self.proposer = build_proposer(self.speculative, draft, mtp)
            self.spec_counters = SpecDecodeCounters(self.speculative.num_speculative_tokens)
            self._observes = hasattr(self.proposer, "observe")
            if self._observes and args.async_scheduling is None:
                self.async_scheduling = False
            if self.speculative.backoff and not self._observes:
                from kvforge.speculative.backoff import ProposalBackoff

                self.spec_backoff = ProposalBackoff()
            k = self.speculative.num_speculative_tokens
            graphs = (f" and replay CUDA graphs when every sequence verifies all {k}"
                      if self.device.type == "cuda" and not args.enforce_eager else "")
            logger.info("speculative decoding: %s, %d tokens per step, back-off %s; verification steps run "
                        "synchronously%s", self.speculative.method, k,
                        "on" if self.spec_backoff is not None else "off", graphs)
        self._inflight: InflightStep | None = None  # overlapped scheduling: the launched, unresolved step
        self.async_pressure_resolves = 0  # steps whose in-flight predecessor was resolved first (memory pressure)
        self.step_log = StepLog()  # recent steps: prefill / decode tokens and wall time (docs/SERVER.md)
        self._shut_down = False
        self.warmed_up = self._wants_warm_up(args, platform)  # the startup warm-up ran (engine/warm_up.py)
        if self.warmed_up:
            from kvforge.engine.warm_up import run_warm_up

            run_warm_up(self)
        freeze_after_startup()  # no full collection walks the startup's objects mid-step (engine/gc_freeze.py)
        self.startup_seconds = time.perf_counter() - t0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def shutdown(self) -> None:
        """Give everything back at once: stop tensor-parallel workers (if any) and leave the process
        group, abort the requests still queued or running, free the CUDA graphs, the KV pool and the
        model's weights (``ModelRunner.release``), collect reference cycles and return cached device
        memory to the driver. Afterwards ``torch.cuda.memory_allocated()`` is back where it was before
        the engine was built, whatever references the caller still holds to the engine. Idempotent;
        the engine takes no requests afterwards."""
        if getattr(self, "_shut_down", True):  # also: __init__ failed before the engine existed
            return
        self._shut_down = True
        try:
            if self.tp is not None:
                self.tp.shutdown()
        finally:
            for request_id in list(self.scheduler.requests):
                self.abort_request(request_id)
            self._inflight = None
            self.runner.release()
            if self.draft_runner is not None:
                self.draft_runner.release()
            if self.tp is not None:
                self.tp.release()
            self.model = None
            thaw()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("this engine was shut down (its KV pool and weights are freed); build a new one")

    # ---- startup helpers ------------------------------------------------------
    def _wants_warm_up(self, args: EngineArgs, platform: str) -> bool:
        """``args.warm_up``, or by default: on CUDA at TP=1, unless the first step calibrates the KV scales
        (``--calculate-kv-scales``: warm-up prompts would set them)."""
        if args.warm_up is not None:
            return args.warm_up
        return platform == "cuda" and self.tp is None and not args.calculate_kv_scales

    def _import_backends(self) -> None:
        from kvforge.planner.registry import builtin_backends

        impls = {d.name: d.implementation for d in builtin_backends()}
        layers = self.plan.layers + (self.plan.draft.layers if self.plan.draft is not None else ())
        for name in sorted({layer.backend for layer in layers}):
            importlib.import_module(impls[name])

    @staticmethod
    def _weights_location(model: str | None, load_format: str) -> tuple[str | None, str]:
        if model is None:
            return str(embedded_model_path()), "gguf" if load_format == "auto" else load_format
        path = Path(model)
        if not path.exists():
            if model.lower() in PRESETS:
                if load_format not in ("auto", "dummy"):
                    raise ConfigError(f"preset {model!r} has no weights on disk; use --load-format dummy")
                return None, "dummy"
            raise ConfigError(f"model path {model} does not exist")
        return str(path), load_format

    def _build_draft(self, args: EngineArgs, model_dtype: str, max_num_seqs: int, batched: int) -> dict:
        """The draft model and a runner over its layers of the target's pool (the plan's ``draft``): the
        arguments of :class:`kvforge.speculative.draft_model.DraftModelProposer`, which allocates through
        the target's block manager. At TP > 1 every rank built its slice of the draft at startup
        (kvforge/distributed/launcher.py); rank 0's draft runner broadcasts each draft step to the others."""
        from kvforge.models.registry import build_model
        from kvforge.models.shared_expert_fold import fold_shared_experts
        from kvforge.weights import load_weights

        if self.tp is not None:
            self.draft_runner = self.tp.draft_runner
        else:
            model = build_model(self.draft_spec.hf_config, TORCH_DTYPES[model_dtype], self.device)
            path, load_format = self.draft_location
            load_weights(model, path, load_format, seed=args.seed, progress=args.progress)
            fold_shared_experts(model, self.device)
            self.draft_runner = ModelRunner(model, self.pool.draft_view(), self.plan.draft_runner_plan(),
                                            self.device, calibrate=args.calculate_kv_scales,
                                            scale_multiplier=args.kv_scale_multiplier,
                                            enforce_eager=args.enforce_eager, max_num_seqs=max_num_seqs,
                                            graph_sizes=args.graph_sizes(), mla_prefill_mode=args.mla_prefill_mode)
        return dict(runner=self.draft_runner, block_manager=self.block_manager, max_model_len=self.max_model_len,
                    max_num_batched_tokens=batched, copy_blocks=self._copy_blocks,
                    spare_blocks=lambda: self.scheduler.spare_blocks())

    def _build_mtp(self, args: EngineArgs, max_num_seqs: int) -> dict:
        """A runner of the target model's MTP layer over its layer of the target's pool (the plan's ``draft``):
        the arguments of :class:`kvforge.speculative.mtp.MTPProposer`."""
        if self.tp is not None:  # every rank built its runner of the layer at startup (distributed/launcher.py)
            self.draft_runner = self.tp.draft_runner
        else:
            self.draft_runner = ModelRunner(self.model, self.pool.draft_view(), self.plan.draft_runner_plan(),
                                            self.device, calibrate=args.calculate_kv_scales,
                                            scale_multiplier=args.kv_scale_multiplier,
                                            enforce_eager=args.enforce_eager, max_num_seqs=max_num_seqs,
                                            graph_sizes=args.graph_sizes(), mla_prefill_mode=args.mla_prefill_mode,
                                            mtp_proposals=self.speculative.num_speculative_tokens)
        return dict(runner=self.draft_runner, target_runner=self.runner, block_manager=self.block_manager,
                    max_model_len=self.max_model_len, copy_blocks=self._copy_blocks,
                    spare_blocks=lambda: self.scheduler.spare_blocks())

    def _choose_content_format(self, flag: str) -> None:
        """The shape of message text the chat template gets (``--chat-template-content-format``), logged with
        its reason; a template that does not compile, or an explicit format it contradicts, is warned of."""
        from kvforge.chat_content_format import mismatch_warning, resolve_content_format

        tok = self.tokenizer
        problem = tok.chat_template_problem()
        if problem is not None:
            logger.warning("%s: chat requests will be refused; give one with --chat-template", problem)
        elif not tok.chat_template:
            logger.warning("the tokenizer has no chat template: chat requests (/v1/chat/completions, /v1/responses, "
                           "LLM.chat) will be refused; give one with --chat-template")
        render = None if problem else (lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True))
        choice = resolve_content_format(flag, tok.chat_template, render)
        tok.chat_content_format = choice.content_format
        logger.info("chat messages reach the template as %s content (%s)", choice.content_format, choice.reason)
        warning = mismatch_warning(flag, tok.chat_template)
        if warning:
            logger.warning("%s", warning)

    def _use_chat_template(self, value: str) -> None:
        """``--chat-template``: a file's text, or the template itself, checked before any weight is read."""
        if self.tokenizer is None:
            raise ConfigError("--chat-template needs a tokenizer: drop --skip-tokenizer-init, or give --tokenizer "
                              "for a model without one")
        if "{{" in value or "{%" in value:  # the template itself (longer than a file name may be, often)
            source = value
        elif _is_file(value):
            source = Path(value).read_text(encoding="utf-8")
        else:
            raise ConfigError(f"--chat-template {value!r} is neither a file nor a jinja template")
        try:
            self.tokenizer.use_chat_template(source)
        except ConfigError as e:
            raise ConfigError(f"--chat-template: {e}") from None

    def _load_tokenizer(self, args: EngineArgs):
        """The model's tokenizer (None where it has none: token ids only), or ``--tokenizer``'s, which must
        exist and hold one."""
        from kvforge.tokenizer import load_tokenizer

        if not args.tokenizer:
            return load_tokenizer(self.model_path) if self.model_path else None
        path = Path(args.tokenizer)
        if not path.exists():
            raise ConfigError(f"--tokenizer {path} does not exist: give a directory holding tokenizer.json or a "
                              f".gguf file with an embedded tokenizer (or omit --tokenizer for the model's own)")
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise ConfigError(f"--tokenizer {path} holds no tokenizer (no tokenizer.json, no single .gguf file): "
                              f"give a directory holding tokenizer.json or a .gguf file (or omit --tokenizer for "
                              f"the model's own)")
        return tokenizer

    def _config_eos(self) -> list[int]:
        eos = self.spec.hf_config.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    # ---- requests -------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            check_prompt_dict(prompt)
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", field="prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; send at least one token", field="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer (skip_tokenizer_init, or the model has "
                                          "no tokenizer files): give one with --tokenizer, or send "
                                          "prompt_token_ids", field="prompt")
            ids = self.tokenizer.encode(prompt)
            if ids and max(ids) >= self.spec.vocab_size:
                raise InvalidRequestError(
                    f"the prompt's text encodes to token id {max(ids)}, outside the model's vocabulary of "
                    f"{self.spec.vocab_size} tokens: the tokenizer does not match the model; serve it with the "
                    f"model's own tokenizer (--tokenizer)", field="prompt")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, check_prompt_token_ids(prompt, self.spec.vocab_size)
        if getattr(prompt, "ndim", None) == 1 and callable(getattr(prompt, "tolist", None)):  # numpy / torch ids
            return None, check_prompt_token_ids(prompt.tolist(), self.spec.vocab_size)
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                  field="prompt")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue one request (one sequence: ``params.n`` is 1); ``priority`` orders it under
        ``--scheduling-policy priority`` (lower first) and must be 0 otherwise."""
        self._check_running()
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError(f"the engine runs one sequence per request, got n={params.n}: add one request "
                                      "per sample with params.sample_params(j), as LLM.generate does", field="n")
        vocab = self.spec.vocab_size
        for field, tokens in params.named_token_ids().items():
            if tokens and max(tokens) >= vocab:
                raise InvalidRequestError(f"token id {max(tokens)} in {field} is outside the vocabulary of {vocab} "
                                          f"tokens (ids 0 to {vocab - 1})", field=field)
        text, ids = self._tokenize(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len, params.max_tokens)
        if len(ids) >= self.max_model_len and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                f"truncate_prompt_tokens {params.truncate_prompt_tokens} leaves no room for output: the prompt keeps "
                f"{len(ids)} tokens and max-model-len is {self.max_model_len}; keep at most {self.max_model_len - 1} "
                f"(or -1: as many as leave room for max_tokens)", field="truncate_prompt_tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max-model-len is {self.max_model_len} (prompt + at least one "
                f"generated token must fit); shorten the prompt or raise --max-model-len", field="prompt")
        self._check_allowed_tokens(params)
        priority = plain_int(priority)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", field="priority")
        seq = Sequence(request_id, ids, params, prompt=text, priority=priority)
        if params.bad_words:
            seq.bad_word_ids = self._bad_word_ids(params)
        if params.structured_outputs is not None:
            seq.grammar = self._output_matcher(params.structured_outputs, ids)
            self._check_allowed_begin(params)
        self.scheduler.add(seq)

    def _check_allowed_tokens(self, params: SamplingParams) -> None:
        """Refuse an allowed set that ``min_tokens`` empties: until then the stop tokens are excluded
        (kvforge/engine/token_biases.py), and an allowed set of only those would leave nothing to sample."""
        if not params.allowed_token_ids or not params.min_tokens:
            return
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        if set(params.allowed_token_ids) <= stops:
            raise InvalidRequestError(
                f"allowed_token_ids {list(params.allowed_token_ids)} are all stop tokens (EOS or stop_token_ids), "
                f"which min_tokens {params.min_tokens} excludes until it is reached: no token could be sampled; "
                f"allow a token that does not stop the request, or drop min_tokens", field="allowed_token_ids")

    def _bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences (kvforge/engine/bad_words.py); refused without a tokenizer,
        and where the one-token words ban every allowed token (the stop tokens too while ``min_tokens``
        excludes them)."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words are encoded with the tokenizer, which this engine does not have "
                                      "(skip_tokenizer_init, or the model has no tokenizer files): drop "
                                      "--skip-tokenizer-init or give one with --tokenizer, or ban token ids with "
                                      "logit_bias -100", field="bad_words")
        word_ids = encode_bad_words(params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                    self.spec.vocab_size)
        excluded = always_banned(word_ids)
        if params.min_tokens:
            excluded |= set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        if params.allowed_token_ids and set(params.allowed_token_ids) <= excluded:
            raise InvalidRequestError(
                f"bad_words {list(params.bad_words)} ban every token of allowed_token_ids "
                f"{list(params.allowed_token_ids)}{' that min_tokens leaves' if params.min_tokens else ''}: no "
                f"token could be sampled; allow a token they do not ban, or drop one of the two", field="bad_words")
        return word_ids

    def _check_allowed_begin(self, params: SamplingParams) -> None:
        """Refuse an allowed set with no token the structured output may begin with: the grammar's mask would
        empty the row, whose sampling then keeps the grammar alone (kvforge/engine/sampler.py)."""
        allowed = params.allowed_token_ids
        if allowed and not self.grammar_backend().can_begin_with(params.structured_outputs, allowed):
            shown = list(allowed[:8]) + (["..."] if len(allowed) > 8 else [])
            raise InvalidRequestError(
                f"allowed_token_ids {shown} hold no token the structured output "
                f"({params.structured_outputs.kind}) can begin with: no output could follow both; allow the "
                f"tokens the constraint begins with, or drop one of them", field="allowed_token_ids")

    def _output_matcher(self, constraint, prompt_ids: list[int]):
        """The matcher that holds an output of ``prompt_ids`` to ``constraint``: a reasoning model's answer only
        (kvforge/structured/reasoning_gate.py); a forced gpt-oss call, reasoning and all
        (kvforge/structured/harmony_call.py)."""
        if constraint.kind == "harmony_call":
            if self.reasoning is None or not self.reasoning.parser.harmony:
                raise InvalidRequestError("structured_outputs.harmony_call holds a gpt-oss (harmony) output: start the "
                                          "engine with --reasoning-parser openai_gptoss",
                                          field="structured_outputs.harmony_call")
            from kvforge.structured.harmony_call import harmony_call_gate

            return harmony_call_gate(self.grammar_backend(), constraint, self.tokenizer, prompt_ids)
        matcher = self.grammar_backend().matcher(constraint)
        if self.reasoning is not None:  # the constraint holds the answer, not the reasoning
            from kvforge.structured.reasoning_gate import gate_for

            matcher = gate_for(matcher, self.reasoning, self.reasoning.opening_phase(prompt_ids))
        return matcher

    def grammar_backend(self):
        """The structured-output compiler for this model's vocabulary (kvforge/structured/backend.py), built
        once, by the first caller; InvalidRequestError where the engine has no tokenizer or xgrammar is
        missing. Any thread may call it (the server checks a request's constraint before queueing it)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs match text, and this engine has no tokenizer "
                                              "(started with --skip-tokenizer-init, or the model has none)",
                                              field="structured_outputs")
                from kvforge.structured.backend import GrammarBackend

                self._grammars = GrammarBackend(self.tokenizer, self.spec.vocab_size, self._eos_token_ids)
            return self._grammars

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._discard_proposer_state(request_id)
        if self.state_slots is not None:
            self.state_slots.release(request_id)

    @property
    def max_num_seqs(self) -> int:
        """Sequences one step may run (the scheduler's run slots)."""
        return self.scheduler.max_num_seqs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the KV blocks' hashes and the linear-attention state snapshots (vLLM's
        ``reset_prefix_cache``, so a benchmark can run without hits from an earlier run). False, with nothing
        forgotten, while a request is unfinished: its blocks are still in use."""
        self._check_running()
        if self.has_unfinished_requests():
            return False
        self.block_manager.reset_prefix_cache()
        if self.state_slots is not None:
            self.state_slots.drop_snapshots()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of the sequences that got a token: this step's
        (synchronous), or with ``async_scheduling`` the previous launch's (kvforge/engine/overlap.py)."""
        self._check_running()
        # A step that proposes starts its record here: the proposals delay its streams too.
        began = Stamp.now() if self.proposer is not None else None
        early = None
        probing = self.proposer is not None and self._proposals_due()
        if self._inflight is not None and (probing or self.scheduler.next_step_may_preempt()):
            # Memory pressure: resolve the step in flight first, so sequences it finishes free their
            # blocks before the next schedule (instead of a preemption that a finish would have avoided).
            # Proposals: the proposer reads every sequence's latest tokens.
            early, self._inflight = self._resolve(self._inflight), None
            if not probing:
                self.async_pressure_resolves += 1
        if self.proposer is not None:
            self._propose(probing)
        out = self.scheduler.schedule()
        self._forget_preempted(out.preempted)  # also where nothing is scheduled: a lone sequence preempted itself
        launched = None
        if not out.is_empty:
            if out.blocks_to_copy:
                self._copy_blocks(out.blocks_to_copy)
            launched = self._launch(out, self._inflight, began)
        if launched is not None and launched.verified is not None:
            # A verification step: the next step's positions depend on what it accepted, so it is resolved
            # now (its tokens are already on the host), after any step resolved early above. A request in
            # both gets one output, the later (outputs are cumulative): one step, one delta per stream.
            outputs = _latest_per_request((early or []) + self._resolve(launched))
        elif not self.async_scheduling:
            outputs = self._resolve(launched) if launched is not None else []
        else:
            if early is not None:
                outputs = early
            else:
                outputs = self._resolve(self._inflight) if self._inflight is not None else []
            self._inflight = launched
        if self.proposer is not None:  # blocks taken for proposals this step did not verify
            self.scheduler.trim_to_computed()
        return outputs

    def _feed_grammars_ahead(self, seqs: list[Sequence], prev: InflightStep) -> None:
        """Async scheduling: a structured-output request's mask for this step needs the token it has in flight
        from ``prev``. Called once this step's forward is launched, so the device keeps working while the
        host waits for ``prev``'s tokens; each such token goes to its request's matcher now and resolves
        later without being fed again (``Sequence.grammar_ahead``). A matcher already complete (its request
        ends when ``prev`` resolves) takes nothing; its row is dropped."""
        waiting = [seq for seq in seqs if seq.grammar is not None and seq.num_pending]
        if not waiting:
            return
        tokens = prev.wait_tokens()
        for seq in waiting:
            token = tokens[prev.row_of[seq.request_id]]
            accepted = not seq.grammar.is_terminated() and seq.grammar.accept_token(token)
            seq.grammar_ahead.append((token, accepted))
        self.grammar_tokens_fed_ahead += len(waiting)

    @staticmethod
    def _in_flight_for_bad_words(seqs: list[Sequence], prev: InflightStep) -> dict[str, int] | None:
        """Async scheduling: the values of the tokens in flight from ``prev`` that bad words of more than one
        token need to ban this step's tokens (kvforge/engine/bad_words.py), by request id; None where no
        sequence needs one. Called once this step's forward is launched, as the grammar feed is."""
        waiting = [seq for seq in seqs if seq.num_pending and longest_prefix(seq.bad_word_ids)]
        if not waiting:
            return None
        tokens = prev.wait_tokens()
        return {seq.request_id: tokens[prev.row_of[seq.request_id]] for seq in waiting}

    def _forget_preempted(self, preempted) -> None:
        """A preempted sequence recomputes from its prompt: its proposer state goes, and its state slot (ring
        and linear-attention models) returns to the pool, since its first chunk starts from a zero state."""
        for seq in preempted:
            self._discard_proposer_state(seq.request_id)
            if self.state_slots is not None:
                self.state_slots.release(seq.request_id)

    def _discard_proposer_state(self, request_id: str) -> None:
        """A finished, aborted or preempted request's proposer state (a draft model's KV) is freed with it."""
        if self.spec_backoff is not None:
            self.spec_backoff.forget(request_id)
        discard = getattr(self.proposer, "discard", None)
        if discard is not None:
            discard(request_id)

    def _proposals_due(self) -> bool:
        """Whether a running sequence past its prompt is due for proposals this step (kvforge/speculative/
        backoff.py; every step for proposers that do not back off)."""
        # A token in flight counts as the output it will be once resolved: a request whose first token is in
        # flight is due now, as a sample forked from a resolved first token is (n > 1), so both propose from
        # output token 1 on.
        due = self.spec_backoff.due if self.spec_backoff is not None else None
        return any((clock := seq.num_output_tokens + seq.num_pending) and (due is None or due(seq.request_id, clock))
                   for seq in self.scheduler.running)

    def _propose(self, probing: bool) -> None:
        """Give every decoding sequence (one token to compute, a generated one) that is due its proposals for
        the next step; the others verify none. A prompt whose chunks leave its last token for the next step
        gets none there: a request's first token always comes from a plain step (as vLLM proposes from a
        step's sampled token), so a seeded sample draws the same first token whatever cut its prompt."""
        backoff = self.spec_backoff
        self._unread = None
        decoding = []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.speculative is None and seq.num_output_tokens:
                seq.speculative = SpeculativeStats()
            if (probing and seq.num_output_tokens and seq.num_tokens - seq.num_computed_tokens == 1
                    and not seq.num_pending and (backoff is None or backoff.due(seq.request_id, seq.num_output_tokens))):
                decoding.append(seq)
        if not decoding:
            return
        if self._proposals_stay_on_device(decoding):
            self._unread = self.proposer.propose_on_device(decoding)
            proposals = [[UNREAD] * (self._unread.count(seq.request_id) if self._unread else 0) for seq in decoding]
        else:
            proposals = self.proposer.propose(decoding)
        for seq, proposal in zip(decoding, proposals):
            seq.spec_token_ids = proposal
            if not proposal and backoff is not None:
                backoff.record(seq.request_id, seq.num_output_tokens, 0, 0)

    def _proposals_stay_on_device(self, seqs: list[Sequence]) -> bool:
        """Whether this step's proposals stay on the device until verification (``READ_PROPOSALS_WITH_VERIFICATION``):
        a proposer that can, one rank, greedy sequences (sampled ones hand their ``q`` to verification)."""
        return (READ_PROPOSALS_WITH_VERIFICATION and self.tp is None and hasattr(self.proposer, "propose_on_device")
                and all(seq.params.is_greedy for seq in seqs))

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies before a step (all ranks)."""
        if self.tp is not None:
            self.runner.copy_blocks(pairs)  # here now, on the other ranks before the step
        else:
            self.pool.copy_blocks(pairs)
            self.runner.invalidate_block_tables()  # copy-on-write rewrote table entries in place
            if self.draft_runner is not None:
                self.draft_runner.invalidate_block_tables()

    def _launch(self, out, prev: InflightStep | None, began: Stamp | None = None) -> InflightStep:
        """Run ``out`` on the device without waiting for its tokens and advance the scheduler. A token
        still in flight from ``prev`` (async scheduling) is a placeholder gathered on the device from
        ``prev.token_ids``. ``began``: when the step's own host work began, where it precedes the launch
        (proposals); the step's record counts from there."""
        launched = began or Stamp.now()
        chunks, rows, sampled_seqs, offset = [], [], [], 0
        ph_rows, ph_src = [], []
        unread_rows, unread_ids, unread_counts = [], [], []  # proposals still on the device (self._unread)
        prompt_rows, prompt_targets, prompt_spans = [], [], []  # prompt logprobs (only requests asking)
        self.num_launches += 1
        # Per sampled sequence, when any sequence verifies proposals this step (speculative decoding), or every
        # step for a proposer that observes each step's tokens (the MTP layer).
        proposals = ([] if self.proposer is not None and (self._observes or any(s.spec_token_ids for s in out.scheduled))
                     else None)
        for s in out.scheduled:
            seq = s.seq
            num_spec = len(s.spec_token_ids)
            end = s.start_pos + s.num_new_tokens - num_spec  # proposals are not the sequence's tokens
            if seq.prompt_logprobs is not None and seq.needs_prompt_logprobs:
                # Position p's logits score prompt token p + 1, for p up to the second-to-last prompt token.
                stop = min(end, seq.num_prompt_tokens - 1)
                if stop > s.start_pos:
                    prompt_rows.extend(range(offset, offset + stop - s.start_pos))
                    prompt_targets.extend(seq.prompt_token_ids[s.start_pos + 1:stop + 1])
                    prompt_spans.append((seq, s.start_pos + 1, stop - s.start_pos))
            if end > seq.num_tokens:  # the last new token is the one sampled by the step in flight
                chunks.append((seq.token_ids_slice(s.start_pos, seq.num_tokens) + [0], s.start_pos, seq.block_tables))
                ph_rows.append(offset + s.num_new_tokens - 1)
                ph_src.append(prev.row_of[seq.request_id])
            else:
                chunks.append((s.token_ids, s.start_pos, seq.block_tables))
            if num_spec and self._unread is not None:  # their ids gathered on the device
                unread_rows.extend(range(offset + s.num_new_tokens - num_spec, offset + s.num_new_tokens))
                unread_ids.append(seq.request_id)
                unread_counts.append(num_spec)
            offset += s.num_new_tokens
            if s.do_sample:
                if num_spec:  # the last real token's row, then one row per proposal
                    rows.extend(range(offset - 1 - num_spec, offset))
                else:
                    rows.append(offset - 1)
                sampled_seqs.append(seq)
                if proposals is not None:
                    proposals.append(list(s.spec_token_ids))
            if s.start_pos < seq.num_prompt_tokens:
                self.prefill_tokens_computed += min(s.num_new_tokens, seq.num_prompt_tokens - s.start_pos)
        if self.state_slots is not None:  # ring and linear-attention models
            held = self.state_slots.held
            for s in out.scheduled:
                if s.seq.request_id not in held and s.start_pos and self.has_linear_state:
                    # A fresh slot holds no state of this sequence: only its first chunk may start in one.
                    raise RuntimeError(f"{s.seq.request_id} resumes at token {s.start_pos} without a state slot")
            slots = [self.state_slots.acquire(s.seq.request_id) for s in out.scheduled]
            if self.has_linear_state:
                self.runner.step_state_slots = slots
                if proposals is not None:  # verifying sequences keep their states until verification
                    self.runner.step_spec_lens = [len(s.spec_token_ids) for s in out.scheduled]
                if self.scheduler.state_prefix is not None:  # snapshots the step's chunks pass, taken inside it
                    self.runner.step_snapshots = self.scheduler.state_prefix.plan_snapshots(
                        (s.seq, s.start_pos, s.num_new_tokens) for s in out.scheduled)
            else:
                self.runner.step_ring_slots = slots
        placeholders = (ph_rows, ph_src, prev.token_ids) if ph_rows else None
        unread = None
        if unread_rows:
            unread = self._unread.tokens[values_to_device(self._unread.positions(unread_ids, unread_counts),
                                                        self.runner.device)]
            placeholders = _with_unread(placeholders, unread_rows, unread)
        self._unread = None
        share = self.async_scheduling
        scoring = None
        if prompt_rows:
            targets = values_to_device(prompt_targets, self.runner.device)
            scoring = PromptScoring(targets, max(seq.params.prompt_logprobs for seq, _, _ in prompt_spans),
                                    prompt_spans)
        logits = self.runner.run(chunks, rows + prompt_rows if prompt_rows else rows, placeholders=placeholders,
                                 share_sampled=len(rows) if share else 0, scoring=scoring)
        if self.scheduler.state_prefix is not None:  # after the step's layers, before any slot changes hands
            self.scheduler.state_prefix.take_snapshots((s.seq, s.start_pos, s.num_new_tokens) for s in out.scheduled)
        follow = getattr(self.proposer, "follow", None)
        if follow is not None:  # a draft model computes its layers' KV of the step's positions too
            follow(out.scheduled, prev)
        prompt_lp = scoring.result.to_host() if scoring is not None else None
        if proposals is not None:
            self.scheduler.advance(out)
            verified = self._verify(logits, sampled_seqs, proposals, unread)
            if self.has_linear_state:
                self._keep_verified_states(sampled_seqs, proposals, verified)
            observe = getattr(self.proposer, "observe", None)  # the MTP layer follows every target step
            if observe is not None:
                observe(out.scheduled, {seq.request_id: [token for token, _ in pairs]
                                        for seq, pairs in zip(sampled_seqs, verified)})
            return InflightStep(out, sampled_seqs, None, None, [], None, {}, prompt_lp, launched, verified=verified)
        if sampled_seqs:
            pending = None
            if ph_rows and any(seq.params.has_penalties for seq in sampled_seqs):
                pending = self._pending_tokens(sampled_seqs, prev)
            if ph_rows and self._grammars is not None:
                self._feed_grammars_ahead(sampled_seqs, prev)
            in_flight = self._in_flight_for_bad_words(sampled_seqs, prev) if ph_rows else None
            result = self.sampler.sample_sequences(logits, sampled_seqs, pending, defer_logprobs=True,
                                                   in_flight=in_flight)
            token_ids, logprobs = result.token_ids, result.logprobs
            if share:
                self.runner.share_sampled_tokens(token_ids)  # TP > 1: the workers' next placeholders
        else:
            token_ids, logprobs = torch.empty(0, dtype=torch.long, device=logits.device), []
        host_tokens, ready = copy_tokens_to_host(token_ids)
        self.scheduler.advance(out)
        return InflightStep(out, sampled_seqs, token_ids, host_tokens, logprobs, ready,
                            {seq.request_id: i for i, seq in enumerate(sampled_seqs)}, prompt_lp, launched)

    @staticmethod
    def _pending_tokens(seqs: list[Sequence], prev: InflightStep) -> torch.Tensor:
        """Per sampled sequence, the token it sampled in ``prev`` that is not on the host yet (on the device),
        or -1: the penalties count it as output."""
        src = [prev.row_of[seq.request_id] if seq.num_pending else -1 for seq in seqs]
        src_t = values_to_device(src, prev.token_ids.device)
        gathered = prev.token_ids[src_t.clamp(min=0)]
        return torch.where(src_t >= 0, gathered, torch.full_like(gathered, -1))

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], proposals: list[list[int]],
                unread: torch.Tensor | None = None) -> list[list]:
        """Verify a speculative step's proposals; per sequence, the [(token, logprobs)] to append. ``unread``:
        the values of every proposal, in order, on the device, where ``proposals`` holds placeholders; read
        with the target's argmax, or first where penalties, biases or a grammar need them."""
        from kvforge.speculative.verify import verify_proposals

        if not seqs:
            return []
        probs_of = getattr(self.proposer, "proposal_probs", None)
        probs = ([probs_of(seq, len(props)) if props else None for seq, props in zip(seqs, proposals)]
                 if probs_of is not None else None)
        raw = None
        row_params = [seq.params for seq, props in zip(seqs, proposals) for _ in range(len(props) + 1)]
        processed = any(p.has_penalties or p.logit_bias or p.allowed_token_ids or p.min_tokens or p.bad_words
                        for p in row_params)
        if unread is not None and (processed or any(seq.grammar is not None for seq in seqs)):
            flat = iter(unread.tolist())  # the histories and masks below read the proposals' values
            proposals, unread = [[next(flat) for _ in props] for props in proposals], None
        bitmask = proposal_bitmask([seq.grammar for seq in seqs], proposals, logits.shape[-1])
        if bitmask is not None or processed:
            # Row j of a sequence scores the token after its output and the first j proposals.
            histories = [(seq.prompt_token_ids, seq.output_token_ids + props[:j])
                         for seq, props in zip(seqs, proposals) for j in range(len(props) + 1)]
            generated = [seq.num_output_tokens + j for seq, props in zip(seqs, proposals) for j in range(len(props) + 1)]
            bans = [banned_next_tokens(seq.bad_word_ids, seq.output_token_ids + props[:j]) if seq.bad_word_ids else ()
                    for seq, props in zip(seqs, proposals) for j in range(len(props) + 1)]
            raw, logits = logits, self.sampler.processed_logits(logits.float(), row_params, histories,
                                                                num_generated=generated, token_bitmask=bitmask,
                                                                bad_word_bans=bans)
        result = verify_proposals(logits, [seq.params for seq in seqs],
                                  [seq.generator_for(logits.device) for seq in seqs], proposals, probs, raw, unread)
        for seq, props, accepted in zip(seqs, proposals, result.num_accepted):
            if props:
                if self.spec_backoff is not None:
                    self.spec_backoff.record(seq.request_id, seq.num_output_tokens, len(props), accepted)
                self.spec_counters.record(len(props), accepted)
                seq.speculative = (seq.speculative or SpeculativeStats()).plus(len(props), accepted)
            elif seq.speculative is None:
                seq.speculative = SpeculativeStats()
        return [list(zip(tokens, lps)) for tokens, lps in zip(result.tokens, result.logprobs)]

    def _keep_verified_states(self, seqs: list[Sequence], proposals: list[list[int]], verified: list[list]) -> None:
        """Linear-attention state of the sequences that verified proposals: their slots still hold the state
        before the step; they advance over the sequence's real token and the accepted proposals (one row per
        emitted token but the last, which is computed next step)."""
        held = self.state_slots.held
        pairs = [(held[seq.request_id], len(tokens)) for seq, props, tokens in zip(seqs, proposals, verified)
                 if props]
        if pairs:
            self.runner.keep_verified([slot for slot, _ in pairs], [n for _, n in pairs])

    def _resolve(self, step: InflightStep) -> list[RequestOutput]:
        if step.verified is not None:
            sampled = {seq.request_id: pairs for seq, pairs in zip(step.sampled_seqs, step.verified)}
        else:
            tokens = step.wait_tokens()
            logprobs = step.logprobs.resolve() if isinstance(step.logprobs, PendingLogprobs) else step.logprobs
            sampled = {seq.request_id: (tok, lp) for seq, tok, lp in zip(step.sampled_seqs, tokens, logprobs)}
        out = step.out
        self.step_log.add(step.launched, Stamp.now(), out.num_prefill_tokens, out.num_decode_tokens, out.num_seqs)
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.apply()  # before the outputs below are built
        live = [seq for seq in step.sampled_seqs if not seq.is_finished]
        before = sum(seq.num_output_tokens for seq in live) if step.verified is not None else 0
        finished = self.scheduler.resolve(step.out, sampled)
        if self.proposer is not None:
            for seq in finished:
                self._discard_proposer_state(seq.request_id)
        if self.state_slots is not None:
            for seq in finished:
                self.state_slots.release(seq.request_id)
        if step.verified is not None:  # a verified step appends 1 .. k + 1 tokens per sequence
            self.generation_tokens_total += sum(seq.num_output_tokens for seq in live) - before
        else:
            self.generation_tokens_total += len(live)
        self.num_steps += 1
        return [seq.to_request_output() for seq in live]

    def stats(self) -> dict:
        bm = self.block_manager
        out = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.scheduler.prompt_tokens_admitted,
            "generation_tokens_total": self.generation_tokens_total,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "num_steps": self.num_steps,
            "graph_steps": self.runner.num_graph_steps,
            "eager_steps": self.runner.num_eager_steps,
            "proposer_steps": ({"graph": self.draft_runner.num_graph_steps, "eager": self.draft_runner.num_eager_steps}
                               if self.draft_runner is not None else None),
            "async_scheduling": self.async_scheduling,
            "async_pressure_resolves": self.async_pressure_resolves,
            "spec_decode": self.spec_counters.as_dict() if self.spec_counters is not None else None,
            "state_snapshots": self.scheduler.state_prefix.counters() if self.scheduler.state_prefix else None,
        }
        return out

    def rank_counters(self) -> list[dict]:
        """Per-rank step counters (``num_graph_steps``, ``num_eager_steps``, ``graph_sizes``,
        ``graphs_off_reason``), rank 0 first; one entry at TP=1. Call between steps."""
        if self.tp is not None:
            return self.tp.rank_counters()
        return [self.runner.counters()]

    # ---- scoring (eval) -------------------------------------------------------
    def compute_prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced float32 logits [T, vocab] through the paged KV cache
        (so a quantized cache affects them), chunked like a prefill. Blocks are taken chunk by chunk, and
        a sliding-window group frees what leaves its window between chunks, as for a request."""
        self._check_running()
        _, ids = self._tokenize(list(token_ids))
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"{len(ids)} tokens exceed max-model-len {self.max_model_len}", field="prompt")
        seq = Sequence(f"__score_{id(ids)}", ids, SamplingParams(max_tokens=1))
        chunk = self.scheduler.max_num_batched_tokens
        if not self.block_manager.allocate(seq, min(chunk, len(ids)), cached_blocks=[]):
            raise InvalidRequestError("not enough free KV blocks to score this text now", field="prompt")
        slots = self.state_slots if self.has_linear_state else None
        if slots is not None and not slots.num_free:
            self.block_manager.free(seq)
            raise InvalidRequestError("no free state slot to score this text now (every slot holds a running "
                                      "sequence)", field="prompt")
        try:
            parts = []
            for start in range(0, len(ids), chunk):
                piece = ids[start:start + chunk]
                seq.num_computed_tokens = start
                if start and not self.block_manager.append_slots(seq, len(piece)):
                    raise InvalidRequestError("not enough free KV blocks to score this text now", field="prompt")
                if slots is not None:
                    self.runner.step_state_slots = [slots.acquire(seq.request_id)]
                parts.append(self.runner.run([(piece, start, seq.block_tables)], None))
            return torch.cat(parts)
        finally:
            self.block_manager.free(seq)
            if slots is not None:
                slots.release(seq.request_id)


def _latest_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The last output of each request, in the order requests first appear (outputs are cumulative, so the
    last holds every token of the earlier ones)."""
    latest: dict[str, RequestOutput] = {}
    for out in outputs:
        latest[out.request_id] = out
    return list(latest.values())
