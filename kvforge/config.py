"""EngineArgs: every engine option in one frozen dataclass, with vLLM's flag names.

``EngineArgs.add_cli_args(parser)`` adds the flags; ``from_cli_args(ns)``
builds the dataclass. Validation of anything the planner decides happens in
the planner (before weights load); the rest is validated here.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass, fields

from kvforge.attention.routing.mla import ABSORBED_PREFILL_MAX_SEQ_LEN, PREFILL_MODES
from kvforge.byte_sizes import byte_count, parse_token_count
from kvforge.cli_args import (
    add_model_arguments,
    add_plan_args,
    model_argument,
    non_negative_int,
    positive_int,
    token_count,
)
from kvforge.cli_vllm_flags import ENGINE_FLAGS, add_vllm_flags
from kvforge.engine.generation_defaults import check_setting as check_generation_setting
from kvforge.engine.sampling_params import plain_int
from kvforge.engine.scheduling_policy import SCHEDULING_POLICIES
from kvforge.errors import ConfigError
from kvforge.planner.inputs import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    model_len_setting,
    resolve_max_num_seqs,
)
from kvforge.reasoning import REASONING_PARSERS
from kvforge.speculative.config import SpeculativeConfig, resolve_speculative

logger = logging.getLogger("kvforge.config")

# Tokens one step may compute when --max-num-batched-tokens is not given, by platform.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
#: ``--chat-template-content-format``: auto reads the template (kvforge/chat_content_format.py).
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")
# Prefill tokens a step may hold next to decodes (docs/SCHEDULER.md explains the choice).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 4096
# Tokens between the state snapshots a prompt's prefill keeps for prefix caching in linear-attention models
# (kvforge/engine/state_prefix.py).
DEFAULT_STATE_SNAPSHOT_INTERVAL = 2048


#: Integer settings (None where allowed): numpy integers and digit strings are taken as the ints they hold.
_COUNT_FIELDS = ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "long_prefill_token_threshold", "num_speculative_tokens", "state_snapshot_interval")
#: Count fields that are token counts: vLLM's human-readable text ('128K', '25.6k') is taken as on the CLI.
_TOKEN_COUNT_FIELDS = ("max_num_batched_tokens",)


def _check_choice(flag: str, value, choices) -> None:
    """ConfigError naming ``flag`` and its ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class EngineArgs:
    """Engine options. ``model=None`` means the embedded SmolLM2-135M-Instruct GGUF.

    ``device``: "auto" (cuda when available, else cpu), "cpu" or "cuda".
    ``dtype``: "auto" = float32 on CPU (fast and exact there), the config's
    dtype (bf16 usually) on CUDA. ``kv_cache_memory``: KV bytes per rank; on
    CPU it defaults to 1 GiB, on CUDA to device memory x utilization - weights - the activations of one step (kvforge/planner/activations.py).
    ``long_prefill_token_threshold``: with chunked prefill, the most prefill
    tokens a step that also carries decode tokens may hold (None: the
    default, 0: up to the whole ``max_num_batched_tokens``).
    ``kv_scale_multiplier`` multiplies every fp8 KV scale: a diagnostic for
    showing that a wrong scale is detected (eval kld), not a tuning knob.
    ``mla_prefill_mode``: how MLA layers on CUDA attend steps with a prefill
    chunk: auto, absorbed, sdpa or expanded
    (:data:`kvforge.attention.routing.mla.PREFILL_MODES`).
    ``max_num_seqs`` and ``max_num_batched_tokens``: a step gives each running sequence at least one
    token, so the token budget must hold ``max_num_seqs`` tokens. Both given and the budget smaller: a
    ConfigError naming both. Only the budget given: ``max_num_seqs`` (None) is the default 256 capped at
    the budget (logged). Only ``max_num_seqs`` given: the budget is the platform default raised to it
    (:meth:`step_token_budget`). After construction ``max_num_seqs`` is an int.
    ``speculative_config``: how to speculate (kvforge/speculative/config.py, docs/SPECULATIVE.md).
    ``trust_remote_code`` (vLLM's flag) is accepted and changes nothing: kvforge runs its own model code
    for the architectures it knows and never imports code shipped with a checkpoint.
    ``distributed_timeout_s``: with ``tensor_parallel_size`` > 1, the longest
    any collective (and worker startup) may wait before the engine fails with
    a clear error instead of hanging.
    """

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()
    # how message text reaches the chat template: string, openai (a list of text parts), or auto (read from it)
    chat_template_content_format: str = "auto"
    chat_template: str | None = None  # a jinja template, or a file holding one, in place of the tokenizer's
    #: ``--reasoning-parser``: the think-block format of a reasoning model (kvforge/reasoning.py), None for none.
    reasoning_parser: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    seed: int | None = 0  # None: one drawn from the OS at construction, so every TP rank gets the same
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    #: None: the model's context length; "auto" (or -1): the longest that fits the KV memory, planned before
    #: any weight loads (kvforge/planner/fitted_len.py).
    max_model_len: int | str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    gpu_memory: int | None = None
    kv_cache_memory: int | None = None
    num_speculative_tokens: int = 0
    max_num_seqs: int | None = None  # None: DEFAULT_MAX_NUM_SEQS, capped at max_num_batched_tokens
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None  # None: DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD; 0: off
    enable_prefix_caching: bool = True
    #: ``--state-snapshot-interval``: linear-attention models' prefix caching also keeps a prompt's state every
    #: this many tokens (rounded up to whole blocks; None: DEFAULT_STATE_SNAPSHOT_INTERVAL; 0: off).
    state_snapshot_interval: int | None = None
    #: ``--scheduling-policy``: fcfs, or priority (each request's priority, lower first; kvforge/engine/scheduler.py).
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    #: ``--cuda-graph-sizes``: the decode batch sizes captured as CUDA graphs (None: 1, 2, 4, multiples of
    #: 8 up to 256 and of 16 beyond below ``max_num_seqs``, and ``max_num_seqs``); stored sorted, without
    #: repeats.
    cuda_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool | None = None  # None: on for CUDA at TP=1 (not ring models), off otherwise
    #: ``--warm-up``: run a few synthetic requests at startup so no kernel compiles inside a user's request
    #: (kvforge/engine/warm_up.py). None: on for CUDA at TP=1 without --calculate-kv-scales, off otherwise.
    warm_up: bool | None = None
    skip_tokenizer_init: bool = False
    kv_scale_scheme: str = "per_tensor"
    calculate_kv_scales: bool = False
    query_dtype: str = "auto"
    state_dtype: str = "auto"
    mla_prefill_mode: str = "auto"
    kv_scale_multiplier: float = 1.0
    progress: bool = True
    trust_remote_code: bool = False
    distributed_timeout_s: float = 300.0
    #: ``--generation-config`` (vLLM's): where requests' default sampling parameters come from: ``auto`` (the
    #: model's generation_config.json), ``vllm`` (none) or a directory (kvforge/engine/generation_defaults.py).
    generation_config: str = "auto"
    #: ``--speculative-config``: a SpeculativeConfig, its dict or JSON text; stored as a SpeculativeConfig
    #: (or None). ``num_speculative_tokens`` alone means ngram with that count; either way both fields agree.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.max_model_len is not None:  # a token count as the CLI reads it, or "auto" / -1
            object.__setattr__(self, "max_model_len", model_len_setting("--max-model-len", plain_int(self.max_model_len)))
        for name in _COUNT_FIELDS:  # numpy integers and digit strings as the ints they hold
            value = plain_int(getattr(self, name))
            object.__setattr__(self, name, value)
            if isinstance(value, str) and name in _TOKEN_COUNT_FIELDS:  # '128K', '8k' as the CLI reads them
                try:
                    object.__setattr__(self, name, parse_token_count(value))
                except ValueError as e:
                    raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None
            elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
                object.__setattr__(self, name, int(value))
            elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                least = 0 if name in ("long_prefill_token_threshold", "num_speculative_tokens",
                                      "state_snapshot_interval") else 1
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {least}, got {value!r}")
        for name in ("kv_cache_memory", "gpu_memory"):  # byte counts, or sizes such as "8GiB"
            if getattr(self, name) is not None:
                object.__setattr__(self, name, byte_count(f"--{name.replace('_', '-')}", getattr(self, name)))
        if self.warm_up and self.calculate_kv_scales:
            raise ConfigError("--warm-up with --calculate-kv-scales: the warm-up's synthetic prompts would set the "
                              "KV scales; drop one of them")
        speculative = resolve_speculative(self.speculative_config, self.num_speculative_tokens)
        object.__setattr__(self, "speculative_config", speculative)
        object.__setattr__(self, "num_speculative_tokens", speculative.num_speculative_tokens if speculative else 0)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.seed is None:  # vLLM's unseeded engine: a fresh seed, fixed from here on (dummy weights, TP ranks)
            object.__setattr__(self, "seed", random.SystemRandom().randrange(2**63))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"--seed must be an integer (it seeds dummy weights and torch's generator) or None "
                              f"(a fresh one), got {self.seed!r}; pass an int such as 0, the default")
        _check_choice("--chat-template-content-format", self.chat_template_content_format, CHAT_CONTENT_FORMATS)
        _check_choice("--scheduling-policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.reasoning_parser is not None:
            _check_choice("--reasoning-parser", self.reasoning_parser, sorted(REASONING_PARSERS))
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(f"--load-format must be auto, safetensors, gguf or dummy, got {self.load_format!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        object.__setattr__(self, "max_num_seqs", self._resolve_max_num_seqs())
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", self._check_graph_sizes(self.cuda_graph_sizes))
        if self.state_snapshot_interval is not None and self.state_snapshot_interval < 0:
            raise ConfigError(f"--state-snapshot-interval must be >= 0 (0: off), got {self.state_snapshot_interval}")
        if self.long_prefill_token_threshold is not None:
            if self.long_prefill_token_threshold < 0:
                raise ConfigError(f"--long-prefill-token-threshold must be >= 0 (0: off), got "
                                  f"{self.long_prefill_token_threshold}")
            if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
                raise ConfigError("--long-prefill-token-threshold splits prompts into chunks and needs chunked "
                                  "prefill: drop --no-enable-chunked-prefill or the threshold")
        if not self.distributed_timeout_s > 0:
            raise ConfigError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if not self.kv_scale_multiplier > 0:
            raise ConfigError(f"--kv-scale-multiplier must be > 0, got {self.kv_scale_multiplier}")
        check_generation_setting(self.generation_config)
        if self.mla_prefill_mode not in PREFILL_MODES:
            raise ConfigError(f"--mla-prefill-mode must be one of {', '.join(PREFILL_MODES)}, "
                              f"got {self.mla_prefill_mode!r}")

    def settings_without_effect(self, platform: str, has_mla: bool) -> list[str]:
        """A warning for each setting given that changes nothing for this engine: CUDA-graph sizes on CPU or
        under --enforce-eager, and an MLA prefill mode where no layer runs the CUDA MLA kernels (on CPU, or
        in a model without MLA layers)."""
        notes = []
        if self.cuda_graph_sizes is not None and (platform != "cuda" or self.enforce_eager):
            why = "the CPU engine runs eagerly" if platform != "cuda" else "--enforce-eager captures no graphs"
            notes.append(f"--cuda-graph-sizes has no effect: {why}")
        if self.mla_prefill_mode != "auto" and (platform != "cuda" or not has_mla):
            why = ("the model has no MLA layers" if not has_mla
                   else "MLA layers on CPU run the reference path, which has one way to prefill")
            notes.append(f"--mla-prefill-mode {self.mla_prefill_mode} has no effect: {why}")
        return notes

    def graph_sizes(self) -> list[int] | None:
        """The decode batch sizes to capture (``--cuda-graph-sizes``), None for the runner's default."""
        return list(self.cuda_graph_sizes) if self.cuda_graph_sizes is not None else None

    def _check_graph_sizes(self, sizes) -> tuple[int, ...]:
        values = sorted(set(sizes)) if isinstance(sizes, (list, tuple)) else None
        if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
            raise ConfigError(f"--cuda-graph-sizes wants one or more positive batch sizes, got {sizes!r}")
        if values[-1] > self.max_num_seqs:
            raise ConfigError(f"--cuda-graph-sizes {values[-1]} exceeds --max-num-seqs {self.max_num_seqs}: no "
                              f"decode step runs more sequences; drop it or raise --max-num-seqs")
        return tuple(values)

    def _resolve_max_num_seqs(self) -> int:
        seqs = resolve_max_num_seqs(self.max_num_seqs, self.max_num_batched_tokens)
        if self.max_num_seqs is None and seqs != DEFAULT_MAX_NUM_SEQS:
            logger.info("--max-num-batched-tokens %d is below the default --max-num-seqs %d: a step runs at "
                        "most %d sequences (set --max-num-seqs to choose)", seqs, DEFAULT_MAX_NUM_SEQS, seqs)
        return seqs

    def step_token_budget(self, platform: str) -> int:
        """Tokens one step may compute on ``platform`` ("cpu" or "cuda"): ``max_num_batched_tokens`` when
        given, else the platform's default raised to ``max_num_seqs``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS.get(platform, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"]),
                   self.max_num_seqs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
        if model_positional:
            add_model_arguments(parser, "HF dir / .gguf / preset (dummy weights) (default: embedded SmolLM2)")
        add_plan_args(parser)
        add_vllm_flags(parser, ENGINE_FLAGS, "engine")
        parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        parser.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], default="auto")
        parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
        parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                            help="the model name(s) requests may use (vLLM's flag): the server answers to each and "
                                 "reports the first (default: the model argument)")
        parser.add_argument("--chat-template", default=None,
                            help="a jinja chat template, or a file holding one, used instead of the tokenizer's "
                                 "(vLLM's flag)")
        parser.add_argument("--chat-template-content-format", choices=list(CHAT_CONTENT_FORMATS), default="auto",
                            help="how message text reaches the chat template (vLLM's flag): string (a string, text "
                                 "parts joined by newlines), openai (a list of one text part, for templates that "
                                 "loop over content parts), auto (openai when the template loops over a "
                                 "message's content, else string)")
        parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                            help="the think-block format of a reasoning model (vLLM's flag): chat responses carry "
                                 "the reasoning apart from the answer, and structured outputs hold the answer only")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--generation-config", default="auto",
                            help="default sampling parameters of requests that do not set them (vLLM's flag): auto "
                                 "(the model's generation_config.json: temperature, top_p, top_k, min_p, "
                                 "repetition_penalty, max_new_tokens), vllm (none) or a directory holding one")
        parser.add_argument("--max-num-batched-tokens", type=token_count, default=None,
                            help="tokens one step may compute, at least --max-num-seqs (default 8192 on CUDA, 2048 "
                                 "on CPU, raised to --max-num-seqs)")
        parser.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=None,
                            help="prefill tokens a step may hold while requests are decoding, so a running "
                                 "stream waits behind at most this much prefill (default "
                                 f"{DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD}; 0: the whole --max-num-batched-tokens)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV blocks of prompt prefixes already computed (default on)")
        parser.add_argument("--state-snapshot-interval", type=non_negative_int, default=None, metavar="TOKENS",
                            help="linear-attention models: besides a prompt's last block and the points where "
                                 "cached requests branch, prefix caching keeps the prompt's state every this many "
                                 "tokens (whole blocks), so a request sharing only part of an earlier prompt resumes "
                                 "near where they part; each snapshot holds a state slot no running request needs "
                                 f"(default {DEFAULT_STATE_SNAPSHOT_INTERVAL}; 0: off)")
        parser.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default="fcfs",
                            help="which request is served first (vLLM's flag): fcfs (arrival order), or priority "
                                 "(each request's priority, lower first; the least urgent running request is the "
                                 "one preempted)")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                            help="split long prompts over steps within --max-num-batched-tokens (default on)")
        parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        parser.add_argument("--cuda-graph-sizes", type=positive_int, nargs="+", default=None, metavar="N",
                            help="decode batch sizes to capture as CUDA graphs, each at most --max-num-seqs "
                                 "(default: 1, 2, 4, ... below --max-num-seqs, and --max-num-seqs); a decode "
                                 "step runs the smallest captured size that holds its batch, padded, and a "
                                 "larger batch runs eagerly")
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                            help="overlap the host's scheduling and output work with the GPU's step (one step "
                                 "in flight). Default: on for CUDA at TP=1, off on CPU and at TP>1 (where it can be turned on)")
        parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                            help="run a few synthetic requests at startup so no kernel compiles inside a "
                                 "request (docs/GPU_ENGINE.md). Default: on for CUDA at TP=1 without "
                                 "--calculate-kv-scales, off otherwise (at TP>1 it can be turned on)")
        parser.add_argument("--skip-tokenizer-init", action="store_true")
        parser.add_argument("--mla-prefill-mode", choices=list(PREFILL_MODES), default="auto",
                            help="how MLA (DeepSeek) layers on CUDA attend steps with a prefill chunk: auto "
                                 "(a prefilling sequence absorbed up to "
                                 f"{ABSORBED_PREFILL_MAX_SEQ_LEN} tokens, else sdpa), absorbed (every query "
                                 "token through the decode kernels), sdpa (latents expanded for torch's fused "
                                 "attention) or expanded (the float32 reference)")
        parser.add_argument("--kv-scale-multiplier", type=float, default=1.0,
                            help="diagnostic: multiply every fp8 KV scale (e.g. 100 to show a broken scale)")
        parser.add_argument("--no-progress", dest="progress", action="store_false")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        if "model" in values:
            values["model"] = model_argument(ns)
        served = values.get("served_model_name")
        if isinstance(served, list):  # --served-model-name NAME [NAME ...]: the first is reported
            values["served_model_name"], values["served_model_aliases"] = served[0], tuple(served[1:])
        return cls(**values)
