"""Kernel choice, split counts and launch parameters, pinned: the same inputs must launch the same kernels
with the same arguments (grid, constexprs, warps, stages, scalar arguments, partial-buffer shapes).

Every kernel launch of the eager entries (``paged_attention``, the MLA decode) is replaced by a recorder, so
this runs on CPU (the Gluon device gate and the SM count are forced per case). The CUDA-graph pinning of
split counts is observed the same way for the plans a capture sees. ``tests/data/routing_pinned.json``
holds one SHA-256 per case of the recorded launches; it was written from the code as it stood before the
routing tables existed, so equality here means the restructuring did not change a single launch. The
``paged_sinks`` and ``graph_sinks`` suites (layers with attention sinks) were added with the sinks, and pin
those launches from then on; ``paged_ordered`` (decode grids walking ``meta.decode_order``, KV heads first)
was added with that grid, and the suites before it run with the batch-order grid. Exact
equality is the point: launch parameters are integers, dtypes and shapes (and one float computed the same
way), and a changed one is a changed kernel.

Regenerate (only when a launch is meant to change, and say which in the commit):
``PYTHONPATH=. python tests/test_routing_pinned.py --write``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing.platform import Device
from kvforge.kernels import (
    gluon_fp8_decode,
    gluon_mla_decode,
    gluon_mla_decode_ws,
    triton_mla_decode,
    triton_paged_attention,
)

pytest.importorskip("triton")  # the launchers size their grids with triton's helpers

GOLDEN = Path(__file__).parent / "data" / "routing_pinned.json"

BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = {"bf16": BF16, "fp16": FP16, "fp32": F32, "e4m3": E4M3, "e5m2": E5M2}


# ---------------------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------------------


def _plain(x):
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype)]
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return repr(x)
    return x


def _is_e5m2(cache_arg: int):
    return lambda args: args[cache_arg].dtype == torch.float8_e5m2


#: Constexprs removed from the kernels since the pin (benchmark knobs that nothing routed to), with the value
#: every routed launch passed for them then: a launch is pinned as if it still passed them, so equality
#: here shows the remaining parameters are the ones it passed before.
REMOVED_CONSTEXPRS = {
    "_paged_attn_kernel": {"CVT_MODE": lambda args: 0, "PREFETCH": lambda args: False,
                           "V_DIM_MAJOR": lambda args: False, "IS_E5M2": _is_e5m2(1)},
    "_mla_decode_kernel": {"CVT_ASM": lambda args: False, "IS_E5M2": _is_e5m2(2)},
}


#: Parameters added since the pin that a launch passes only as keywords, with the switch that says they are
#: off: a launch with the switch off is pinned without them (the kernel then reads none of them), so every
#: launch of the pinned cases is compared with what it passed before; launches with the switch on are pinned
#: whole. The decode grid's order (``HEADS_FIRST``) is off in the suites pinned before it
#: (``ORDERED_DECODE_GRID`` False there) and on in ``paged_ordered``.
ADDED_WHEN_ON = {
    "_paged_attn_kernel": [("USE_SINKS", ("USE_SINKS", "sinks_ptr")),
                           ("HEADS_FIRST", ("HEADS_FIRST", "USE_ORDER", "order_ptr"))],
    "_merge_splits_kernel": [("USE_SINKS", ("USE_SINKS", "sinks_ptr")), ("PERMUTED", ("PERMUTED", "out_cols_ptr"))],
    "_ws_mla_decode_kernel": [("TWO_TERMS", ("TWO_TERMS",))],
    "_gluon_fp8_decode_warp_kernel": [("HEADS_FIRST", ("HEADS_FIRST", "USE_ORDER", "CHUNK_BY_LONGEST", "order_ptr"))],
}


class _Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for key, value in REMOVED_CONSTEXPRS.get(self.name, {}).items():
                assert key not in kwargs, f"{self.name} passes {key} again: drop it from REMOVED_CONSTEXPRS"
                kwargs[key] = value(args)
            for switch, added in ADDED_WHEN_ON.get(self.name, ()):
                if kwargs[switch] is False:
                    kwargs = {k: v for k, v in kwargs.items() if k not in added}
            self.log.append({"kernel": self.name, "grid": _plain(tuple(grid)), "args": _plain(args),
                             "kwargs": {k: _plain(v) for k, v in sorted(kwargs.items())}})
            return None

        return launch


def _patch_launches(monkeypatch, log: list, *, gluon: bool, sms: int) -> None:
    """Every kernel the eager entries can launch becomes a recorder; the Gluon gate and SM count are set."""
    kernels = [
        (triton_paged_attention, "_paged_attn_kernel"),
        (triton_paged_attention, "_merge_splits_kernel"),
        (gluon_fp8_decode, "_gluon_fp8_decode_kernel"),
        (gluon_fp8_decode, "_gluon_fp8_decode_warp_kernel"),
        (triton_mla_decode, "_mla_decode_kernel"),
        (gluon_mla_decode, "_wgmma_mla_decode_kernel"),
        (gluon_mla_decode_ws, "_ws_mla_decode_kernel"),
    ]
    for module, name in kernels:
        monkeypatch.setattr(module, name, _Recorder(name, log), raising=False)
    for module in (triton_paged_attention, triton_mla_decode):
        monkeypatch.setattr(module, "routing_device", lambda t: Device(num_sms=sms, gluon=gluon))
    monkeypatch.setattr(gluon_mla_decode, "gluon_runs_on", lambda t: gluon)  # the wgmma launcher's scope check
    for module in (triton_mla_decode, gluon_mla_decode):
        monkeypatch.setattr(module, "num_sms", lambda d: sms)
    monkeypatch.setattr(triton_mla_decode, "_SHRUNK_CONFIGS", {})
    monkeypatch.setattr(triton_mla_decode, "_WGMMA_OUT_OF_RESOURCES", set())


def _meta(query_lens: list[int], max_seq_len: int, block_size: int) -> AttentionMetadata:
    n = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    lens = [max_seq_len] * n
    return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.zeros(n, 4, dtype=torch.int32), torch.zeros(qsl[-1], dtype=torch.int64),
                             max(query_lens), max_seq_len, block_size, tuple(qsl), tuple(lens))


def _observe(call) -> list | str:
    try:
        call()
    except (ValueError, RuntimeError) as e:  # a refused call is pinned by its message
        return f"{type(e).__name__}: {e}"
    return []


# ---------------------------------------------------------------------------------------------------------
# the cases (deterministic)
# ---------------------------------------------------------------------------------------------------------

#: Batches: (name, query lengths, max_seq_len).
PAGED_BATCHES = [
    ("decode1x3000", [1], 3000),
    ("decode8x300", [1] * 8, 300),
    ("decode64x40000", [1] * 64, 40000),
    ("decode3x70", [1] * 3, 70),
    ("q2x4", [2] * 4, 900),
    ("prefill", [5, 37], 200),
    ("mixed", [1, 1, 19], 5000),
]


def paged_cases() -> list[dict]:
    rng = random.Random(0)
    cases = []
    pairs = [("bf16", "bf16"), ("bf16", "e4m3"), ("bf16", "e5m2"), ("fp16", "fp16"), ("fp16", "e4m3"),
             ("fp32", "fp32"), ("fp32", "e4m3")]
    for q, kv in pairs:
        for hq, hkv in ((8, 8), (32, 8), (32, 2), (64, 2)):
            for d in (64, 96, 128, 256):
                for batch, qlens, max_len in PAGED_BATCHES:
                    cases.append(dict(q=q, kv=kv, hq=hq, hkv=hkv, d=d, batch=batch, qlens=qlens, max_len=max_len,
                                      window=rng.choice([None, None, 512]), splits=rng.choice([None, None, 3, 0]),
                                      gluon=rng.choice([True, False]), sms=rng.choice([132, 132, 78]),
                                      block=rng.choice([16, 32])))
    return cases


def paged_sinks_cases() -> list[dict]:
    """Layers with attention sinks (added after the pin): windows that cut or not, decode, prefill and mixed
    batches, bf16 and fp8 caches with the Gluon gate open or closed, pinned split counts."""
    rng = random.Random(2)
    cases = []
    for q, kv in (("bf16", "bf16"), ("bf16", "e4m3"), ("fp16", "e5m2"), ("fp32", "fp32")):
        for hq, hkv in ((8, 8), (64, 8)):
            for d in (64, 128):
                for batch, qlens, max_len in PAGED_BATCHES:
                    cases.append(dict(q=q, kv=kv, hq=hq, hkv=hkv, d=d, batch=batch, qlens=qlens, max_len=max_len,
                                      window=rng.choice([None, 128, 4096]), splits=rng.choice([None, None, 3, 0]),
                                      gluon=rng.choice([True, False]), sms=rng.choice([132, 78]),
                                      block=rng.choice([16, 32]), sinks=True))
    return cases


def paged_ordered_cases() -> list[dict]:
    """The decode batches of the paged suite on the ordered decode grid, with a decode order in the metadata
    (added after the pin)."""
    return [dict(case, ordered=True) for case in paged_cases() if set(case["qlens"]) == {1}]


def observe_paged(case: dict, monkeypatch) -> list | str:
    log: list = []
    _patch_launches(monkeypatch, log, gluon=case["gluon"], sms=case["sms"])
    monkeypatch.setattr(triton_paged_attention, "ORDERED_DECODE_GRID", bool(case.get("ordered")))
    meta = _meta(case["qlens"], case["max_len"], case["block"])
    if case.get("ordered"):
        order = AttentionMetadata.longest_first(np.array(meta.host_seq_lens))
        meta = dataclasses.replace(meta, decode_order=torch.from_numpy(order))
    t = sum(case["qlens"])
    q = torch.zeros(t, case["hq"], case["d"], dtype=DTYPES[case["q"]])
    cache = torch.zeros(2, 2, case["hkv"], case["block"], case["d"], dtype=DTYPES[case["kv"]])
    scales = torch.ones(case["hkv"])
    sinks = torch.zeros(case["hq"]) if case.get("sinks") else None
    got = _observe(lambda: triton_paged_attention.paged_attention(
        q, cache, meta, scales, scales, 0.125, case["window"], num_splits=case["splits"], sinks=sinks))
    return got or log


MLA_BATCHES = [
    ("1x65536", 1, 65536),
    ("3x300", 3, 300),
    ("8x16384", 8, 16384),
    ("32x65536", 32, 65536),
    ("64x4096", 64, 4096),
    ("128x65536", 128, 65536),
]


def mla_cases() -> list[dict]:
    rng = random.Random(1)
    cases = []
    pairs = [("bf16", "bf16"), ("bf16", "e4m3"), ("fp16", "e5m2"), ("fp16", "e4m3"), ("fp32", "fp32"),
             ("bf16", "fp32"), ("bf16", "fp16"), ("fp32", "e4m3")]
    for q, kv in pairs:
        for heads in (1, 8, 16, 17, 32, 64, 128):
            for r, p in ((512, 64), (32, 16)):
                for batch, n, max_len in MLA_BATCHES:
                    for query_dtype in (None, "fp8_e4m3"):
                        if query_dtype and (kv != "e4m3" or q == "fp32") and rng.random() < 0.8:
                            continue  # refused calls: a few are enough
                        cases.append(dict(q=q, kv=kv, heads=heads, r=r, p=p, batch=batch, n=n, max_len=max_len,
                                          query_dtype=query_dtype, splits=rng.choice([None, None, None, 5]),
                                          gluon=rng.choice([True, True, False]), sms=rng.choice([132, 132, 78]),
                                          block=rng.choice([1, 16, 64])))
    return cases


def observe_mla(case: dict, monkeypatch) -> list | str:
    log: list = []
    _patch_launches(monkeypatch, log, gluon=case["gluon"], sms=case["sms"])
    n, h, r, p = case["n"], case["heads"], case["r"], case["p"]
    meta = _meta([1] * n, case["max_len"], case["block"])
    ql = torch.zeros(n, h, r, dtype=DTYPES[case["q"]])
    qr = torch.zeros(n, h, p, dtype=DTYPES[case["q"]])
    cache = torch.zeros(2, case["block"], r + p, dtype=DTYPES[case["kv"]])
    got = _observe(lambda: triton_mla_decode.mla_decode(ql, qr, cache, meta, torch.ones(1), 0.1,
                                                        query_dtype=case["query_dtype"], num_splits=case["splits"]))
    return got or log


def graph_cases() -> list[dict]:
    cases = []
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for kv in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        for head in (64, 96, 128, 256):
            for heads, kv_heads in ((8, 8), (32, 8), (32, 2), (64, 2), (4, 1)):
                for max_len in (300, 4096, 32768):
                    for gluon in (True, False):
                        cases.append(dict(kind="full", kv=kv, head=head, heads=heads, kv_heads=kv_heads,
                                          max_len=max_len, gluon=gluon, model="bfloat16", sizes=sizes, sms=132,
                                          latent=None, query="bfloat16"))
    for kv in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        for heads in (1, 8, 16, 17, 32, 128):
            for latent, rope in ((512, 64), (32, 16)):
                for max_len in (4096, 65536, 163840):
                    for model in ("bfloat16", "float32"):
                        for gluon in (True, False):
                            for query in ([model, "fp8_e4m3"] if kv == "fp8_e4m3" and heads <= 16 else [model]):
                                for sms in (132, 78):
                                    cases.append(dict(kind="mla", kv=kv, head=latent + rope, heads=heads,
                                                      kv_heads=1, max_len=max_len, gluon=gluon, model=model,
                                                      sizes=sizes, sms=sms, latent=latent, query=query))
    return cases


def graph_sinks_cases() -> list[dict]:
    """Plans of layers with attention sinks (added after the pin): the Gluon rows never serve them."""
    return [dict(case, sinks=True) for case in graph_cases() if case["kind"] == "full"]


def observe_graph(case: dict, monkeypatch) -> dict:
    """The split count per capture size that the layers' backend pins for a plan of identical layers."""
    from kvforge.attention.backends.base import BackendOptions, backend_class
    from kvforge.planner.registry import builtin_backends

    backend = "triton_mla" if case["kind"] == "mla" else "triton_paged"
    layer = types.SimpleNamespace(kind=case["kind"], backend=backend, kv_dtype=case["kv"], head_size=case["head"],
                                  heads_per_rank=case["heads"], kv_heads_per_rank=case["kv_heads"],
                                  query_dtype=case["query"], sinks=case.get("sinks", False))
    options = BackendOptions(softmax_scale=0.1, model_dtype=case["model"],
                             device=Device(num_sms=case["sms"], gluon=case["gluon"]), latent_dim=case["latent"])
    declaration = {d.name: d for d in builtin_backends()}[backend]
    obj = backend_class(declaration)(options)
    return {b: obj.graph_num_splits([layer, layer], b, case["max_len"]) for b in case["sizes"]}


