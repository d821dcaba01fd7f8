"""The router kernels built for sm_90 on any machine: Triton compiles them for a ``cuda:90`` target ahead of
time (no GPU needed), through the code generator the interpreter skips. Each rule the engine launches must
compile: DeepSeek-V2-Lite's softmax top-k, DeepSeek-V3's sigmoid rule (bias, 8 groups scored by their top
two, 4 kept) and DeepSeek-V2's group-limited softmax, in the choice kernel and the one-launch kernel."""

from __future__ import annotations

import json

import pytest
from compiled_build_report import build_report

from kvforge.kernels.optional_triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

RULES = {  # name -> (experts, k, shared, rule keyword arguments of the kernels)
    "v2-lite softmax": (64, 6, 2, dict()),
    "v3 sigmoid groups": (256, 8, 1, dict(sigmoid=True, n_group=8, topk_group=4, group_top2=True, renorm_eps=1e-20)),
    "kimi sigmoid": (384, 8, 1, dict(sigmoid=True, renorm_eps=1e-20)),
    "v2 group-limited": (160, 6, 2, dict(n_group=8, topk_group=3, renorm_eps=1e-20)),
}


def _compile(fn, consts: dict, floats: tuple[str, ...] = ("scale",)):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name == "ids_ptr" else "*i32" if name == "counter_ptr" else \
                "*bf16" if name == "x_ptr" else "*fp32"
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def _report() -> dict:
    from kvforge.kernels import triton_router_logits_topk as fused
    from kvforge.kernels import triton_router_topk as choice

    out = {}
    for name, (experts, k, shared, kw) in RULES.items():
        consts = choice.choice_constexprs(k, True, shared, experts, has_bias=kw.get("sigmoid", False), **kw)
        built = _compile(choice._router_topk_kernel, consts)
        one = _compile(fused._router_logits_topk_kernel, dict(consts, H=2048, T_PAD=4, BLOCK_H=2048))
        out[name] = [len(built.asm["ptx"]) > 0, len(one.asm["ptx"]) > 0]
    return out


@pytest.fixture(scope="module")
def report():
    return build_report(__file__)


@pytest.mark.parametrize("rule", list(RULES))
def test_builds_for_sm90(rule, report):
    assert report[rule] == [True, True]


if __name__ == "__main__":
    print(json.dumps(_report()))
