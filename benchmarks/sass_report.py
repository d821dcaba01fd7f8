"""Compile the Gluon MLA decode kernels for sm_90 without a GPU and report what ptxas made of them.

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0      # no torch needed
    /tmp/t36/bin/python benchmarks/sass_report.py wgmma IS_FP8=1 FP8_PATH=1 NH=16
    /tmp/t36/bin/python benchmarks/sass_report.py regs FROM_RING=1 NUM_STAGES=2 --sass out.sass

Prints registers, spill bytes (``STACK``), shared memory, and counts of the SASS instructions that
decide these kernels' speed (substring counts: ``LDS`` includes ``LDS.128``): global loads, cp.async, shared loads and stores, shuffles, ``HGMMA``,
conversions, barriers, ``MEMBAR``, local-memory spills. A kernel change can be compiled and checked here before it
runs on a GPU: this is how a prefetch that ptxas sank below the products, and an early load that
spilled, were found (docs/MLA.md).

The kernels' modules import torch for their launchers only. This script gives them a stand-in
``torch`` module (dtype names and nothing else), so an environment holding just Triton 3.6 (the
version the Gluon gate accepts) is enough. ``KEY=VALUE`` arguments override the kernel's constexprs;
pointer and stride types are fixed (bf16 query; fp8 e4m3 cache unless ``--cache``, and ``--cache bf16``
sets ``IS_FP8=0`` for the wgmma kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = ["LDG.E.128", "LDGSTS", "LDS.128", "LDS", "STS.128", "STS", "SHFL", "HGMMA", "F2FP", "BAR.SYNC",
            "MEMBAR", "WARPGROUP.DEPBAR", "STL", "LDL"]


def _stub_torch() -> None:
    """A ``torch`` that only names dtypes: the kernel modules compare against them at import time."""
    torch = types.ModuleType("torch")
    for name in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32", "int32", "int64"):
        setattr(torch, name, name)
    torch.Tensor = object
    torch.dtype = object
    torch.cuda = types.SimpleNamespace(get_device_capability=lambda *a: (9, 0), is_available=lambda: False)
    sys.modules["torch"] = torch


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _kernels():
    """(engine wgmma kernel, register-operand experiment kernel, warp-specialized kernel), loaded without torch
    or a GPU."""
    _stub_torch()
    for pkg in ("kvforge", "kvforge.kernels"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    _load("kvforge.kernels.gluon_support", os.path.join(ROOT, "kvforge/kernels/gluon_support.py"))
    paged = types.ModuleType("kvforge.kernels.triton_paged_attention")
    paged._LOG2E, paged._num_sms, paged.merge_split_partials = 1.4426950408889634, None, None
    sys.modules["kvforge.kernels.triton_paged_attention"] = paged
    ws = _load("kvforge.kernels.gluon_mla_decode_ws", os.path.join(ROOT, "kvforge/kernels/gluon_mla_decode_ws.py"))
    sys.modules["kvforge.kernels"].gluon_mla_decode_ws = ws  # ``from kvforge.kernels import gluon_mla_decode_ws``
    wgmma = _load("kvforge.kernels.gluon_mla_decode", os.path.join(ROOT, "kvforge/kernels/gluon_mla_decode.py"))
    regs = _load("exp_regs_mla_decode", os.path.join(ROOT, "benchmarks/exp_regs_mla_decode.py"))
    if not wgmma.HAS_GLUON:
        sys.exit("this Triton has no usable Gluon (the gate wants Triton 3.6); see the docstring")
    return wgmma._wgmma_mla_decode_kernel, regs._regs_mla_decode_kernel, ws._ws_mla_decode_kernel


DEFAULTS = {
    "wgmma": dict(NUM_HEADS=16, NH=16, R=512, P=64, BLOCK_SIZE=64, TILE=64, NUM_STAGES=3, IS_FP8=True,
                  USE_SPLIT=True, FP8_PATH=1, LAZY_RESCALE=True),
    "regs": dict(NUM_HEADS=16, NH=16, BLOCK_SIZE=64, USE_SPLIT=True, FROM_RING=False, NUM_STAGES=2),
    "ws": dict(NUM_HEADS=8, NH=8, BLOCK_SIZE=64, NUM_STAGES=5, CONSUMER_REGS=232, PRODUCER_REGS=40, LAZY=True,
               FP8_SCORE=False),
}
#: Launch options beside num_warps (the warp-specialized experiment sets a register limit).
OPTIONS = {"ws": {"maxnreg": 168}}


def compile_kernel(which: str, overrides: dict, cache: str = "fp8e4nv", num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = dict(zip(("wgmma", "regs", "ws"), _kernels()))[which]
    const = dict(DEFAULTS[which], **overrides)
    if which == "wgmma" and "IS_FP8" not in overrides:
        const["IS_FP8"] = cache.startswith("fp8")
    if which == "wgmma" and "NUM_STAGES" not in overrides:  # the launcher's default_stages
        const["NUM_STAGES"] = 3 if const["IS_FP8"] else 2
    if which == "wgmma" and "LAZY_RESCALE" not in overrides:  # the launcher's lazy_rescale (nh 16 or 32, fp8 regs)
        const["LAZY_RESCALE"] = bool(const["IS_FP8"] and const["NH"] in (16, 32) and const["FP8_PATH"] == 1)
    if which == "wgmma" and "TILE" not in overrides:  # the launcher: 16 tokens per warp
        const["TILE"] = 16 * num_warps
    sig = {"ql_ptr": "*bf16", "qr_ptr": "*bf16", "cache_ptr": f"*{cache}", "out_ptr": "*bf16",
           "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
           "bt_ptr": "*i32", "scale_ptr": "*fp32", "sm_scale_log2": "fp32", "num_splits": "i32"}
    for n in ("stride_qlt", "stride_qlh", "stride_qrt", "stride_qrh", "stride_ot", "stride_oh", "stride_cb",
              "stride_cs", "stride_bt"):
        sig[n] = "i64" if n == "stride_cb" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n.endswith("_ptr") or n.startswith("stride")}
    sig.update({k: "constexpr" for k in const})
    src = GluonASTSource(kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **OPTIONS.get(which, {})})


def report(compiled) -> tuple[str, str]:
    """(a one-line summary, the SASS) of a compiled kernel, through the cuobjdump that ships with Triton."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                           text=True).stdout
    sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = next((line.strip().split(" SHARED")[0] for line in usage.splitlines() if "REG" in line), "?")
    counts = " ".join(f"{p}={sass.count(p)}" for p in PATTERNS)
    return f"{regs} smem={compiled.metadata.shared} {counts}", sass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=sorted(DEFAULTS))
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE constexpr overrides (ints; 0/1 for booleans)")
    ap.add_argument("--cache", default="fp8e4nv", help="cache element type: fp8e4nv, fp8e5, bf16")
    ap.add_argument("--sass", default=None, help="also write the SASS here")
    ap.add_argument("--num-warps", type=int, default=4, help="warps per program (the launcher's num_warps)")
    a = ap.parse_args()
    overrides = {}
    for item in a.overrides:
        key, _, value = item.partition("=")
        overrides[key] = bool(int(value)) if isinstance(DEFAULTS[a.kernel].get(key), bool) else int(value)
    line, sass = report(compile_kernel(a.kernel, overrides, a.cache, a.num_warps))
    print(a.kernel, overrides, line)
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