SUITES = {"paged": (paged_cases, observe_paged), "mla": (mla_cases, observe_mla),
          "graph": (graph_cases, observe_graph), "paged_sinks": (paged_sinks_cases, observe_paged),
          "graph_sinks": (graph_sinks_cases, observe_graph), "paged_ordered": (paged_ordered_cases, observe_paged)}


def _key(case: dict) -> str:
    return hashlib.sha256(json.dumps(case, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _digest(observed) -> str:
    return hashlib.sha256(json.dumps(observed, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_launches_equal_the_pinned_ones(suite, monkeypatch):
    golden = json.loads(GOLDEN.read_text())[suite]
    make, observe = SUITES[suite]
    cases = make()
    assert len(cases) == len(golden), f"{suite}: {len(cases)} cases, {len(golden)} pinned"
    for case in cases:
        with monkeypatch.context() as mp:
            observed = observe(case, mp)
        assert _digest(observed) == golden[_key(case)], (case, observed)


def test_the_cases_reach_every_kernel(monkeypatch):
    """The pinned cases are worth pinning: together they launch every kernel and split and refuse some calls."""
    seen = set()
    refused = 0
    for suite in ("paged", "mla"):
        make, observe = SUITES[suite]
        for case in make():
            with monkeypatch.context() as mp:
                observed = observe(case, mp)
            if isinstance(observed, str):
                refused += 1
                continue
            seen.update(launch["kernel"] for launch in observed)
    assert seen == {"_paged_attn_kernel", "_merge_splits_kernel", "_gluon_fp8_decode_kernel",
                    "_gluon_fp8_decode_warp_kernel", "_mla_decode_kernel", "_wgmma_mla_decode_kernel",
                    "_ws_mla_decode_kernel"}
    assert refused > 0


def test_ordered_cases_walk_the_decode_order_heads_first(monkeypatch):
    """The ordered suite's decode launches (the Triton kernel and the Gluon warp kernel) put the KV heads on
    the first grid axis and read the order; the Gluon cta kernel keeps its batch-order grid."""
    kinds = set()
    for case in paged_ordered_cases():
        with monkeypatch.context() as mp:
            observed = observe_paged(case, mp)
        for launch in observed if isinstance(observed, list) else ():
            name, kwargs = launch["kernel"], launch["kwargs"]
            if name in ("_paged_attn_kernel", "_gluon_fp8_decode_warp_kernel"):
                assert kwargs["HEADS_FIRST"] is True and kwargs["USE_ORDER"] is True, (case, launch)
                assert launch["grid"][0] == case["hkv"], (case, launch)
                kinds.add(name)
            elif name == "_gluon_fp8_decode_kernel":
                assert launch["grid"][1] == case["hkv"]
                kinds.add(name)
    assert kinds == {"_paged_attn_kernel", "_gluon_fp8_decode_warp_kernel", "_gluon_fp8_decode_kernel"}


def test_sinks_cases_launch_the_tl_dot_kernel_with_sinks_on(monkeypatch):
    """Layers with sinks (Gluon gate open or closed) launch only the tl.dot kernel and the merge, both with
    the sinks on, and both with and without split-K."""
    kernels, merged, direct = set(), 0, 0
    for case in paged_sinks_cases():
        with monkeypatch.context() as mp:
            observed = observe_paged(case, mp)
        assert isinstance(observed, list), (case, observed)
        for launch in observed:
            kernels.add(launch["kernel"])
            assert launch["kwargs"]["USE_SINKS"] is True and launch["kwargs"]["sinks_ptr"][0] == "tensor"
        merged += len(observed) == 2
        direct += len(observed) == 1
    assert kernels == {"_paged_attn_kernel", "_merge_splits_kernel"} and merged and direct


def test_graph_pinning_of_sinks_layers_is_the_tl_dot_rule(monkeypatch):
    """For layers with sinks the graph pins the tl.dot kernel's count even where the Gluon gate is open and
    the same layers without sinks would pin a Gluon row's count."""
    from kvforge.attention.routing import paged

    differs = 0
    for case in graph_sinks_cases():
        pinned = observe_graph(case, monkeypatch)
        without = observe_graph(dict(case, sinks=False), monkeypatch)
        for batch, splits in pinned.items():
            shape = paged.PagedShape(batch, case["heads"], case["kv_heads"], case["head"], 1, case["max_len"],
                                     case["model"], case["kv"])
            assert splits == paged.route(shape, Device(case["sms"], gluon=False)).splits, (case, batch)
            differs += splits != without[batch]
    assert differs > 0


def _write() -> None:  # pragma: no cover - regenerates the pinned digests
    out = {}
    mp = pytest.MonkeyPatch()
    for suite, (make, observe) in SUITES.items():
        out[suite] = {}
        for case in make():
            with mp.context() as ctx:
                out[suite][_key(case)] = _digest(observe(case, ctx))
    GOLDEN.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print({k: len(v) for k, v in out.items()})


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] == ["--write"]:
        _write()
