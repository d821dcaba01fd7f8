"""The ``kvforge`` command: plan | generate | serve | bench | eval.

User errors (KVForgeError) print one clear message and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvforge.cli_args import ArgumentParser, dashed_flag_names
from kvforge.errors import DistributedError, KVForgeError


def _cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from kvforge.config import EngineArgs
    from kvforge.engine.config_checks import check_engine_plan, engine_limitations
    from kvforge.errors import PlanError
    from kvforge.planner.api import plan as make_plan
    from kvforge.planner.inputs import (
        DEFAULT_CPU_KV_CACHE_MEMORY,
        gpu_memory_flag_ignored_on_cpu,
    )
    from kvforge.server.cli import check_server_flags
    from kvforge.spec.load import load_model_spec

    engine = EngineArgs.from_cli_args(args)  # the checks a serve or generate line gets before any weight loads
    check_server_flags(args)
    device, gpu_memory = _plan_device(args.device, engine.gpu_memory)
    speculative = engine.speculative_config
    utilization = engine.gpu_memory_utilization
    warnings = []  # said on stderr as they come, and kept in the JSON plan's warnings

    def warn(text: str) -> None:
        print(f"warning: {text}", file=sys.stderr)
        warnings.append(text)

    ignored = device == "cpu" and gpu_memory_flag_ignored_on_cpu(engine.kv_cache_memory, gpu_memory, utilization)
    if ignored:  # plan what the CPU engine will size
        warn(ignored)
        gpu_memory = None
    if device == "cpu":
        utilization = None  # the CPU engine never reads it (a flag given on its own was warned about above)

    def plan_with(kv_cache_memory):
        return make_plan(
            engine.model, tensor_parallel_size=engine.tensor_parallel_size,
            kv_cache_dtype=engine.kv_cache_dtype, block_size=engine.block_size, max_model_len=engine.max_model_len,
            num_speculative_tokens=engine.num_speculative_tokens, kv_cache_memory=kv_cache_memory,
            gpu_memory=gpu_memory, gpu_memory_utilization=utilization, device=device,
            dtype=None if engine.dtype == "auto" else engine.dtype, kv_scale_scheme=engine.kv_scale_scheme,
            calculate_kv_scales=engine.calculate_kv_scales,
            max_num_seqs=args.max_num_seqs, query_dtype=engine.query_dtype, state_dtype=engine.state_dtype,
            draft_model=speculative.model if speculative is not None and speculative.method == "draft_model" else None,
            mtp=speculative is not None and speculative.method == "mtp",
            max_num_batched_tokens=engine.step_token_budget(device), enable_chunked_prefill=engine.enable_chunked_prefill,
        )

    spec = load_model_spec(engine.model)
    result = plan_with(engine.kv_cache_memory)
    check_engine_plan(engine, spec, result, device, limitations=False)
    for limitation in engine_limitations(engine, spec):
        warn(f"kvforge serve and generate refuse this line: {limitation}")
    if device == "cpu" and engine.kv_cache_memory is None and gpu_memory is None:
        try:  # the capacity-free plan holds; would the CPU engine's default memory run it?
            plan_with(DEFAULT_CPU_KV_CACHE_MEMORY)
        except PlanError as exc:
            warn(f"the CPU engine's default KV memory ({DEFAULT_CPU_KV_CACHE_MEMORY >> 20} MiB) cannot run this "
                 f"plan: {exc}")
    if not engine.enable_prefix_caching and result.prefix_caching:
        result = dataclasses.replace(result, prefix_caching=False,
                                     prefix_caching_reason="off: --no-enable-prefix-caching")
    if args.json:
        print(dataclasses.replace(result, warnings=result.warnings + tuple(warnings)).to_json())
    else:
        from kvforge.planner.render import render_plan

        render_plan(result, console=_plan_console())
    return 0


def _plan_device(device: str, gpu_memory: int | None) -> tuple[str, int | None]:
    """``--device`` of ``kvforge plan`` and the GPU memory to plan with: cpu or cuda as given, with
    ``--gpu-memory``; auto as the engine picks, cuda where torch sees a GPU here, with that GPU's memory
    unless ``--gpu-memory`` names another (the engine reads it the same way)."""
    if device != "auto":
        return device, gpu_memory
    import torch

    if not torch.cuda.is_available():
        return "cpu", gpu_memory
    return "cuda", gpu_memory or torch.cuda.mem_get_info()[1]


# Wide enough for every column of the plan's tables; rich would otherwise cut cells ("trito…") at its
# default of 80 columns whenever stdout is a file or a pipe.
PIPED_TABLE_WIDTH = 200


def _plan_console():
    """A rich console for the plan: the terminal's width on a terminal, PIPED_TABLE_WIDTH otherwise."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPED_TABLE_WIDTH)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``command == "plan"`` the engine subcommands (and
    their heavy imports) are skipped so planning stays fast and torch-free."""
    from kvforge import __version__
    from kvforge.cli_args import token_count

    parser = ArgumentParser(prog="kvforge", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"kvforge {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "plan", help="resolve and print the KV-cache plan (no weights are read)", conflict_handler="resolve",
        description="Resolve and print the KV-cache plan without reading weights. A kvforge serve or generate "
                    "command line plans as it stands (kvforge plan MODEL [their flags]): it gets their checks that need "
                    "no model files (the tokenizer, chat template and weights are checked when they load), and "
                    "flags that do not bear on the KV cache (--port, --seed, sampling) change nothing here.")
    _add_engine_command_flags(p)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="platform to plan for (default cpu: the CPU reference backends; cuda for the GPU kernels, "
                        "with or without a GPU here; auto: as the engine picks, cuda with this machine's GPU memory "
                        "where it has one)")
    p.add_argument("--max-num-batched-tokens", type=token_count, default=None,
                   help="tokens one step may compute: the plan sets their activations aside before the KV memory "
                        "(default 8192 on cuda, 2048 on cpu, raised to --max-num-seqs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)

    if command != "plan":
        _add_engine_commands(sub)
    _accept_log_level_after_command(parser)
    return parser


def _add_engine_command_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``kvforge serve`` and ``kvforge generate`` on the plan's parser (MODEL and the plan's
    own flags among them); the plan's parser resolves conflicts, so its own ``--device`` replaces theirs."""
    from kvforge.generate_cmd import add_generate_only_args
    from kvforge.server.cli import add_serve_args

    add_serve_args(p)
    add_generate_only_args(p)


