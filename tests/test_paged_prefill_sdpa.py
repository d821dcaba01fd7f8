"""``routed_paged_attention`` (kvforge/attention/paged_prefill_sdpa.py): long prefill chunks through torch's
``scaled_dot_product_attention``, the rest of the step through the Triton kernels.

Oracle: float64 causal attention written here, over the dequantized cache (the stored values read back
position by position through the block table, times their head's scale), end-aligned per sequence. Steps
mix a decode row, a chunk one token below the SDPA threshold, a first chunk exactly at it, a later chunk
after cached tokens, a sequence whose prefix blocks are shared with another (a prefix-cache hit), a
sequence with no query token and padding rows. Unused cache blocks hold NaN, so a read outside a
sequence's blocks shows.

Error bound, per sequence, ``||out - ref||_F / ||ref||_F``: 4e-3 for fp16 queries, 2e-2 for bf16 (the
bounds of tests/test_triton_attention.py). Why: the kernels and SDPA both round P and the output to the
model dtype (2^-11 relative each in fp16, 2^-9 in bf16) and accumulate in float32; the SDPA path also
rounds the dequantized fp8 K and V to the model dtype once (the same 2^-11 / 2^-9 per element). Errors of
random sign add in quadrature, a few times the unit roundoff; a wrong block, key, scale or mask gives
1e-1 or more.

Without CUDA the kernels run in Triton's interpreter, whose bf16 ``tl.dot`` is not the GPU's
(tests/triton_kernel_device.py): mixed steps with bf16 queries run on the GPU only; on CPU the SDPA
sequences run torch's math path (or its CPU flash kernel) and bf16 queries are tested on steps that the
SDPA path serves whole.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_kernel_device import (
    BF16_DOT,
    DEVICE,
    INTERPRETED,
    gpu_only,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.attention import paged_prefill_sdpa as mod
from kvforge.attention.fp8 import storage_dtype_name
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import paged as paged_routing
from kvforge.env import Env

pytestmark = requires_kernels


@pytest.fixture(autouse=True)
def _kernels_run_here():
    skip_unless_loaded_loop_bounds_work()

THRESHOLD = paged_routing.SDPA_PREFILL.min_query_len
FP8_MAX = {torch.float8_e4m3fn: 448.0}
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}

#: (cached tokens, new tokens) per sequence: a decode row, a chunk one below the threshold, a first chunk
#: at the threshold, a later chunk after 300 cached tokens, a prefix-cache hit (shares the later chunk's
#: first blocks), a sequence with no query token.
MIXED = [(40, 1), (0, THRESHOLD - 1), (0, THRESHOLD), (300, THRESHOLD + 88), (96, THRESHOLD + 18), (20, 0)]
PREFIX_OF = {4: 3}  # sequence 4's first 96 tokens are sequence 3's (same blocks)
SDPA_SEQS = (2, 3, 4)


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    qsl: list[int]


def make_step(seqs, hq, hkv, d, bs, cache_dtype, q_dtype, seed=0, prefix_of=None, host_lists=True, pad=3):
    """A paged cache holding every sequence's whole context (the step's new rows included, as the model
    runner writes them before attention), shuffled block tables, NaN in every unused block."""
    g = torch.Generator().manual_seed(seed)
    prefix_of = prefix_of or {}
    seq_lens = [c + n for c, n in seqs]
    per = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(per) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(per) + 2), 2**30, dtype=torch.int32)
    fp8 = cache_dtype in FP8_MAX
    k_scale = torch.rand(hkv, generator=g) * 0.3 + 0.05 if fp8 else None
    v_scale = torch.rand(hkv, generator=g) * 0.3 + 0.05 if fp8 else None
    cache = torch.full((num_blocks, 2, hkv, bs, d), float("nan")).to(cache_dtype)
    for i, n in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(per[i])]
        shared = 0
        if i in prefix_of:  # a prefix-cache hit: the cached tokens' whole blocks are the other sequence's
            shared = seqs[i][0] // bs
            ids[:shared] = tables[prefix_of[i], :shared].tolist()
        tables[i, :per[i]] = torch.tensor(ids, dtype=torch.int32)
        for p in range(shared * bs, n):
            kv = torch.randn(2, hkv, d, generator=g)
            if fp8:
                kv = (kv * 2).div(torch.stack([k_scale, v_scale])[:, :, None]).clamp(-448, 448)
            cache[ids[p // bs], :, :, p % bs] = kv.to(cache_dtype)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    t = qsl[-1] + pad
    q = torch.randn(t, hq, d, generator=g).to(q_dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.full((t,), -1, dtype=torch.int64), max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens), block_size=bs,
        host_query_start_loc=tuple(qsl) if host_lists else None, host_seq_lens=tuple(seq_lens) if host_lists else None,
    )  # fmt: skip
    dev = DEVICE
    meta = AttentionMetadata(meta.query_start_loc.to(dev), meta.seq_lens.to(dev), meta.block_tables.to(dev),
                             meta.slot_mapping.to(dev), meta.max_query_len, meta.max_seq_len, bs,
                             meta.host_query_start_loc, meta.host_seq_lens)  # fmt: skip
    return Step(q.to(dev), cache.to(dev), meta, None if k_scale is None else k_scale.to(dev),
                None if v_scale is None else v_scale.to(dev), d ** -0.5, qsl)


def reference(step: Step, window: int = 0) -> list[torch.Tensor | None]:
    """float64 attention per sequence (None for a sequence without query tokens)."""
    cache, meta, bs = step.cache, step.meta, step.meta.block_size
    hq, hkv = step.q.shape[1], cache.shape[2]
    outs = []
    for i, n in enumerate(meta.seq_lens.tolist()):
        a, b = step.qsl[i], step.qsl[i + 1]
        if a == b:
            outs.append(None)
            continue
        pos = torch.arange(n, device=cache.device)
        blk = meta.block_tables[i].long()[pos // bs]
        k = cache[blk, 0, :, pos % bs].double()  # [n, Hkv, D]
        v = cache[blk, 1, :, pos % bs].double()
        if step.k_scale is not None:
            k = k * step.k_scale.double()[:, None]
            v = v * step.v_scale.double()[:, None]
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qpos = torch.arange(n - (b - a), n, device=cache.device)[:, None]
        mask = pos[None] <= qpos
        if window:
            mask &= pos[None] > qpos - window
        scores = torch.einsum("qhd,khd->hqk", step.q[a:b].double(), k) * step.scale
        p = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return outs


def assert_close(step: Step, out: torch.Tensor, ref: list, tol: float) -> None:
    for i, r in enumerate(ref):
        if r is None:
            continue
        got = out[step.qsl[i]:step.qsl[i + 1]].double()
        assert torch.isfinite(got).all(), f"sequence {i}: non-finite output"
        err = (torch.linalg.norm((got - r).flatten()) / torch.linalg.norm(r.flatten())).item()
        assert err < tol, f"sequence {i}: rel err {err:.3e} >= {tol}"


class Spy:
    """Records the sequences the SDPA path attends (their query lengths) and the batches the kernels get;
    ``run_kernels=False``: the kernels' batch is recorded, not run (routing-only tests)."""

    def __init__(self, monkeypatch, run_kernels: bool = True):
        self.sdpa: list[int] = []
        self.kernel: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        attend, kernel = mod._attend_sequence, mod.paged_attention

        def spy_attend(q, *args, **kwargs):
            self.sdpa.append(q.shape[0])
            return attend(q, *args, **kwargs)

        def spy_kernel(q, cache, meta, *args, **kwargs):
            self.kernel.append((tuple(meta.host_lists()[0]), tuple(meta.host_lists()[1])))
            return kernel(q, cache, meta, *args, **kwargs) if run_kernels else torch.zeros_like(q)

        monkeypatch.setattr(mod, "_attend_sequence", spy_attend)
        monkeypatch.setattr(mod, "paged_attention", spy_kernel)


