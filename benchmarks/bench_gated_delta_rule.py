"""Gated delta rule kernels on a CUDA GPU: decode over state slots against the bandwidth floor, and prefill.

Rerun on any CUDA GPU:

    PYTHONUNBUFFERED=1 python benchmarks/bench_gated_delta_rule.py [--quick] [--batches 1,8,64,256]

Shapes: Qwen3-Next's Gated DeltaNet layer (16 key heads, 32 value heads, K = V = 128; per-head
gates) and Kimi-Linear's KDA layer (32 heads, K = V = 128; per-channel gates); float32 states,
bf16 inputs. Decode: one token per sequence, the slots a random subset of ``2 * batch`` slots, each
call captured in a CUDA graph and timed by triton.testing.do_bench (median). Bytes counted: each
sequence's state read and written (2 x Hv x K x V x 4) plus q, k, v, g, beta and the output; "%floor"
= that at the device-to-device copy bandwidth measured in the same run over the median time.
Prefill (both layers): the token-by-token kernel against the chunked form in every chunk size it runs,
from verification rows of 3 tokens to one prompt of 8192 and a prompt's chunk beside decode rows
(``--prefill-shapes 1x2048+32x1``: one sequence of 2048 tokens and 32 of one), each call captured in a CUDA graph (median us);
each chunked result is first checked against the token-by-token one (relative L2: the bf16 outputs within
1e-2, the float32 states within 1e-3). A call holding sequences the route would run token by token beside
chunked ones (``route.chunked_from``) also times that split: chunks of 16, the short ones token by token.
``--snapshots N``: every prefill sequence also stores N prefix-cache snapshots (the state after N evenly
spaced tokens, as a prompt's prefill does under prefix caching), checked with the states.

``--sweep``: the decode tile (``triton_gated_delta_rule.DECODE_TILES``: value channels a program x warps)
over 16-128 channels x 1-8 warps at each batch, each tile's output and states first checked against the
engine's tile (states within 1e-5 relative L2, the bf16 output within 2^-8: only the order of the
in-program sums may differ).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench  # noqa: E402

import kvforge.kernels.triton_gated_delta_rule as gdr  # noqa: E402
from kvforge.attention.linear_state import SNAPSHOTS_PER_SEQUENCE  # noqa: E402
from kvforge.kernels.triton_gated_delta_rule import RecurrentTile, TileBySequences, decode, prefill  # noqa: E402

PREFILL_SHAPES = ("1x3", "4x3", "64x3", "1x16", "1x256", "16x256", "8x1024", "1x4096", "1x8192", "1x2048+32x1")
CHUNKS = tuple(sorted(gdr.CHUNK_STATE_STAGES))
LAYERS = {"qwen3-next": (16, 32, 128, 128, False), "kimi-linear": (32, 32, 128, 128, True)}


def sequence_lengths(shape: str) -> list[int]:
    """Each sequence's tokens in a call written ``SEQUENCESxTOKENS[+SEQUENCESxTOKENS...]``."""
    lengths = []
    for group in shape.split("+"):
        seqs, tokens = (int(x) for x in group.split("x"))
        lengths += [tokens] * seqs
    return lengths


def snapshot_pairs(lengths: list[int], count: int) -> torch.Tensor | None:
    """``prefill``'s snapshots: each sequence of more than ``count`` tokens stores its state after ``count``
    evenly spaced tokens, into slots after the sequences' own (``len(lengths) + count * i + j``)."""
    if not count:
        return None
    pairs = torch.full((len(lengths), 2 * SNAPSHOTS_PER_SEQUENCE), -1, dtype=torch.int32)
    for i, n in enumerate(lengths):
        if n > count:
            for j in range(count):
                pairs[i, 2 * j] = (j + 1) * n // (count + 1) - 1
                pairs[i, 2 * j + 1] = len(lengths) + count * i + j
    return pairs.cuda()


def timed(fn, graph: bool) -> float:
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    ms = do_bench(fn, warmup=10, rep=50, quantiles=[0.5])
    return (ms[0] if isinstance(ms, (list, tuple)) else ms) * 1e-3  # one quantile: a number in newer Triton


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), graph=False)


def inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, per_channel: bool):
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(tokens, hk, dk, device=dev, dtype=bf)
    k = torch.randn(tokens, hk, dk, device=dev, dtype=bf)
    v = torch.randn(tokens, hv, dv, device=dev, dtype=bf)
    g = -torch.rand((tokens, hv, dk) if per_channel else (tokens, hv), device=dev)
    beta = torch.rand(tokens, hv, device=dev)
    return q, k, v, g, beta