def _accept_log_level_after_command(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` also after the (sub)command name (``kvforge serve --log-level DEBUG``); there it
    has no default of its own, so the top-level INFO stands unless it is given."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
                _accept_log_level_after_command(subparser)


def _add_engine_commands(sub) -> None:
    """generate / serve / bench / eval live in their own modules (imported lazily)."""
    from kvforge import cli_engine

    cli_engine.register(sub)


def _refusals_as_json(*parsers: argparse.ArgumentParser) -> None:
    """``kvforge plan --json``: a command line the parsers refuse (an unknown flag, a bad value, a refused
    vLLM flag) also prints one JSON error object on stdout, as every later refusal does, so a script reading
    stdout always gets an object; the message on stderr and the exit status 2 stay as they are."""
    import json

    for p in parsers:
        def exit_(status=0, message=None, _exit=p.exit, _prog=p.prog):
            if status and message:
                text = message.strip().removeprefix(f"{_prog}: error: ")
                print(json.dumps({"error": {"type": "UsageError", "message": text}}), flush=True)
            _exit(status, message)

        p.exit = exit_


def command_parser(parser: ArgumentParser, argv: list[str]) -> ArgumentParser:
    """The (sub)parser the command words of ``argv`` select (``kvforge bench serve ...``: bench's serve)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        word = next((w for w in argv if subs and w in subs[0].choices), None)
        if word is None:
            return parser
        parser = subs[0].choices[word]
        argv = argv[argv.index(word) + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = dashed_flag_names(sys.argv[1:] if argv is None else list(argv))
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    if command == "plan" and "--json" in argv:
        _refusals_as_json(parser, command_parser(parser, argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's own usage, not the top level's
        command_parser(parser, argv).refuse_unrecognized(unknown)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KVForgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets an object it can parse
            import json

            print(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}))
        return 2
    except DistributedError as exc:  # a rank died or hung: its own output (above) says why
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped early (`kvforge plan --json | head`): nothing went wrong here. Later writes
        # (the interpreter's final flush) go to /dev/null instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