def _dtype_cases():
    mixed_bf16 = pytest.mark.skipif(INTERPRETED, reason=BF16_DOT)
    return [pytest.param(torch.bfloat16, torch.float16, id="bf16-cache-fp16q"),
            pytest.param(torch.float8_e4m3fn, torch.float16, id="e4m3-fp16q"),
            pytest.param(torch.bfloat16, torch.bfloat16, id="bf16", marks=mixed_bf16),
            pytest.param(torch.float8_e4m3fn, torch.bfloat16, id="e4m3-bf16q", marks=mixed_bf16)]


@pytest.mark.parametrize("cache_dtype,q_dtype", _dtype_cases())
@pytest.mark.parametrize("hq,hkv,bs", [pytest.param(2, 2, 16, id="gqa1-block16"),
                                       pytest.param(4, 1, 32, id="gqa4-block32")])
def test_mixed_step_against_float64(monkeypatch, cache_dtype, q_dtype, hq, hkv, bs):
    step = make_step(MIXED, hq, hkv, 32, bs, cache_dtype, q_dtype, seed=hq + bs, prefix_of=PREFIX_OF)
    spy = Spy(monkeypatch)
    out = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    assert out.shape == step.q.shape and out.dtype == q_dtype
    # The three long chunks went through SDPA; the decode row, the chunk below the threshold and the empty
    # sequence through the kernels as one batch of their own (its own query_start_loc and seq_lens).
    assert spy.sdpa == [MIXED[i][1] for i in SDPA_SEQS]
    assert spy.kernel == [((0, 1, THRESHOLD, THRESHOLD), (41, THRESHOLD - 1, 20))]
    assert_close(step, out, reference(step), TOL[q_dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("flash", [False, True], ids=["expanded-heads", "enable-gqa"])
def test_sdpa_only_step_in_bf16(monkeypatch, cache_dtype, flash):
    """Every sequence at or above the threshold: no kernel runs, so bf16 queries run on CPU too. ``flash``:
    the calls take the path of a CUDA device where flash runs (KV heads as they are, all rows in one call);
    else K and V expanded to the query heads, rows in chunks."""
    monkeypatch.setattr(mod, "_flash_takes", lambda q, hkv: flash)
    seqs = [(0, THRESHOLD), (200, THRESHOLD + 7), (16, THRESHOLD)]
    step = make_step(seqs, 8, 2, 64, 16, cache_dtype, torch.bfloat16, seed=5, prefix_of={2: 1})
    spy = Spy(monkeypatch)
    out = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    assert spy.sdpa == [n for _, n in seqs] and spy.kernel == []
    assert_close(step, out, reference(step), TOL[torch.bfloat16])


def test_row_chunks_and_head_groups_match_one_call(monkeypatch):
    """Bounding the scores per call splits the query rows (each chunk attends to the keys up to its last
    position), bounding the gathered bytes splits the KV heads: same rows as one call, to the last bit is
    not guaranteed (the kernels may block differently), so within the fp16 bound."""
    seqs = [(0, THRESHOLD), (130, THRESHOLD + 3)]
    step = make_step(seqs, 6, 3, 32, 16, torch.float8_e4m3fn, torch.float16, seed=11)
    monkeypatch.setattr(mod, "_flash_takes", lambda q, hkv: False)  # the path that bounds rows (flash never does)
    whole = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    monkeypatch.setattr(mod, "SDPA_SCORE_ELEMENTS", 2 * 100 * 700)  # 100-row chunks at 2 heads x ~700 keys
    per_head = paged_routing.sdpa_prefill_kv_bytes_per_head(THRESHOLD + 133, 32, "float16", "fp8_e4m3", 2, 16)
    monkeypatch.setattr(mod, "SDPA_KV_BYTES", per_head)  # one KV head per call
    calls = []
    sdpa = mod.end_aligned_sdpa
    monkeypatch.setattr(mod, "end_aligned_sdpa", lambda q, *a: calls.append(tuple(q.shape)) or sdpa(q, *a))
    chunked = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    # One KV head (2 query heads) per call; rows of 140000 // (2 x 512) = 136 and 140000 // (2 x 645) = 108:
    # 3 x 4 calls for the first sequence, 3 x 5 for the second.
    assert {shape[1] for shape in calls} == {2} and max(shape[2] for shape in calls) == 136
    assert len(calls) == 3 * 4 + 3 * 5
    ref = reference(step)
    assert_close(step, whole, ref, TOL[torch.float16])
    assert_close(step, chunked, ref, TOL[torch.float16])


# ---- what stays on the kernels --------------------------------------------------------------------------


def test_routing_rule():
    r = paged_routing
    args = dict(window=0, head_size=128, query_dtype="bfloat16", sinks=False)
    lens = [1, THRESHOLD - 1, THRESHOLD, 4096]
    ctx = [900, THRESHOLD - 1, THRESHOLD, 8192]
    assert r.sdpa_prefill_sequences(lens, ctx, **args) == (2, 3)
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "sinks": True}) == ()
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "head_size": 512}) == ()
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "query_dtype": "float32"}) == ()
    assert r.sdpa_prefill_sequences(lens, ctx, **args, enabled=False) == ()
    assert r.sdpa_prefill_sequences(lens, ctx, **args, pinned_splits=True) == ()  # a CUDA graph's call
    # A window at least the sequence's length cuts nothing; a shorter one keeps the sequence on the kernels.
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "window": 4096}) == (2,)
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "window": 8192}) == (2, 3)
    assert r.sdpa_prefill_sequences(lens, ctx, **{**args, "window": THRESHOLD - 1}) == ()


