"""Argument parsing helpers shared by the CLI subcommands (vLLM flag names)."""

from __future__ import annotations

import argparse
import difflib

from kvforge.byte_sizes import parse_byte_size, parse_token_count
from kvforge.planner.inputs import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_NUM_SEQS, QUERY_DTYPE_CHOICES


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that takes flags only as spelled in full (``allow_abbrev`` off): a prefix
    such as ``--max-model`` is an unknown flag, never bound to whichever flag it abbreviates today. Subcommand
    parsers made from one (``add_subparsers``) are of this class too."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """As argparse's; an unrecognized flag's error names the flags closest to it
        (:meth:`refuse_unrecognized`)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.refuse_unrecognized(extras)
        return namespace

    def refuse_unrecognized(self, extras: list[str]) -> None:
        """Exit with argparse's usage error for ``extras``, naming for each unknown flag the flags of this
        parser (and its subcommands) it is closest to."""
        names = sorted(o[2:] for o in _option_strings(self))  # compared without the "--" every flag shares
        hints = []
        for arg in extras:
            close = ["--" + c for c in difflib.get_close_matches(arg.split("=", 1)[0][2:], names, n=2)
                     ] if arg.startswith("--") else []
            if close:
                hints.append(f"{arg}: did you mean {' or '.join(close)}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + ("; " + "; ".join(hints) if hints else ""))


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every long flag of ``parser`` and of its subcommands' parsers."""
    out = set()
    for action in parser._actions:
        out.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def parse_bytes(text: str) -> int:
    """'85899345920', '80GiB', '80e9', '1.5GB' -> bytes (positive integer; kvforge/byte_sizes.py)."""
    try:
        return parse_byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def dashed_flag_names(argv: list[str]) -> list[str]:
    """``argv`` with underscores in flag names turned into dashes (``--max_model_len=4096`` is
    ``--max-model-len=4096``), as vLLM's parser takes them; values and everything after a bare ``--`` stay."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "_" in arg.partition("=")[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def token_count(text: str) -> int:
    """A positive count of tokens, plain or human-readable as vLLM takes it (kvforge/byte_sizes.py)."""
    try:
        return parse_token_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_len(text: str) -> int | str:
    """``--max-model-len``: a token count (:func:`token_count`), or vLLM's ``auto`` / ``-1``: the longest length
    up to the model's context length that the KV memory holds one sequence of, planned before weights load."""
    from kvforge.planner.inputs import AUTO_MAX_MODEL_LEN, AUTO_MAX_MODEL_LEN_SPELLINGS

    if text.strip().lower() in AUTO_MAX_MODEL_LEN_SPELLINGS:
        return AUTO_MAX_MODEL_LEN
    return token_count(text)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def http_url(text: str) -> str:
    """A server's http(s) URL with a host, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL of a server; example: http://127.0.0.1:8000")
    return text.strip()


def output_file(text: str) -> str:
    """A file a command writes when it is done: its folder must exist and be writable now, so a run never
    ends in an error after its work (the file itself may be new or be replaced)."""
    import os

    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} is not writable; write elsewhere")
    return text


def add_model_arguments(p: argparse.ArgumentParser, help: str) -> None:
    """The model as the positional MODEL, or as vLLM's ``--model MODEL`` (read back by :func:`model_argument`)."""
    p.add_argument("model", nargs="?", default=None, help=help)
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (vLLM's spelling)")


def model_argument(ns: argparse.Namespace) -> str | None:
    """The model a command line names (MODEL or ``--model``); ConfigError when it names two."""
    from kvforge.errors import ConfigError

    flag = getattr(ns, "model_flag", None)
    if flag is not None and ns.model is not None and flag != ns.model:
        raise ConfigError(f"MODEL {ns.model!r} and --model {flag!r} name two models; give one of them")
    return flag if flag is not None else ns.model


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The flags that decide the KV-cache plan (shared by plan/generate/serve)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (model dtype), bfloat16 (bf16), float16 (fp16), float32 (fp32), fp8 (= fp8_e4m3), fp8_e4m3, "
                        "fp8_e5m2")
    p.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block (default: negotiated)")
    p.add_argument("--num-speculative-tokens", type=non_negative_int, default=0,
                   help="speculate this many tokens per step with n-gram (prompt-lookup) proposals; shorthand for "
                        "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": N}'")
    p.add_argument("--speculative-config", default=None,
                   help="speculative decoding as JSON (vLLM's keys): method ngram with num_speculative_tokens, "
                        "prompt_lookup_min, prompt_lookup_max; method draft_model with model (a smaller model of "
                        "the same vocabulary) and num_speculative_tokens; method mtp (vLLM's deepseek_mtp, "
                        "qwen3_next_mtp: the DeepSeek-V3 or Qwen3-Next checkpoint's own multi-token-prediction "
                        "layer) with num_speculative_tokens (docs/SPECULATIVE.md)")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM compatibility; changes nothing (kvforge never runs a checkpoint's code)")
    p.add_argument("--max-model-len", type=model_len, default=None,
                   help="longest sequence (prompt + output) in tokens; 128K = 131072, 128k = 128000; auto (or -1): "
                        "the longest up to the model's context length that the KV memory holds one sequence of "
                        "(default: the model's context length)")
    p.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_bytes,
                   default=None, help="KV cache bytes per rank (e.g. 8GiB)")
    p.add_argument("--gpu-memory", type=parse_bytes, default=None,
                   help="device memory per rank for planning without a device (e.g. 140GiB: an H200's "
                        "143,771 MiB as torch reports it)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help="share of the GPU's memory to plan for (default 0.9; on CPU the KV cache gets --kv-cache-memory)")
    p.add_argument("--kv-scale-scheme", choices=["per_tensor", "per_head"], default="per_tensor")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="calibrate fp8 KV scales on the first batch instead of the default 1.0")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help=f"sequences one step may run (default {DEFAULT_MAX_NUM_SEQS}; an engine given a smaller "
                        "--max-num-batched-tokens runs at most that many)")
    p.add_argument("--query-dtype", choices=list(QUERY_DTYPE_CHOICES), default="auto",
                   help="attention query dtype: auto (the model dtype unless a backend declares a quantized query "
                        "as its default; none does today), model (always the model dtype) or fp8 (opt in to the "
                        "backend's fp8 query over an fp8 KV cache; fails where a layer cannot take it). The plan "
                        "says why per layer")
    p.add_argument("--state-dtype", choices=["auto", "model", "float32", "bfloat16", "float16"], default="auto",
                   help="state slots of linear-attention layers (Qwen3-Next, Kimi-Linear): auto (float32, the "
                        "recurrent state is rewritten every token), model (the model dtype, half the bytes of a "
                        "16-bit model) or a float dtype; never quantized")
    p.add_argument("--dtype", default="auto", help="model dtype: auto, bfloat16, float16, float32")
