"""The serving protocol in one command: one ``kvforge serve`` per KV dtype, ``kvforge bench serve`` against it.

    python benchmarks/serve_protocol.py llama-3.1-8b [--kv bf16 fp8] [--isl 8192] [--osl 256]
        [--concurrency 32] [--num-requests 64] [--warmup 1] [--repetitions 5] [--out DIR]
        [--serve-args "--long-prefill-token-threshold 4096"] [--port 8011]

For each KV dtype, in order: start ``kvforge serve MODEL --load-format dummy --tokenizer DIR --kv-cache-dtype
KV`` (plus ``--serve-args``) on ``--port``, wait for ``/health``, run the load generator with the protocol's
arguments (its JSON report under ``--out``), stop the server. ``DIR`` is a word-level tokenizer of the
model's vocabulary written here (:func:`write_word_tokenizer`): the load generator's words are its first
entries, so a prompt word is one token and ``--isl`` is met without a real tokenizer, and dummy weights
need none. Prints one table: total tok/s, TTFT p50, TPOT p50, ITL p90 and p99 (median [min-max] over the
repetitions) per KV dtype, and the last dtype's total throughput over the first's.

Dummy weights only (the model's own tokenizer is not used). Run it on the GPU host; the load generator's
schedule report (``gap_schedule``) needs the client on the server's host.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvforge.bench.serve_bench import WORDS  # noqa: E402

UNKNOWN = "[UNK]"
#: The ``kvforge`` command line under this interpreter, from this checkout (:func:`checkout_env`).
KVFORGE = [sys.executable, "-c", "import sys; from kvforge.cli import main; sys.exit(main())"]


def checkout_env() -> dict:
    """The environment with this checkout first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def write_word_tokenizer(vocab_size: int, directory: Path) -> Path:
    """A word-level ``tokenizer.json`` of ``vocab_size`` entries in ``directory``: the load generator's words
    first, then ``[UNK]`` (everything else, e.g. a prompt's id prefix), then fillers ``w<i>`` up to the
    vocabulary's size; whitespace and punctuation split words. Returns ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = list(dict.fromkeys(WORDS))
    if vocab_size < len(words) + 1:
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the load generator's {len(words)} words")
    vocab = {w: i for i, w in enumerate(words)}
    vocab[UNKNOWN] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"unk_token": UNKNOWN}))
    return directory


def wait_for_health(url: str, server: subprocess.Popen, timeout: float) -> None:
    """Poll ``url`` until it answers 200; raise if the server exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"no healthy server at {url} after {timeout:.0f} s")


def run_one(args, kv: str, tokenizer: Path, out: Path) -> dict:
    """One server for ``kv`` and one load-generator run against it; returns the generator's JSON report."""
    port = args.port
    serve = [*KVFORGE, "serve", args.model, "--load-format", "dummy", "--tokenizer",
             str(tokenizer), "--kv-cache-dtype", kv, "--port", str(port), *shlex.split(args.serve_args)]
    log = open(out / f"serve_{kv}.log", "w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=checkout_env())
    report = out / f"bench_{kv}_isl{args.isl}.json"
    try:
        wait_for_health(f"http://127.0.0.1:{port}/health", server, args.startup_timeout)
        bench = [*KVFORGE, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                 "--isl", str(args.isl), "--osl", str(args.osl), "--concurrency", str(args.concurrency),
                 "--num-requests", str(args.num_requests), "--warmup", str(args.warmup), "--repetitions",
                 str(args.repetitions), "--out", str(report)]
        subprocess.run(bench, check=True, env=checkout_env())
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    return json.loads(report.read_text())


def cell(summary: dict, name: str) -> str:
    v = summary.get(name)
    if not v:
        return "-"
    return f"{v['median']:,.1f} [{v['min']:,.1f}-{v['max']:,.1f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--isl", type=int, default=8192)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--serve-args", default="", help="more arguments for kvforge serve (one string)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the model's")
    ap.add_argument("--out", default="serve_protocol")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = args.vocab_size
    if vocab is None:
        from kvforge.spec.load import load_model_spec

        vocab = load_model_spec(args.model).vocab_size
    tokenizer = write_word_tokenizer(vocab, out / "tokenizer")
    reports = {kv: run_one(args, kv, tokenizer, out) for kv in args.kv}
    print(f"\nISL {args.isl}, OSL {args.osl}, concurrency {args.concurrency}, {args.num_requests} requests, "
          f"{args.warmup} warm-up + {args.repetitions} repetitions; median [min-max]")
    print("| KV | total tok/s | TTFT p50 ms | TPOT p50 ms | ITL p90 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for kv, report in reports.items():
        s = report["summary"]
        print(f"| {kv} | {cell(s, 'total_throughput_tok_s')} | {cell(s, 'ttft_ms_p50')} | {cell(s, 'tpot_ms_p50')} "
              f"| {cell(s, 'itl_ms_p90')} | {cell(s, 'itl_ms_p99')} |")
    first, last = args.kv[0], args.kv[-1]
    if first != last:
        a = reports[first]["summary"]["total_throughput_tok_s"]["median"]
        b = reports[last]["summary"]["total_throughput_tok_s"]["median"]
        print(f"{last} / {first} total throughput: {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