def test_threshold_exceeds_every_captured_query_length():
    """Decode and verification graphs capture 1 + num_speculative_tokens query tokens per sequence; their calls
    pin a split count, and their metadata carries no host lists, so neither ever leaves the kernels; the
    threshold is also far above any verification length in use."""
    assert THRESHOLD >= 256


SHORT = [(40, 1), (0, 37), (300, 20)]


@pytest.mark.parametrize("case", ["sinks", "window", "no-host-lists", "named-kernel", "switch-off", "pinned"])
def test_layers_and_calls_that_stay_on_the_kernels(monkeypatch, case):
    """A step with SDPA-length chunks that the rule keeps on the kernels: the kernels get the whole step (the
    kernels' own results are tests/test_triton_attention.py's)."""
    seqs = [(40, 1), (0, THRESHOLD), (100, THRESHOLD + 5)]
    step = make_step(seqs, 4, 2, 32, 16, torch.bfloat16, torch.float16, seed=3, host_lists=case != "no-host-lists")
    spy = Spy(monkeypatch, run_kernels=False)
    kw = {}
    window = 0
    if case == "sinks":
        kw["sinks"] = torch.zeros(4, device=DEVICE)
    elif case == "window":
        window = THRESHOLD - 1  # shorter than both long sequences
    elif case == "named-kernel":
        kw["kernel"] = "tl_dot"
    elif case == "switch-off":
        monkeypatch.setattr(mod, "ENV", Env(disable_sdpa_prefill=True))
    elif case == "pinned":
        kw["num_splits"] = 1
    mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale,
                               window or None, **kw)
    assert spy.sdpa == [] and len(spy.kernel) == 1 and spy.kernel[0][1] == (41, THRESHOLD, THRESHOLD + 105)


