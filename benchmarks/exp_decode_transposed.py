"""Experiment: transposed-formulation decode kernel (tokens as M) vs the general kernel.

    PYTHONUNBUFFERED=1 python3 benchmarks/exp_decode_transposed.py [--out DIR] [--check-only]

Correctness first (every variant against a float64 reference over the dequantized cache),
then CUDA-graph timings side by side with the general kernel for bf16 and fp8 caches,
token-major and dim-major V pages. Outcome (H200, 2026-11-30): slower than the general kernel everywhere; docs/KERNELS.md item 6.

The kernel:

The general kernel (:mod:`kvforge.kernels.triton_paged_attention`) computes
``S = Q K^T`` and ``O = P V`` with the query heads as the M dimension. For an
fp8 cache the ``P V`` product then needs V as a *B* operand that is
contiguous along N (head dim), and Hopper has no 8-bit transposing shared
memory load, so Triton reads V byte by byte (docs/KERNELS.md, "Why fp8 is
stuck").

Here the roles swap: tokens are the M dimension.

    S^T [TILE_N, G] = K [TILE_N, D] @ Q^T [D, G]        (K: A operand, D contiguous = K-major)
    O^T [D, G]     += V^T [D, TILE_N] @ P^T [TILE_N, G] (V^T: A operand)

``V^T`` is K-major (tokens contiguous) only when V pages are stored
*dim-major* (``[head_dim, block_size]`` per KV head, ``V_DIM_MAJOR``); with
the normal token-major V pages it is loaded transposed. Both layouts are
kept so the benchmark can tell the formulation and the layout apart.

Decode only: one query token per sequence (``max_query_len == 1``), split-K
partials merged by the general module's merge kernel. Invariants as in the
general kernel: block ids int32, every offset product int64, fp8 ``k_scale``
folded into the softmax scale, ``v_scale`` applied to the accumulator once.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.kernels.triton_paged_attention import (  # noqa: E402
    _FP8,
    _LOG2E,
    _num_sms,
    merge_split_partials,
    paged_attention,  # noqa: E402
)

_LAST_LAUNCH: dict = {}  # diagnostics: the last compiled kernel (n_regs)

if True:  # the experiment needs triton

    @triton.jit
    def _decode_t_kernel(
        q_ptr,
        kv_ptr,
        part_acc_ptr,
        part_ml_ptr,
        seq_lens_ptr,
        bt_ptr,
        k_scale_ptr,
        v_scale_ptr,
        qk_scale_log2,
        num_splits,
        stride_qt,
        stride_qh,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        stride_bt,
        NUM_Q_HEADS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IS_FP8: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        DOT_F16: tl.constexpr,
        V_DIM_MAJOR: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        seq_len = tl.load(seq_lens_ptr + seq)
        g = tl.arange(0, G_PAD)
        g_ok = g < G
        qh64 = (kvh * G + g).to(tl.int64)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_D
        seq64 = seq.to(tl.int64)

        # Q^T [D_PAD, G_PAD]
        qt = tl.load(
            q_ptr + seq64 * stride_qt + qh64[None, :] * stride_qh + d[:, None],
            mask=g_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if DOT_F16:
            qt = qt.to(tl.float16)
        qk_scale = qk_scale_log2
        if IS_FP8:
            qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)

        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)

        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc_t = tl.zeros([D_PAD, G_PAD], dtype=tl.float32)

        kv_base = kv_ptr + kvh.to(tl.int64) * stride_ch
        bt_row = bt_ptr + seq64 * stride_bt
        n_off = tl.arange(0, TILE_N)
        for start in range(lo, hi, TILE_N):
            pos = start + n_off
            p_ok = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
            in_blk = (pos % BLOCK_SIZE).to(tl.int64)
            page = blk * stride_cb
            if HEAD_D == D_PAD:
                k_mask = p_ok[:, None]
                vt_mask = p_ok[None, :]
            else:
                k_mask = p_ok[:, None] & d_ok[None, :]
                vt_mask = p_ok[None, :] & d_ok[:, None]
            k = tl.load(kv_base + (page + in_blk * stride_cs)[:, None] + d[None, :], mask=k_mask, other=0.0)
            if V_DIM_MAJOR:
                vt = tl.load(
                    kv_base + stride_ckv + (page + in_blk)[None, :] + (d * BLOCK_SIZE)[:, None],
                    mask=vt_mask,
                    other=0.0,
                )
            else:
                vt = tl.load(
                    kv_base + stride_ckv + (page + in_blk * stride_cs)[None, :] + d[:, None],
                    mask=vt_mask,
                    other=0.0,
                )
            k = k.to(qt.dtype)
            if IEEE_DOT:
                s_t = tl.dot(k, qt, input_precision="ieee")
            else:
                s_t = tl.dot(k, qt)
            s_t = tl.where(p_ok[:, None], s_t * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p_t = tl.exp2(s_t - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p_t, 0)
            vt = vt.to(qt.dtype)
            if IEEE_DOT:
                acc_t = acc_t * alpha[None, :] + tl.dot(vt, p_t.to(qt.dtype), input_precision="ieee")
            else:
                acc_t = acc_t * alpha[None, :] + tl.dot(vt, p_t.to(qt.dtype))
            m_i = m_new

        if IS_FP8:
            acc_t = acc_t * tl.load(v_scale_ptr + kvh)
        # partials: acc [T, Hq, S, D_PAD] fp32, ml [T, Hq, S, 2] fp32 (T = seq: one token each)
        pidx = (seq64 * NUM_Q_HEADS + qh64) * num_splits + split
        tl.store(part_acc_ptr + pidx[None, :] * D_PAD + d[:, None], acc_t, mask=g_ok[None, :])
        tl.store(part_ml_ptr + pidx * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=g_ok)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K factor: ~4 CTAs per SM, no split shorter than 256 tokens, at most 64."""
    progs = num_seqs * num_kv_heads
    target = 4 * _num_sms(device)
    return max(1, min(math.ceil(target / progs), max(1, max_seq_len // 256), 64))


def paged_decode_transposed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    *,
    v_dim_major: bool = False,
    num_splits: int | None = None,
    tile_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Decode attention (one query token per sequence) over ``kv_cache``; see the module docstring.

    ``v_dim_major``: the cache's V pages hold ``[head_dim, block_size]`` (the tensor
    shape is unchanged; only the meaning of the last two axes of ``kv_cache[:, 1]``).
    """
    T, hq, d = q.shape
    nb, two, hkv, bs, c_d = kv_cache.shape
    if two != 2 or c_d != d or hq % hkv:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match q {tuple(q.shape)}")
    if meta.max_query_len != 1 or T != meta.num_seqs:
        raise ValueError("paged_decode_transposed handles decode batches only (one token per sequence)")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or kv_cache.stride(3) != d:
        raise ValueError("q and kv_cache need contiguous pages and head_dim axis")
    if out is None:
        out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    is_fp8 = kv_cache.dtype in _FP8
    if is_fp8:
        k_scale = k_scale.to(torch.float32).reshape(-1).expand(hkv).contiguous()
        v_scale = v_scale.to(torch.float32).reshape(-1).expand(hkv).contiguous()
    else:
        k_scale = v_scale = meta.seq_lens
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    d_pad = max(16, triton.next_power_of_2(d))
    splits = num_splits or decode_num_splits(T, hkv, meta.max_seq_len, q.device)
    part_acc = torch.empty((T, hq, splits, d_pad), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((T, hq, splits, 2), dtype=torch.float32, device=q.device)
    _LAST_LAUNCH["attn"] = _decode_t_kernel[(T, hkv, splits)](
        q,
        kv_cache,
        part_acc,
        part_ml,
        meta.seq_lens,
        meta.block_tables,
        k_scale,
        v_scale,
        float(softmax_scale) * _LOG2E,
        splits,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        NUM_Q_HEADS=hq,
        G=g,
        G_PAD=g_pad,
        HEAD_D=d,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        TILE_N=tile_n,
        IS_FP8=is_fp8,
        IEEE_DOT=q.dtype == torch.float32,
        DOT_F16=is_fp8 and q.dtype != torch.float32,
        V_DIM_MAJOR=v_dim_major,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, T)
    return out


DEV = os.environ.get("KVFORGE_TRITON_TEST_DEVICE", "cuda")


def make_case(batch, ctx, hq, hkv, d, bs, dtype, seed=0):
    nblk_seq = math.ceil(ctx / bs)
    nblk = batch * nblk_seq
    g = torch.Generator(device=DEV).manual_seed(seed)
    cache = torch.empty((nblk, 2, hkv, bs, d), dtype=dtype, device=DEV)
    chunk = max(1, (1 << 28) // (2 * hkv * bs * d))
    for s in range(0, nblk, chunk):
        e = min(nblk, s + chunk)
        cache[s:e] = torch.randn((e - s, 2, hkv, bs, d), device=DEV, generator=g).to(dtype)
    perm = torch.randperm(nblk, device=DEV, generator=g).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    if batch > 1:
        lens[0] = max(1, ctx // 3)  # ragged
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=lens,
        block_tables=perm.view(batch, nblk_seq),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEV),
        max_query_len=1,
        max_seq_len=ctx,
        block_size=bs,
    )
    return cache, meta


def dim_major_v(cache):
    out = cache.clone()
    nb, _, hkv, bs, d = cache.shape
    out[:, 1] = cache[:, 1].transpose(-1, -2).contiguous().view(nb, hkv, bs, d)
    return out


def reference(q, cache, meta, ks, vs, scale):
    """float64 attention over the dequantized cache (token-major layout)."""
    outs = []
    hq, hkv = q.shape[1], cache.shape[2]
    bs = cache.shape[3]
    for i in range(meta.num_seqs):
        L = int(meta.seq_lens[i])
        blocks = meta.block_tables[i, : math.ceil(L / bs)].long()
        kv = cache[blocks].double()  # [nb, 2, hkv, bs, d]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(hkv, -1, kv.shape[-1])[:, :L] * ks.double().view(-1, 1, 1)
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(hkv, -1, kv.shape[-1])[:, :L] * vs.double().view(-1, 1, 1)
        k = k.repeat_interleave(hq // hkv, 0)
        v = v.repeat_interleave(hq // hkv, 0)
        s = torch.einsum("hd,hnd->hn", q[i].double(), k) * scale
        outs.append(torch.einsum("hn,hnd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def check(out_rows):
    cases = [  # batch, ctx, hq, hkv, d, bs, kv dtype, q dtype
        (3, 77, 8, 2, 64, 16, torch.float32, torch.float32),
        (3, 300, 32, 8, 128, 16, torch.float16, torch.float16),
        (2, 1000, 9, 3, 96, 32, torch.float16, torch.float16),
    ]
    if DEV == "cuda":
        cases += [
            (33, 1000, 32, 8, 128, 16, torch.bfloat16, torch.bfloat16),
            (33, 1000, 32, 8, 128, 16, torch.float8_e4m3fn, torch.bfloat16),
            (4, 33000, 64, 8, 128, 16, torch.float8_e5m2, torch.bfloat16),
            (5, 517, 16, 16, 256, 64, torch.float8_e4m3fn, torch.float16),
            (5, 517, 4, 1, 64, 16, torch.bfloat16, torch.bfloat16),
        ]
    worst = 0.0
    for batch, ctx, hq, hkv, d, bs, kvdt, qdt in cases:
        cache, meta = make_case(batch, ctx, hq, hkv, d, bs, kvdt)
        q = torch.randn(batch, hq, d, device=DEV).to(qdt)
        ks = torch.rand(hkv, device=DEV) + 0.5
        vs = torch.rand(hkv, device=DEV) + 0.5
        if kvdt not in (torch.float8_e4m3fn, torch.float8_e5m2):
            ks = vs = torch.ones(hkv, device=DEV)
        scale = 1 / math.sqrt(d)
        ref = reference(q, cache, meta, ks, vs, scale)
        for vdm in (False, True):
            c = dim_major_v(cache) if vdm else cache
            o = paged_decode_transposed(q, c, meta, ks, vs, scale, v_dim_major=vdm).double()
            err = ((o - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            bound = 1e-4 if qdt == torch.float32 else 2e-2
            row = dict(kind="check", batch=batch, ctx=ctx, hq=hq, hkv=hkv, d=d, bs=bs, kv=str(kvdt), vdm=vdm, err=err,
                       ok=err < bound)
            out_rows.append(row)
            print(row, flush=True)
            assert err < bound, row
    return worst


def bench(fn, rep=50):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    med, lo, hi = do_bench(gr.replay, warmup=25, rep=rep, quantiles=[0.5, 0.0, 1.0])
    return med * 1e3, lo * 1e3, hi * 1e3


def timings(out_rows):
    hq, hkv, d, bs = 32, 8, 128, 16
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t_copy = bench(functools.partial(y.copy_, x))[0]
    copy_bw = 2 * x.numel() / (t_copy * 1e-6)
    del x, y
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    variants = {
        "t128w4s3": dict(tile_n=128, num_warps=4, num_stages=3),
        "t64w4s3": dict(tile_n=64, num_warps=4, num_stages=3),
        "t128w8s3": dict(tile_n=128, num_warps=8, num_stages=3),
        "t64w4s4": dict(tile_n=64, num_warps=4, num_stages=4),
        "t128w4s2": dict(tile_n=128, num_warps=4, num_stages=2),
    }
    for batch, ctx in ((64, 8192), (256, 8192), (8, 8192), (64, 32768), (1, 32768), (256, 1024)):
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        cache_bf, meta = make_case(batch, ctx, hq, hkv, d, bs, torch.bfloat16)
        meta.seq_lens.fill_(ctx)
        ones = torch.ones(hkv, device="cuda")
        scale = 1 / math.sqrt(d)
        for kvname, cache in (("bf16", cache_bf), ("e4m3", cache_bf.to(torch.float8_e4m3fn))):
            elem = cache.element_size()
            nbytes = batch * ctx * hkv * d * 2 * elem + 2 * batch * hq * d * 2
            base = bench(functools.partial(paged_attention, q, cache, meta, ones, ones, scale))
            row = dict(kind="time", batch=batch, ctx=ctx, kv=kvname, variant="general", us=base[0], min=base[1],
                       max=base[2], pct_copy=100 * nbytes / (base[0] * 1e-6) / copy_bw)
            out_rows.append(row)
            print(f"{batch:4d} {ctx:6d} {kvname:5s} {'general':22s} {base[0]:8.1f} us {row['pct_copy']:5.1f}%",
                  flush=True)
            cache_vt = dim_major_v(cache)
            for vdm in (False, True):
                c = cache_vt if vdm else cache
                for name, cfg in variants.items():
                    if not vdm and name != "t128w4s3":
                        continue
                    fn = functools.partial(paged_decode_transposed, q, c, meta, ones, ones, scale,
                                           v_dim_major=vdm, **cfg)
                    try:
                        t = bench(fn)
                    except Exception as e:  # noqa: BLE001
                        print("fail", name, vdm, type(e).__name__, str(e)[:300], flush=True)
                        continue
                    regs = getattr(_LAST_LAUNCH.get("attn"), "n_regs", None)
                    vname = ("vdm_" if vdm else "vtok_") + name
                    row = dict(kind="time", batch=batch, ctx=ctx, kv=kvname, variant=vname, us=t[0], min=t[1],
                               max=t[2], regs=regs, vs_general=base[0] / t[0],
                               pct_copy=100 * nbytes / (t[0] * 1e-6) / copy_bw)
                    out_rows.append(row)
                    print(f"{batch:4d} {ctx:6d} {kvname:5s} {vname:22s} {t[0]:8.1f} us {row['pct_copy']:5.1f}% "
                          f"x{base[0] / t[0]:.2f} regs {regs}", flush=True)
            del cache_vt
        del cache_bf
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    rows = []
    worst = check(rows)
    print(f"worst check error {worst:.2e}", flush=True)
    if not args.check_only:
        timings(rows)
    with open(os.path.join(args.out, "exp_decode_transposed.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
