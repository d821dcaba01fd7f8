"""``tl`` kernels built for sm_90 on any machine: Triton compiles them for a ``cuda:90`` target ahead of time
(no GPU needed), through the code generator the interpreter skips, so a kernel the interpreter runs but the
compiler rejects fails here, and so does one asking more shared memory than a Hopper gives a program. Each
variant the engine launches for these kernels must compile:

- the router kernels (choice, and logits with the choice in one launch) for DeepSeek-V2-Lite's softmax
  top-k, DeepSeek-V3's sigmoid rule (bias, 8 groups scored by their top two, 4 kept), Kimi's (one group),
  DeepSeek-V2's group-limited softmax and Qwen3-Next's softmax with its sigmoid-gated shared slot;
- the gated RMSNorm of linear-attention outputs in Qwen3-Next's and Kimi-Linear's forms, the delta-rule
  gates at both models' head layouts, the recurrent decode kernel computing those gates itself, its prefill
  storing prefix-cache snapshots inside a sequence, and the
  chunked delta rule's two kernels (per-chunk system and products at its tile, state pass with and without
  snapshots at both of its tiles) at every chunk size, for per-head and per-channel gates, with bf16 and
  float32 inputs at the route's product precision for each, and bf16 inputs at the rounded tf32 products;
- the routed experts' kernel with a program per sorted position (both products of a gated MLP).
"""

from __future__ import annotations

import json

import pytest
from compiled_build_report import build_report

from kvforge.attention.linear_state import SNAPSHOTS_PER_SEQUENCE
from kvforge.kernels.optional_triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

ROUTER_RULES = {  # name -> (experts, k, shared, rule keyword arguments of the kernels)
    "v2-lite softmax": (64, 6, 2, dict()),
    "v3 sigmoid groups": (256, 8, 1, dict(sigmoid=True, n_group=8, topk_group=4, group_top2=True, renorm_eps=1e-20)),
    "kimi sigmoid": (384, 8, 1, dict(sigmoid=True, renorm_eps=1e-20)),
    "v2 group-limited": (160, 6, 2, dict(n_group=8, topk_group=3, renorm_eps=1e-20)),
    "qwen3-next gated shared": (512, 10, 1, dict(gated_shared=True)),
}
#: Pointer element types by argument name (every other pointer float32).
POINTERS = {"ids_ptr": "*i64", "counter_ptr": "*i32", "x_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16",
            "f_ptr": "*bf16", "a_log_ptr": "*bf16", "b_ptr": "*bf16", "beta_ptr": "*bf16", "a_ptr": "*bf16",
            "w_ptr": "*bf16", "bias_ptr": "*bf16", "offs_ptr": "*i32", "src_ptr": "*i64", "expert_ptr": "*i64"}
FLOATS = ("scale", "eps")
#: Integer arguments that are head sizes (128 at the models' shapes): a launch specialises them as multiples of 16.
HEAD_DIMS = ("DK", "DV")