def test_window_at_least_the_sequence_takes_sdpa(monkeypatch):
    seqs = [(0, THRESHOLD), (40, 1)]
    step = make_step(seqs, 4, 2, 32, 16, torch.bfloat16, torch.float16, seed=4)
    spy = Spy(monkeypatch)
    out = mod.routed_paged_attention(step.q, step.cache, step.meta, None, None, step.scale, THRESHOLD)
    assert spy.sdpa == [THRESHOLD] and spy.kernel == [((0, 1), (41,))]
    assert_close(step, out, reference(step, THRESHOLD), TOL[torch.float16])


def test_short_step_is_one_kernel_call(monkeypatch):
    step = make_step(SHORT, 4, 2, 32, 16, torch.bfloat16, torch.float16, seed=6)
    spy = Spy(monkeypatch)
    out = mod.routed_paged_attention(step.q, step.cache, step.meta, None, None, step.scale)
    assert spy.sdpa == [] and spy.kernel == [(tuple(step.qsl), (41, 37, 320))]
    assert_close(step, out, reference(step), TOL[torch.float16])


# ---- GPU, realistic sizes ---------------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("seqs", [pytest.param([(0, 4096)], id="4096-new"),
                                  pytest.param([(4096, 4096)], id="4096-after-4096"),
                                  pytest.param([(1000 + 37 * i, 1) for i in range(31)] + [(2048, 4096)],
                                               id="31-decode-and-4096-after-2048")])
def test_gpu_realistic(monkeypatch, cache_dtype, seqs):
    step = make_step(seqs, 32, 8, 128, 16, cache_dtype, torch.bfloat16, seed=len(seqs))
    spy = Spy(monkeypatch)
    out = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    assert spy.sdpa == [4096] and len(spy.kernel) == (1 if len(seqs) > 1 else 0)
    assert_close(step, out, reference(step), TOL[torch.bfloat16])
    tl_dot = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale,
                                        kernel="tl_dot")
    assert_close(step, tl_dot, reference(step), TOL[torch.bfloat16])


