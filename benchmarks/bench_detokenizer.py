"""Host time of incremental detokenization, per token: the ``DecodeStream`` path against the Python window path.

Detokenizes tinyshakespeare's token ids as the engine does, one token a call, ``--seqs`` sequences of
``--tokens`` output tokens each (every sequence with the five tokens before it as its prompt), with the
embedded model's tokenizer (or ``--tokenizer``: a GGUF file or a Hugging Face folder). Both paths run in
one process, alternated ``--rounds`` times; prints the median [min-max] microseconds per token of each and
checks that both produced the same text.

    python benchmarks/bench_detokenizer.py [--seqs 64] [--tokens 1000] [--rounds 5] [--stop STR ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvforge.data_paths import shared_data_dir
from kvforge.engine import detokenizer


def run(tokenizer, ids, seqs: int, tokens: int, stop: tuple[str, ...]) -> tuple[float, list[str]]:
    texts = []
    t0 = time.perf_counter()
    for k in range(seqs):
        start = 5 + k * tokens
        d = detokenizer.IncrementalDetokenizer(tokenizer, ids[start - 5:start], stop=stop)
        for t in ids[start:start + tokens]:
            d.add_tokens([t])
        texts.append(d.text)
    return (time.perf_counter() - t0) / (seqs * tokens) * 1e6, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stop", nargs="*", default=[], help="stop strings (none by default)")
    ap.add_argument("--tokenizer", default=None, help="a GGUF file or a Hugging Face tokenizer folder")
    args = ap.parse_args()

    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or str(embedded_model_path()))
    text = (shared_data_dir() / "text" / "tinyshakespeare.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    need = 5 + args.seqs * args.tokens
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, {need} are needed: lower --seqs or --tokens")
    stream_cls = detokenizer.DecodeStream
    if stream_cls is None:
        raise SystemExit("this tokenizers package has no DecodeStream: only the Python path runs here")
    times = {"DecodeStream": [], "Python window": []}
    outputs = {}
    try:
        for _ in range(args.rounds):
            for name, cls in (("DecodeStream", stream_cls), ("Python window", None)):
                detokenizer.DecodeStream = cls
                us, outputs[name] = run(tokenizer, ids, args.seqs, args.tokens, tuple(args.stop))
                times[name].append(us)
    finally:
        detokenizer.DecodeStream = stream_cls
    print(f"{args.seqs} sequences x {args.tokens} tokens, {args.rounds} rounds, stop strings {args.stop or 'none'}")
    for name, xs in times.items():
        print(f"{name:14s} {statistics.median(xs):6.2f} us/token  [{min(xs):.2f}-{max(xs):.2f}]")
    print("same text:", outputs["DecodeStream"] == outputs["Python window"])


if __name__ == "__main__":
    main()
