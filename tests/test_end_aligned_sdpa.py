"""Torch's fused attention for end-aligned query chunks (kvforge/attention/end_aligned_sdpa.py), the call both
prefill paths that leave the Triton kernels make: the alignment against a float64 masked softmax written out
here, and the backends torch may pick (cuDNN only when asked: it builds a plan per new shape) in the paged
and the MLA prefill alike."""

from __future__ import annotations

import torch

from kvforge.attention import end_aligned_sdpa as mod


def _reference(q, k, v, scale):
    """float64: query ``j`` of ``m`` sees keys ``0 .. n - m + j``."""
    m, n = q.shape[2], k.shape[2]
    s = scale * q.double() @ k.double().transpose(-1, -2)
    seen = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
    return torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1) @ v.double()


def test_chunks_attend_to_their_causal_prefix():
    """A 3-row chunk after 4 cached positions (lower-right mask) and a whole 5-row sequence (``is_causal``),
    against the formula; with GQA, each KV head serves two query heads."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 7, 7))
    assert torch.allclose(mod.end_aligned_sdpa(q, k, v, 0.3).double(), _reference(q, k, v, 0.3), atol=1e-6)
    q5 = torch.randn(1, 4, 5, 8, generator=g)
    kv = k[:, :, :5]
    got = mod.end_aligned_sdpa(q5, kv, kv, 0.3, gqa=True).double()
    want = _reference(q5, kv.repeat_interleave(2, dim=1), kv.repeat_interleave(2, dim=1), 0.3)
    assert torch.allclose(got, want, atol=1e-6)


def test_cudnn_attention_only_when_asked(monkeypatch):
    """The calls run with torch's cuDNN attention disabled unless KVFORGE_SDPA_PREFILL_CUDNN is set; flash
    stays allowed. The MLA prefill's expanded path goes through the same call (it once called torch
    directly, and cuDNN built a plan for every new prompt length)."""
    from torch.nn.attention import SDPBackend

    from kvforge.attention import mla_prefill_sdpa
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.attention.mla_reference import write_mla_cache
    from kvforge.env import read_env

    assert SDPBackend.CUDNN_ATTENTION not in mod.SDPA_BACKENDS and SDPBackend.FLASH_ATTENTION in mod.SDPA_BACKENDS
    assert read_env({"KVFORGE_SDPA_PREFILL_CUDNN": "1"}).sdpa_prefill_cudnn
    assert not read_env({}).sdpa_prefill_cudnn
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    mod.end_aligned_sdpa(q, k, k, 0.3)  # after 2 cached positions: the lower-right mask
    mod.end_aligned_sdpa(q, k[:, :, :3], k[:, :, :3], 0.3)  # no cached prefix: is_causal
    assert seen == [(False, True), (False, True)]

    seen.clear()
    g = torch.Generator().manual_seed(1)
    heads, rank, rope, bs = 2, 16, 8, 4
    cache = torch.zeros(3, bs, rank + rope)
    write_mla_cache(torch.randn(6, rank, generator=g), torch.randn(6, rope, generator=g), cache,
                    torch.arange(6), None)
    meta = AttentionMetadata(torch.tensor([0, 6], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                             torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(6), 6, 6, bs)
    mla_prefill_sdpa.mla_prefill_sdpa(torch.randn(6, heads, 8, generator=g), torch.randn(6, heads, rope, generator=g),
                                      cache, meta, None, 0.2, torch.randn(heads, 8, rank, generator=g),
                                      torch.randn(heads, 8, rank, generator=g))
    assert seen == [(False, True)]