# ---- memory -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float8_e4m3fn, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float16)])
def test_gather_peak_is_the_routing_formula(cache_dtype, q_dtype):
    """The bytes the gather holds at once (measured from the allocations) are exactly what the routing
    table's formula says for torch's gather (CPU), which the plan's activation reserve counts; the CUDA
    kernel holds only the model-dtype rows it writes, within the formula."""
    from live_tensor_peak import LiveTensorPeak

    step = make_step([(100, THRESHOLD - 50)], 4, 2, 32, 16, cache_dtype, q_dtype, seed=8)
    n = 100 + THRESHOLD - 50
    blocks = step.meta.block_tables[0, : -(-n // 16)].long()
    scales = mod._kv_scales(step.cache, step.k_scale, step.v_scale, 2)
    with LiveTensorPeak() as m:
        m.ignore(step.cache, blocks, *(() if scales is None else (scales,)))
        kv = mod._gather_kv(step.cache, blocks, n, slice(0, 2), q_dtype, scales)
    assert kv.shape == (n, 2, 2, 32) and kv.dtype == q_dtype
    want = 2 * paged_routing.sdpa_prefill_kv_bytes_per_head(n, 32, storage_dtype_name(q_dtype),
                                                            storage_dtype_name(cache_dtype), 1, 16)
    rows_only = n * 2 * 2 * 32 * q_dtype.itemsize
    assert m.peak == (rows_only if step.cache.is_cuda else want)
    assert m.peak <= want


def test_the_reserve_bounds_an_sdpa_step(monkeypatch):
    """One SDPA sequence (bf16 query over an fp8 cache, the path of a device where flash runs): the live
    bytes of the routed call stay within the output plus what the plan counts for it."""
    from live_tensor_peak import LiveTensorPeak

    from kvforge.planner.activations import _paged_sdpa_prefill
    from kvforge.spec.layers import AttentionLayerSpec

    monkeypatch.setattr(mod, "_flash_takes", lambda q, hkv: True)
    step = make_step([(0, THRESHOLD)], 8, 2, 64, 16, torch.float8_e4m3fn, torch.bfloat16, seed=9, pad=0)
    with LiveTensorPeak() as m:
        m.ignore(step.q, step.cache, step.k_scale, step.v_scale,
                 *(t for t in vars(step.meta).values() if isinstance(t, torch.Tensor)))
        out = mod.routed_paged_attention(step.q, step.cache, step.meta, step.k_scale, step.v_scale, step.scale)
    layer = AttentionLayerSpec(index=0, kind="full", num_heads=8, num_kv_heads=2, head_dim_k=64, head_dim_v=64)
    counted = _paged_sdpa_prefill(layer, THRESHOLD, 1, 2, THRESHOLD, "fp8_e4m3") + out.nbytes
    gathered = 2 * paged_routing.sdpa_prefill_kv_bytes_per_head(THRESHOLD, 64, "bfloat16", "fp8_e4m3")
    if step.cache.is_cuda:  # the gather kernel writes the bf16 rows only
        gathered = THRESHOLD * 2 * 2 * 64 * 2
    assert gathered + out.nbytes <= m.peak <= counted


# ---- the engine on CUDA -------------------------------------------------------------------------------------

#: Logit differences two bf16 engine runs that attend through different kernels may show on the tiny model
#: below (logits of magnitude ~1): its attention outputs differ by a few 2^-9 relative per element between
#: the kernels, which two layers carry into the logits at about 1e-2; 5e-2 leaves room, and a wrong context
#: or mask moves them by far more.
BF16_LOGIT_TOL = 5e-2


@gpu_only
def test_gpu_engine_prefill_through_sdpa_matches_the_kernels(tmp_path, monkeypatch):
    """A bf16 engine with chunked prefill (1024-token budget): a 1600-token prompt runs a first chunk of 1024
    and a later chunk of 576 after 1024 cached tokens through SDPA, beside short prompts and decode rows on
    the kernels; greedy tokens and logprobs agree with the same engine on the kernels alone."""
    from greedy_agreement import assert_outputs_agree

    transformers = pytest.importorskip("transformers")
    from kvforge import LLM, SamplingParams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                                   max_position_embeddings=4096, rms_norm_eps=1e-5)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (1600, 40, 700)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    calls = []
    attend = mod._attend_sequence
    monkeypatch.setattr(mod, "_attend_sequence", lambda q, *a: calls.append(q.shape[0]) or attend(q, *a))

    def run():
        with LLM(str(tmp_path), dtype="bfloat16", block_size=16, skip_tokenizer_init=True, device="cuda",
                 kv_cache_memory=1 << 26, max_num_batched_tokens=1024, max_num_seqs=8, progress=False) as llm:
            return llm.generate(prompts, params, use_tqdm=False)

    routed = run()
    assert {1024, 576} <= set(calls), calls  # the first chunk, and the later one after 1024 cached tokens
    monkeypatch.setattr(mod, "ENV", Env(disable_sdpa_prefill=True))
    calls.clear()
    kernels = run()
    assert calls == []
    assert_outputs_agree(routed, kernels, BF16_LOGIT_TOL)
