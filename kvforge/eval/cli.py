"""``kvforge eval gsm8k`` and ``kvforge eval kld``: argument parsers and entry points.

Wiring (kvforge/cli.py)::

    from kvforge.eval.cli import add_gsm8k_args, add_kld_args, gsm8k_main, kld_main
    p = eval_sub.add_parser("gsm8k", help=...); add_gsm8k_args(p); p.set_defaults(func=gsm8k_main)
    p = eval_sub.add_parser("kld", help=...);   add_kld_args(p);   p.set_defaults(func=kld_main)

Both ``*_main(args)`` return a process exit code (0 ok, 1 failure, 2 usage).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys

from kvforge.cli_args import (
    http_url,
    non_negative_int,
    output_file,
    parse_bytes,
    positive_float,
    positive_int,
)
from kvforge.data_paths import DATA_DIR_HELP
from kvforge.errors import KVForgeError
from kvforge.server.api_keys import CLIENT_API_KEY_HELP, client_api_key

# ---------------------------------------------------------------------------
# gsm8k
# ---------------------------------------------------------------------------


def add_gsm8k_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from kvforge.eval import gsm8k

    parser.description = parser.description or (
        "GSM8K against an OpenAI-compatible /v1/completions server: lm-eval's gsm8k task (few-shot "
        "'Question: ...\\nAnswer: ...', greedy, its strict-match and flexible-extract filters), except "
        "that the few-shot examples are the first N of the train split (lm-eval's 'sampler: first_n'; "
        "its gsm8k default samples them at random)."
    )
    parser.add_argument("--base-url", required=True, type=http_url,
                        help="server URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--num-fewshot", type=non_negative_int, default=gsm8k.DEFAULT_NUM_FEWSHOT,
                        help="few-shot examples: the first N of the train split, as lm-eval's "
                             "'sampler: first_n' (default %(default)s)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N test questions")
    parser.add_argument("--concurrency", type=positive_int, default=gsm8k.DEFAULT_CONCURRENCY,
                        help="requests in flight at once (default %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=gsm8k.DEFAULT_MAX_TOKENS,
                        help="max generated tokens per question (default %(default)s)")
    parser.add_argument("--output", type=output_file, default=None, metavar="FILE.jsonl", help="write one JSON line per question")
    parser.add_argument("--api-key", default=None, help=CLIENT_API_KEY_HELP)
    parser.add_argument("--data-dir", default=None,
                        help="data folder holding gsm8k/ (test.jsonl, train.jsonl), like $KVFORGE_DATA_DIR, or the "
                             f"gsm8k/ folder itself (default: gsm8k/ in {DATA_DIR_HELP})")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds per request (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def gsm8k_main(args: argparse.Namespace) -> int:
    import asyncio

    import aiohttp

    from kvforge.eval import gsm8k

    try:
        result = asyncio.run(
            gsm8k.run_gsm8k(
                args.base_url,
                model=args.model,
                data_dir=args.data_dir,
                num_fewshot=args.num_fewshot,
                limit=args.limit,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                api_key=client_api_key(args.api_key),
                timeout_s=args.timeout,
                progress=not args.no_progress,
            )
        )
    except aiohttp.ClientConnectorError as e:
        print(f"error: cannot reach a server at --base-url {args.base_url} ({e}); start one with `kvforge serve` "
              f"or pass the URL of a running one", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, PermissionError) as e:  # the data, an option or the key: usage errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # aiohttp errors while listing models, etc.
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.output:
        gsm8k.write_jsonl(result.rows, args.output)
    if result.rows and result.errors == len(result.rows):  # nothing reached the model: no accuracy to report
        print(f"error: all {result.errors} requests failed, so there is no score; first error: "
              f"{next(r['error'] for r in result.rows if r.get('error'))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_finite(result.summary)))
    else:
        print(gsm8k.format_summary(result.summary))
        if args.output:
            print(f"per-question results: {args.output}")
    if result.errors:
        print(f"warning: {result.errors} of {len(result.rows)} requests failed (scored as wrong); "
              f"first error: {next(r['error'] for r in result.rows if r.get('error'))}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------
# kld
# ---------------------------------------------------------------------------


def _csv_ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one value")
    return vals


def _literal(s: str):
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s


def _kv_pair(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    return k.strip().replace("-", "_"), _literal(v.strip())


def add_kld_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from kvforge.eval import kld

    parser.description = parser.description or (
        "KL divergence of next-token distributions, model-dtype KV cache vs quantized KV cache, "
        "teacher-forced over real text (llama.cpp perplexity --kl-divergence style)."
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="model path or name (default: the embedded SmolLM2-135M GGUF)")
    parser.add_argument("--text", default=None,
                        help=f"text file to score (default: text/tinyshakespeare.txt in {DATA_DIR_HELP})")
    parser.add_argument("--ctx", type=_csv_ints, default=kld.DEFAULT_CTX,
                        help="window size(s) in tokens, comma-separated (default 512); "
                             "the second half of each window is scored")
    parser.add_argument("--kv-cache-dtype", action="append", default=None, metavar="DTYPE",
                        help="quantized KV dtype(s) to compare with 'auto' (repeat or comma-separate; default fp8)")
    parser.add_argument("--kv-scale-scheme", default=None,
                        help="KV scale scheme(s), comma-separated (e.g. per_tensor,per_head): one run per "
                             "dtype x scheme")
    parser.add_argument("--kv-scale-multiplier", type=float, default=None,
                        help="multiply the KV scales by this (a deliberately wrong scale, for testing that "
                             "the metric catches it)")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="calibrate the fp8 KV scales on the first batch (quantized engines only)")
    parser.add_argument("--max-tokens", type=int, default=kld.DEFAULT_MAX_TOKENS,
                        help="scored tokens per context size (default %(default)s)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="engine device")
    parser.add_argument("--dtype", default="auto",
                        help="model dtype of every engine (default auto: float32 on CPU, the config's on CUDA)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=kld.DEFAULT_KV_CACHE_MEMORY, metavar="BYTES",
                        help="KV bytes for EACH engine (they coexist on one device; default %(default)s)")
    parser.add_argument("--engine-arg", action="append", type=_kv_pair, default=[], metavar="KEY=VALUE",
                        help="extra EngineArgs field for every engine (e.g. --engine-arg device=cpu)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def kld_configs(args: argparse.Namespace) -> list:
    """The quantized configs of a parsed ``kvforge eval kld`` command line."""
    from kvforge.eval.kld import QuantConfig

    dtypes: list[str] = []
    for item in args.kv_cache_dtype or ["fp8"]:
        dtypes.extend(x.strip() for x in item.split(",") if x.strip())
    schemes = [x.strip() for x in args.kv_scale_scheme.split(",") if x.strip()] if args.kv_scale_scheme else [None]
    configs = []
    for d in dtypes:
        if not _quantized(d):  # scales do not apply: one run of the dtype as it is
            configs.append(QuantConfig(d))
            continue
        for sch in schemes:
            ov: list[tuple[str, object]] = []
            if sch is not None:
                ov.append(("kv_scale_scheme", sch))
            if args.kv_scale_multiplier is not None:
                ov.append(("kv_scale_multiplier", args.kv_scale_multiplier))
            if getattr(args, "calculate_kv_scales", False):
                ov.append(("calculate_kv_scales", True))
            configs.append(QuantConfig(d, tuple(ov)))
    return configs


def _quantized(kv_dtype: str) -> bool:
    """Whether ``kv_dtype`` stores scaled values (a name the engine would refuse counts as quantized here, so
    its own check names it)."""
    from kvforge.errors import ConfigError
    from kvforge.kv_dtypes import canonical_kv_dtype, is_quantized

    try:
        return is_quantized(canonical_kv_dtype(kv_dtype))
    except ConfigError:
        return True


def kld_main(args: argparse.Namespace) -> int:
    from kvforge.eval import kld

    if args.max_tokens < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    configs = kld_configs(args)
    try:
        report = kld.run_kld(
            args.model,
            text_path=args.text,
            ctxs=tuple(args.ctx),
            configs=configs,
            max_tokens=args.max_tokens,
            common_overrides={
                "device": args.device,
                "dtype": args.dtype,
                "kv_cache_memory": args.kv_cache_memory,
                "progress": not args.no_progress,
                **dict(args.engine_arg),
            },
            progress=not args.no_progress,
        )
    except (FileNotFoundError, ValueError) as e:  # the text or an option cannot work: a usage error
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KVForgeError as e:  # PlanError / ConfigError from the engine carry their own explanation
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_finite(kld.report_to_json(report))))
    else:
        print(kld.format_report(report))
    return 0


def _finite(obj):
    """JSON has no NaN/inf: turn them into None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
