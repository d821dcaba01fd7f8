"""Host time of splitting one streamed gpt-oss (harmony) output into reasoning and answer, as the server does
for every step of a streamed chat choice: ``HarmonyStream.feed`` with the text so far after every token.

    python benchmarks/bench_harmony_stream.py --words 20000 --chars-per-step 4

The output: an analysis message and a final message of ``--words`` words each; the stream is fed the text so
far every ``--chars-per-step`` characters (about a token). Prints the feeds, the seconds they took and the
mean and last-tenth microseconds a feed (the last tenth: the cost at the output's full length).
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=20000)
    parser.add_argument("--chars-per-step", type=int, default=4)
    args = parser.parse_args(argv)

    from kvforge.server.harmony_split import HarmonyStream

    text = ("<|channel|>analysis<|message|>" + "think " * args.words + "<|end|><|start|>assistant<|channel|>final"
            "<|message|>" + "answer " * args.words)
    stream = HarmonyStream()
    cuts = range(args.chars_per_step, len(text) + 1, args.chars_per_step)
    times = []
    for n in cuts:
        so_far = text[:n]
        start = time.perf_counter()
        stream.feed(so_far)
        times.append(time.perf_counter() - start)
    tail = times[-len(times) // 10:]
    print(f"{len(times)} feeds of a {len(text):,}-character output: {sum(times):.2f} s, "
          f"{sum(times) / len(times) * 1e6:.1f} us a feed, {sum(tail) / len(tail) * 1e6:.1f} us in the last tenth")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