def sweep_tiles(q, k, v, g, beta, states, slots, nbytes: int, peak: float) -> None:
    engine_tiles = gdr.DECODE_TILES
    engine_tile = engine_tiles.for_batch(slots.shape[0])
    start = states.clone()
    want_out = decode(q, k, v, g, beta, states, slots, normalize_qk=True)
    want_states = states.clone()
    rows = []
    try:
        for block_v in (16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                tile = RecurrentTile(block_v, warps)
                gdr.DECODE_TILES = TileBySequences(tile, tile, 0)
                states.copy_(start)
                out = decode(q, k, v, g, beta, states, slots, normalize_qk=True)
                for got, want, what, bound in ((out, want_out, "output", 2**-8), (states, want_states, "states", 1e-5)):
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    if err > bound:
                        raise SystemExit(f"tile {block_v} x {warps} warps: {what} off by {err:.2e}")
                seconds = timed(functools.partial(decode, q, k, v, g, beta, states, slots, normalize_qk=True),
                                graph=True)
                rows.append((seconds, block_v, warps))
    finally:
        gdr.DECODE_TILES = engine_tiles
        states.copy_(start)
    for seconds, block_v, warps in sorted(rows)[:6]:
        mark = "  (engine)" if RecurrentTile(block_v, warps) == engine_tile else ""
        print(f"    tile {block_v:3d} x {warps} warps: {seconds * 1e6:8.1f} us  "
              f"{100 * nbytes / seconds / peak:5.1f} %floor{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--quick", action="store_true", help="decode batches 1 and 64 only, no prefill")
    parser.add_argument("--sweep", action="store_true", help="time the decode tiles (no prefill)")
    parser.add_argument("--snapshots", type=int, default=0, choices=range(SNAPSHOTS_PER_SEQUENCE + 1),
                        help="prefix-cache snapshots each prefill sequence stores, evenly spaced over its tokens "
                        f"(the engine keeps up to {SNAPSHOTS_PER_SEQUENCE} a sequence a step)")
    parser.add_argument("--prefill-shapes", default=None,
                        help="prefill calls, comma-separated, each SEQUENCESxTOKENS or groups of them joined by + "
                        "(one call of mixed lengths); default: " + ",".join(PREFILL_SHAPES))
    args = parser.parse_args()
    batches = [1, 64] if args.quick else [int(b) for b in args.batches.split(",")]
    peak = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s")
    gdr.route.PREFILL_CHUNK_SIZE = None  # a call naming no chunk runs token by token
    for name, (hk, hv, dk, dv, per_channel) in LAYERS.items():
        for batch in batches:
            q, k, v, g, beta = inputs(batch, hk, hv, dk, dv, per_channel)
            states = torch.zeros(2 * batch, hv, dk, dv, device="cuda")
            slots = torch.randperm(2 * batch, device="cuda")[:batch].to(torch.int32)
            seconds = timed(functools.partial(decode, q, k, v, g, beta, states, slots, normalize_qk=True), graph=True)
            nbytes = batch * (2 * hv * dk * dv * 4 + sum(x[0].numel() * x.element_size() for x in (q, k, v, g, beta))
                              + hv * dv * 2)
            print(f"decode {name:12s} batch {batch:4d}: {seconds * 1e6:8.1f} us  "
                  f"{nbytes / seconds / 1e9:7.0f} GB/s  {100 * nbytes / seconds / peak:5.1f} %floor")
            if args.sweep:
                sweep_tiles(q, k, v, g, beta, states, slots, nbytes, peak)
        if args.quick or args.sweep:
            continue
        shapes = PREFILL_SHAPES if args.prefill_shapes is None else args.prefill_shapes.split(",")
        for shape in shapes:
            lengths = sequence_lengths(shape)
            seqs = len(lengths)
            q, k, v, g, beta = inputs(sum(lengths), hk, hv, dk, dv, per_channel)
            states = torch.zeros(seqs * (1 + args.snapshots), hv, dk, dv, device="cuda")
            slots = torch.arange(seqs, device="cuda", dtype=torch.int32)
            qsl = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
            snapshots = snapshot_pairs(lengths, args.snapshots)
            runs = {}
            split_from = gdr.route.chunked_from(lengths)  # the route's bound where the call holds short ones
            forms = (None, *CHUNKS, *(("split",) if split_from else ()))
            for chunk in forms:  # None: token by token (the route told to name no chunk)
                states.zero_()
                run = functools.partial(prefill, q, k, v, g, beta, states, slots, qsl, normalize_qk=True,
                                        chunk_size=CHUNKS[0] if chunk == "split" else chunk,
                                        chunked_from=split_from if chunk == "split" else 0, host_query_lens=lengths,
                                        snapshots=snapshots)
                out, after = run().float(), states.clone()  # one call from zeros, before the timed replays
                runs[chunk] = (timed(run, graph=True), out, after)
            base = runs[None]
            for chunk in forms[1:]:
                for got, want, what, bound in ((runs[chunk][1], base[1], "output", 1e-2),
                                               (runs[chunk][2], base[2], "states", 1e-3)):
                    err = ((got - want).norm() / want.norm()).item()
                    if not err < bound:
                        raise SystemExit(f"chunks of {chunk}, {shape}: {what} off by {err:.2e}")
            print(f"prefill {name:12s} {shape:>11s}: token by token {base[0] * 1e6:9.1f} us, chunks of "
                  + ", ".join(f"{c} {runs[c][0] * 1e6:9.1f} us ({base[0] / runs[c][0]:.1f}x)" for c in CHUNKS)
                  + (f"; chunks of {CHUNKS[0]} with the sequences under {split_from} tokens token by token "
                     f"{runs['split'][0] * 1e6:9.1f} us ({base[0] / runs['split'][0]:.1f}x)" if split_from else ""))


if __name__ == "__main__":
    main()
