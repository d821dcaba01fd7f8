"""The warp-specialized MLA decode kernel built for sm_90 on any machine: Triton compiles the Gluon kernel
for a ``cuda:90`` target ahead of time (no GPU needed) and the ptxas that ships with Triton reports its
registers. Each variant the engine can launch (8 and 16 heads a program; the fp16 register product, the
one-term e4m3 query, the two-term bf16 query) must compile (its layout conversions are asserted trivial at
compile time), fit in an H100/H200 SM's shared memory, and spill no more than it did when its speed was
measured (docs/BENCHMARKS.md): a spill in the consumer's loop costs throughput that only a GPU would show.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from compiled_build_report import build_report

from kvforge.kernels.gluon_support import HAS_GLUON

pytestmark = pytest.mark.skipif(not HAS_GLUON, reason="needs Triton with Gluon")

#: Opt-in shared memory of one sm_90 SM (227 KB).
SM90_SHARED_BYTES = 232448
#: (heads a program, score product) -> spill-store bytes ptxas reported for the measured kernel.
SPILL_BUDGET = {
    (8, "registers"): 64, (16, "registers"): 96,
    (8, "e4m3 query"): 0, (16, "e4m3 query"): 0,
    (8, "two terms"): 4, (16, "two terms"): 12,
}
POINTERS = dict(ql_ptr="*bf16", qr_ptr="*bf16", cache_ptr="*fp8e4nv", out_ptr="*bf16", part_acc_ptr="*fp32",
                part_ml_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32", scale_ptr="*fp32")


def _build(nh: int, product: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvforge.kernels import gluon_mla_decode_ws as ws

    fn = ws._ws_mla_decode_kernel
    consts = dict(NUM_HEADS=nh, NH=nh, BLOCK_SIZE=64, NUM_STAGES=ws.NUM_STAGES, CONSUMER_REGS=ws.CONSUMER_REGS,
                  PRODUCER_REGS=ws.PRODUCER_REGS, LAZY=True, FP8_SCORE=product != "registers",
                  TWO_TERMS=product == "two terms")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "sm_scale_log2":
            signature[name] = "fp32"
        else:  # integers; the strides are multiples of 16 in the engine's tensors
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=ws.MAXNREG))


def _spill_store_bytes(ptx: str, workdir: Path) -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    src = workdir / "kernel.ptx"
    src.write_text(ptx)
    report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(workdir / "k.cubin")],
                            capture_output=True, text=True, check=True).stderr  # fmt: skip
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))


def _report() -> dict:
    """Every variant's shared memory and spill-store bytes (run in a process without the interpreter)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nh, product in SPILL_BUDGET:
            kernel = _build(nh, product)
            out[f"{nh} {product}"] = (kernel.metadata.shared, _spill_store_bytes(kernel.asm["ptx"], Path(tmp)))
    return out


@pytest.fixture(scope="module")
def report():
    return build_report(__file__)


@pytest.mark.parametrize("product", ["registers", "e4m3 query", "two terms"])
@pytest.mark.parametrize("nh", [8, 16])
def test_builds_for_sm90_within_shared_memory_and_spill_budget(nh, product, report):
    shared, spilled = report[f"{nh} {product}"]
    assert shared <= SM90_SHARED_BYTES, (nh, product, shared)
    assert spilled <= SPILL_BUDGET[(nh, product)], (nh, product, spilled)


if __name__ == "__main__":
    print(json.dumps(_report()))
