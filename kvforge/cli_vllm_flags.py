"""vLLM launch flags kvforge does not implement, declared so that a vLLM launch line gets a precise answer
instead of argparse's "unrecognized arguments": flags that only change logging or another engine's
internals are accepted and change nothing (said in their help), flags that would change what is served
are refused at parse time, before any weight is read, with the reason and what to do instead; a refused
flag given its neutral value (``--pipeline-parallel-size 1``) is accepted.

The same table answers vLLM's keyword arguments to ``LLM(...)`` (:func:`engine_keyword_args`): ``swap_space=4``
is dropped, ``quantization="awq"`` refused with the flag's reason, ``quantization=None`` dropped.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class VllmFlag:
    """A vLLM flag: ``names``; ``takes_value`` (else a switch); ``neutral``: the values accepted as
    changing nothing (None: any value, the flag has no effect here); ``why``: the help, or the refusal;
    ``also_neutral``: a test of other values that change nothing (a JSON value's fields, say)."""

    names: tuple[str, ...]
    takes_value: bool
    neutral: tuple[str, ...] | None
    why: str
    also_neutral: Callable[[object], bool] | None = None
    optional_value: bool = False  # the value may be left out (``--hf-token`` alone, as vLLM takes it)

    def is_neutral(self, value) -> bool:
        """Whether ``value`` changes nothing here (numbers compared as numbers: ``0.0`` is ``0``)."""
        if self.neutral is None or str(value) in self.neutral or any(_same_number(value, n) for n in self.neutral):
            return True
        return self.also_neutral is not None and self.also_neutral(value)


def _same_number(value, neutral: str) -> bool:
    try:
        return float(value) == float(neutral)
    except (TypeError, ValueError):
        return False


def _neutral_structured_outputs_config(value) -> bool:
    """vLLM's ``--structured-outputs-config``: neutral when it names xgrammar (or auto) as the backend, and sets
    nothing else that changes an output (``disable_fallback`` has nothing to fall back to here)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    if not isinstance(value, dict):
        return False
    neutral = {"backend": ("auto", "xgrammar"), "disable_fallback": (True, False),
               "disable_any_whitespace": (False,), "disable_additional_properties": (False,),
               "reasoning_parser": ("", None), "enable_in_reasoning": (False,)}
    return all(key in neutral and item in neutral[key] for key, item in value.items())


ENGINE_FLAGS = (
    VllmFlag(("--quantization", "-q"), True, (), "kvforge loads unquantized safetensors (bf16, fp16, fp32) and GGUF "
             "files (dequantized at load); give such a checkpoint and leave --quantization unset"),
    VllmFlag(("--pipeline-parallel-size", "-pp"), True, ("1",), "pipeline parallelism is not implemented; use "
             "--tensor-parallel-size"),
    VllmFlag(("--data-parallel-size", "-dp"), True, ("1",), "data parallelism is not implemented; run one server "
             "per replica"),
    VllmFlag(("--max-logprobs",), True, ("20",), "the logprobs limit is fixed at vLLM's default, 20"),
    VllmFlag(("--download-dir",), True, (), "kvforge never downloads weights: give a local checkpoint directory or "
             ".gguf file"),
    VllmFlag(("--enable-lora",), False, (), "LoRA adapters are not supported: merge the adapter into the weights"),
    VllmFlag(("--swap-space",), True, None, "accepted, no effect: preempted sequences are recomputed, never swapped"),
    VllmFlag(("--tokenizer-mode",), True, ("auto", "hf"), "kvforge reads the model's own tokenizer (tokenizer.json "
             "or the GGUF's); leave --tokenizer-mode at auto or hf"),
    VllmFlag(("--max-seq-len-to-capture",), True, None, "accepted, no effect: decode CUDA graphs are captured per "
             "context bucket up to --max-model-len"),
    VllmFlag(("--disable-custom-all-reduce",), False, None, "accepted, no effect: tensor-parallel reductions are "
             "NCCL's"),
    VllmFlag(("--compilation-config", "-O"), True, None, "accepted, no effect: kvforge runs its own kernels and "
             "CUDA graphs, not torch.compile"),
    VllmFlag(("--revision", "--code-revision", "--tokenizer-revision"), True, (), "kvforge reads a local checkpoint "
             "directory or .gguf file: check out the revision there and give its path"),
    VllmFlag(("--disable-sliding-window",), False, (), "sliding-window layers attend over their window (the plan "
             "sizes their KV for it); leave it unset"),
    VllmFlag(("--override-generation-config",), True, (), "the sampling defaults come from --generation-config "
             "(auto, vllm or a directory); send other values with each request"),
    VllmFlag(("--guided-decoding-backend",), True, ("auto", "xgrammar"), "structured outputs run on xgrammar; "
             "leave --guided-decoding-backend at auto or xgrammar"),
    VllmFlag(("--structured-outputs-config",), True, (), "structured outputs run on xgrammar: the config may name "
             "backend auto or xgrammar and disable_fallback (no effect); send disable_any_whitespace and "
             "disable_additional_properties with each request's structured_outputs",
             also_neutral=_neutral_structured_outputs_config),
    VllmFlag(("--limit-mm-per-prompt",), True, None, "accepted, no effect: text only (requests with images are "
             "refused)"),
    VllmFlag(("--config",), True, (), "a YAML file of flags is not read: give the flags on the command line"),
    VllmFlag(("--hf-overrides",), True, (), "the checkpoint's config.json is read as it is: edit a copy of the "
             "checkpoint directory's config.json"),
    VllmFlag(("--rope-scaling",), True, (), "rope scaling comes from the checkpoint's config.json: edit a copy of "
             "it"),
    VllmFlag(("--hf-token",), True, None, "accepted, no effect: kvforge never downloads", optional_value=True),
    VllmFlag(("--distributed-executor-backend",), True, ("mp",), "tensor-parallel ranks are processes kvforge "
             "starts itself (torch.distributed); leave it at mp"),
    VllmFlag(("--cpu-offload-gb", "--kv-offloading-size"), True, ("0",), "weights and KV stay on the GPU: lower "
             "--max-model-len or use more GPUs"),
    VllmFlag(("--num-gpu-blocks-override",), True, (), "the plan sizes the KV cache: give its bytes with "
             "--kv-cache-memory"),
    VllmFlag(("--max-num-partial-prefills",), True, ("1",), "one bounded prefill chunk rides beside the decodes of "
             "a step (--long-prefill-token-threshold)"),
    VllmFlag(("--enable-expert-parallel",), False, (), "experts are split by tensor parallelism, not expert "
             "parallelism"),
    VllmFlag(("--kv-transfer-config", "--kv-events-config"), True, (), "KV transfer between instances and KV "
             "events are not implemented"),
    VllmFlag(("--enable-sleep-mode",), False, (), "sleep mode is not implemented: stop and start the server"),
    VllmFlag(("--enable-prompt-embeds",), False, (), "prompts are text or token ids, not embeddings"),
    VllmFlag(("--logits-processors",), True, (), "custom logits processors are not loaded: send logit_bias, "
             "allowed_token_ids or a structured output with the request"),
    VllmFlag(("--model-impl",), True, ("auto", "vllm"), "kvforge runs its own model code"),
    VllmFlag(("--logprobs-mode",), True, ("raw_logprobs",), "logprobs are those of the raw logits (vLLM's "
             "default)"),
    VllmFlag(("--tokenizer-pool-size", "--max-parallel-loading-workers", "--pt-load-map-location",
              "--safetensors-load-strategy"), True, None, "accepted, no effect on how kvforge loads"),
    VllmFlag(("--max-cudagraph-capture-size",), True, (), "give the decode batch sizes to capture with "
             "--cuda-graph-sizes"),
    VllmFlag(("--mm-processor-kwargs", "--allowed-local-media-path"), True, (), "text only: multimodal inputs are "
             "not served"),
    VllmFlag(("--lora-modules",), True, (), "LoRA adapters are not supported: merge the adapter into the weights "
             "and serve it as its own model"),
    VllmFlag(("--mamba-cache-dtype", "--mamba-ssm-cache-dtype"), True, (), "the linear-attention state's dtype is "
             "--state-dtype: float32 (its auto) or model (the model dtype, vLLM's auto)"),
    VllmFlag(("--task", "--runner"), True, ("auto", "generate"), "kvforge serves text generation"),
    VllmFlag(("--enable-reasoning",), False, None, "accepted, no effect: the reasoning is split out where "
             "--reasoning-parser names the parser"),
    VllmFlag(("--num-scheduler-steps",), True, ("1",), "one decode step a schedule; --async-scheduling overlaps "
             "the host's scheduling with the device's step"),
    VllmFlag(("--preemption-mode",), True, ("recompute",), "preempted sequences are recomputed, never swapped"),
    VllmFlag(("--use-v2-block-manager",), False, None, "accepted, no effect (one block manager)"),
    VllmFlag(("--worker-cls",), True, ("auto",), "kvforge starts its own workers"),
    VllmFlag(("--kv-sharing-fast-prefill",), False, (), "KV sharing across layers is not implemented"),
)
SERVER_FLAGS = (
    VllmFlag(("--disable-log-requests",), False, None, "accepted, no effect: requests are logged only with "
             "--enable-log-requests"),
    VllmFlag(("--disable-log-stats",), False, None, "accepted, no effect: no periodic stats are logged (see "
             "/metrics)"),
    VllmFlag(("--uvicorn-log-level",), True, None, "accepted, no effect (the server is aiohttp)"),
    VllmFlag(("--disable-frontend-multiprocessing",), False, None, "accepted, no effect (one process serves)"),
    VllmFlag(("--response-role",), True, ("assistant",), "chat responses speak as the assistant"),
    VllmFlag(("--enable-force-include-usage",), False, (), "usage goes out when a request asks for it "
             "(stream_options.include_usage)"),
    VllmFlag(("--root-path",), True, (), "routes are served at the root: strip a proxy's prefix in the proxy"),
    VllmFlag(("--ssl-keyfile", "--ssl-certfile"), True, (), "TLS is not served: put a TLS-terminating proxy in "
             "front"),
    VllmFlag(("--disable-uvicorn-access-log", "--disable-fastapi-docs", "--enable-server-load-tracking"), False,
             None, "accepted, no effect (the server is aiohttp; its load is in /metrics)"),
    VllmFlag(("--collect-detailed-traces",), True, None, "accepted, no effect (no traces are sent: see "
             "/metrics and /debug/steps)"),
    VllmFlag(("--log-config-file",), True, None, "accepted, no effect on kvforge's log lines"),
    VllmFlag(("--api-server-count", "-asc"), True, ("1",), "one process serves HTTP"),
    VllmFlag(("--headless",), False, (), "the engine runs in the server's process: start kvforge serve without it"),
    VllmFlag(("--uds",), True, (), "the server listens on TCP: give --host and --port"),
    VllmFlag(("--middleware",), True, (), "ASGI middleware is not loaded (the server is aiohttp): put a proxy in "
             "front"),
    VllmFlag(("--otlp-traces-endpoint",), True, (), "OpenTelemetry traces are not sent: use /metrics and "
             "/debug/steps"),
    VllmFlag(("--tool-parser-plugin", "--reasoning-parser-plugin"), True, (), "parser plugins are not loaded: "
             "choose a built-in --tool-call-parser or --reasoning-parser"),
)


class _VllmFlagAction(argparse.Action):
    def __init__(self, option_strings, dest, flag: VllmFlag, **kwargs):
        self.flag = flag
        nargs = ("?" if flag.optional_value else None) if flag.takes_value else 0
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS,
                         help=(f"(vLLM's flag) {flag.why}" if flag.neutral is None else
                               f"(vLLM's flag, not supported) {flag.why}"), **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.flag.neutral is None or (self.flag.takes_value and self.flag.is_neutral(values)):
            return
        given = f"{option_string} {values}" if self.flag.takes_value else option_string
        # the long spelling given, where one flag has several (a short one is named by its long form)
        flag = option_string if option_string and option_string.startswith("--") else self.option_strings[0]
        neutral = (f"; {flag} accepts only {' or '.join(self.flag.neutral)}, which changes nothing"
                   if self.flag.neutral else "")
        # the reason alone, without argparse's usage block (a hundred lines of flags that hide it)
        parser.exit(2, f"{parser.prog}: error: {given}: {self.flag.why}{neutral}\n")


def add_vllm_flags(parser: argparse.ArgumentParser, flags: tuple[VllmFlag, ...], kind: str) -> None:
    """Declare ``flags`` on ``parser`` (module docstring) in two help groups, those accepted without effect and
    those refused; ``kind`` ("engine", "server") names them. They never reach the parsed namespace."""
    accepted = parser.add_argument_group(f"vLLM {kind} flags accepted without effect")
    refused = parser.add_argument_group(f"vLLM {kind} flags refused (or accepted only at their neutral value)")
    for flag in flags:
        group = accepted if flag.neutral is None else refused
        group.add_argument(*flag.names, action=_VllmFlagAction, flag=flag, metavar="VALUE" if flag.takes_value else None,
                           dest=f"vllm_{flag.names[0].lstrip('-').replace('-', '_')}")


#: vLLM's keyword names of engine fields that kvforge calls otherwise.
KEYWORD_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}


def engine_keyword_args(kwargs: dict, fields: set[str]) -> dict:
    """``LLM(**kwargs)`` as a vLLM user writes it, as EngineArgs fields (``fields``): aliases renamed, vLLM's
    flags of :data:`ENGINE_FLAGS` / :data:`SERVER_FLAGS` dropped where they change nothing here (any value
    for a flag without effect; None, False, an empty collection or a neutral value for a refused one) and
    refused otherwise;
    an unknown keyword is a ConfigError naming the closest fields (not a bare TypeError)."""
    import difflib

    from kvforge.errors import ConfigError

    out = {}
    flags = {flag.names[0].lstrip("-").replace("-", "_"): flag for flag in ENGINE_FLAGS + SERVER_FLAGS}
    for key, value in kwargs.items():
        name = KEYWORD_ALIASES.get(key, key)
        if name in fields:
            if name in out:
                given = key if key != name else next(k for k, v in KEYWORD_ALIASES.items() if v == name)
                raise ConfigError(f"{given}= and {name}= both given: they are one setting; pass one of them")
            out[name] = value
            continue
        flag = flags.get(key)
        if flag is not None:
            empty = isinstance(value, (dict, list, tuple)) and not value  # hf_overrides={}: nothing to apply
            if value is None or value is False or empty or flag.is_neutral(value):
                continue
            raise ConfigError(f"{key}={value!r}: {flag.why}")
        close = difflib.get_close_matches(key, sorted(fields | set(KEYWORD_ALIASES) | set(flags)), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"LLM(...) got an unknown keyword argument {key!r}{hint} (the engine's settings are the "
                          f"fields of kvforge.config.EngineArgs)")
    return out
