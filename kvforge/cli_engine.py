"""Subcommands that need the engine: generate, serve, bench, eval (imported lazily)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text (default: embedded SmolLM2 on CPU)")
    from kvforge.generate_cmd import add_generate_args, generate_main

    add_generate_args(p)
    p.set_defaults(func=generate_main)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from kvforge.server.cli import add_serve_args, serve_main

    add_serve_args(p)
    p.set_defaults(func=serve_main)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from kvforge.bench.serve_bench import add_bench_serve_args, bench_serve_main

    p = bench.add_parser("serve", help="load generator against a running server")
    add_bench_serve_args(p)
    p.set_defaults(func=bench_serve_main)
    from kvforge.bench.offline import add_offline_args, offline_main

    p = bench.add_parser("offline", help="offline throughput (engine in-process)")
    add_offline_args(p)
    p.set_defaults(func=offline_main)

    ev = sub.add_parser("eval", help="quality evaluations").add_subparsers(dest="eval_command", required=True)
    from kvforge.eval.cli import add_gsm8k_args, add_kld_args, gsm8k_main, kld_main

    p = ev.add_parser("gsm8k", help="GSM8K against an OpenAI-compatible server")
    add_gsm8k_args(p)
    p.set_defaults(func=gsm8k_main)
    p = ev.add_parser("kld", help="KL divergence of quantized vs model-dtype KV cache on real text")
    add_kld_args(p)
    p.set_defaults(func=kld_main)