def _compile(fn, consts: dict, pointers: dict | None = None, num_warps: int = 4, num_stages: int = 3):
    """An sm_90 build specialised as a launch at the models' shapes is: pointers 16-byte aligned, strides and
    head sizes multiples of 16. The alignment lets loads be pipelined through shared memory, so only such a
    build asks the shared memory a launch will."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = {**POINTERS, **(pointers or {})}.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
        if name.endswith("_ptr") or name.startswith("stride") or name in HEAD_DIMS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _builds():
    """(name, kernel, compile-time arguments[, pointer types by argument name[, warps]]) of every variant."""
    from kvforge.kernels import triton_delta_gates as gates
    from kvforge.kernels import triton_gated_rms_norm as norm
    from kvforge.kernels import triton_router_logits_topk as fused
    from kvforge.kernels import triton_router_topk as choice

    for name, (experts, k, shared, kw) in ROUTER_RULES.items():
        consts = choice.choice_constexprs(k, True, shared, experts, has_bias=kw.get("sigmoid", False), **kw)
        yield f"router choice, {name}", choice._router_topk_kernel, consts
        yield f"router one launch, {name}", fused._router_logits_topk_kernel, dict(consts, H=2048, T_PAD=8,
                                                                                   BLOCK_H=1024)
    from kvforge.kernels import triton_expert_gemm as experts

    for name, gather, silu in (("gathered inputs", True, False), ("SiLU-and-mul of sorted rows", False, True)):
        yield f"expert gemm per position, {name}", experts._expert_gemm_kernel, dict(
            GATHER=gather, ROWS=experts.ROWS, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, NUM_STAGES=3, HAS_BIAS=False,
            SILU_MUL=silu, BY_POSITION=True)
    for name, silu, rounded in (("qwen3-next", True, True), ("kimi-linear", False, False)):
        yield f"gated norm, {name}", norm._gated_rms_norm_kernel, dict(BLOCK_D=128, ROUND_NORMED=rounded, SILU=silu)
    for name, head_dim, channels, heads in (("qwen3-next", 1, 32, 32), ("kimi-linear", 128, 4096, 32)):
        yield f"delta gates, {name}", gates._delta_gates_kernel, dict(
            HEAD_DIM=head_dim, THRESHOLD=gates.SOFTPLUS_THRESHOLD, BLOCK_C=channels, BLOCK_B=heads)
    from kvforge.attention.routing import delta_rule as route
    from kvforge.kernels import triton_gated_delta_rule as rule

    for name, per_channel, dt_bias in (("qwen3-next", False, "*bf16"), ("kimi-linear", True, "*fp32")):
        yield f"recurrent decode with its gates, {name}", rule._recurrent_kernel, dict(
            BK=128, BV=64, PER_CHANNEL=per_channel, NORMALIZE=True, DECODE=True, HAS_INIT_FLAGS=True,
            STORE_OUT=True, RAW_GATES=True, THRESHOLD=gates.SOFTPLUS_THRESHOLD, SNAPSHOTS=0), dict(
            q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*bf16", slot_ptr="*i32", store_slot_ptr="*i32",
            init_ptr="*i1", qsl_ptr="*i32", dt_bias_ptr=dt_bias)
        yield f"recurrent prefill with snapshots inside it, {name}", rule._recurrent_kernel, dict(
            BK=128, BV=32, PER_CHANNEL=per_channel, NORMALIZE=True, DECODE=False, HAS_INIT_FLAGS=True,
            STORE_OUT=True, RAW_GATES=False, THRESHOLD=gates.SOFTPLUS_THRESHOLD,
            SNAPSHOTS=SNAPSHOTS_PER_SEQUENCE), dict(
            q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*fp32", beta_ptr="*fp32", slot_ptr="*i32",
            store_slot_ptr="*i32", init_ptr="*i1", qsl_ptr="*i32", snap_ptr="*i32")
    prep, states = rule.CHUNK_PREP_TILE, rule.CHUNK_STATE_TILES
    # each input dtype at the route's product precision, and 16-bit inputs at the rounded tf32 form the route
    # may give them
    forms = dict.fromkeys([("bf16", route.product_precision("bfloat16")), ("fp32", route.product_precision("float32")),
                           ("bf16", "tf32-nearest")])
    for inputs, precision in forms:
        chunk_pointers = dict(q_ptr=f"*{inputs}", k_ptr=f"*{inputs}", v_ptr=f"*{inputs}", g_ptr="*fp32",
                              beta_ptr="*fp32", w_ptr="*fp32", slot_ptr="*i32", store_slot_ptr="*i32", init_ptr="*i1",
                              qsl_ptr="*i32", chunk_ptr="*i32", snap_ptr="*i32")
        for bt in sorted(rule.CHUNK_STATE_STAGES):  # at the tiles, warps and stages the engine launches
            for per_channel in (False, True):
                gates = ", per-channel gates" if per_channel else ""
                what = f"chunks of {bt}{gates}, {inputs} inputs ({precision})"
                yield f"chunked delta rule, {what}", rule._chunk_prep_kernel, dict(
                    BT=bt, BK=128, BV=prep.block_v, NORMALIZE=True, PRECISION=precision, PER_CHANNEL=per_channel,
                    BKS=rule.CHUNK_CHANNEL_SLICE), chunk_pointers, prep.num_warps
                for tile, which in ((states.small, "small"), (states.large, "large")):
                    for snapshots in (False, True):
                        state_pass = dict(BT=bt, BK=128, BV=tile.block_v, NORMALIZE=True, HAS_INIT_FLAGS=True,
                                          STORE_OUT=True, PRECISION=precision,
                                          SNAPSHOTS=SNAPSHOTS_PER_SEQUENCE if snapshots else 0,
                                          PER_CHANNEL=per_channel)
                        yield (f"chunked delta rule's state pass, {what}, {which} tile"
                               + (", with snapshots" if snapshots else ""), rule._chunk_state_kernel, state_pass,
                               chunk_pointers, tile.num_warps, rule.CHUNK_STATE_STAGES[bt])


NAMES = [name for name, *_ in _builds()] if HAS_TRITON else []


#: The shared memory one program may ask on sm_90 (227 KB, opted in).
SM90_SHARED_BYTES = 232448


def _report() -> dict:
    """Per build: whether it produced a cubin, and the shared memory a program asks."""
    report = {}
    for name, fn, *rest in _builds():
        kernel = _compile(fn, *rest)
        report[name] = [bool(kernel.asm.get("cubin")), kernel.metadata.shared]
    return report


@pytest.fixture(scope="module")
def report():
    return build_report(__file__)


@pytest.mark.parametrize("name", NAMES)
def test_builds_for_sm90(name, report):
    built, shared = report[name]
    assert built is True
    assert shared <= SM90_SHARED_BYTES, f"{name} asks {shared} bytes of shared memory a program"


if __name__ == "__main__":
    print(json.dumps(_report()))
