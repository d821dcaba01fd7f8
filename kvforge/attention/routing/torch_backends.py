"""Routing tables of the backends with one path each: the PyTorch references and the ring.

They run no Triton kernel and take no split count, so each table is one row; they are listed so that every
backend has a table (docs/ROUTING.md renders them all).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TorchPath:
    name: str
    runs: str  # "module:function"
    when: str


TORCH_REFERENCE: tuple[TorchPath, ...] = (
    TorchPath("torch_paged", "kvforge.attention.reference:paged_attention",
              "every step (float32 math; short queries batched, long ones per sequence)"),
)
MLA_REFERENCE: tuple[TorchPath, ...] = (
    TorchPath("torch_mla_decode", "kvforge.attention.mla_reference:mla_decode", "decode-only steps (absorbed)"),
    TorchPath("torch_mla_prefill", "kvforge.attention.mla_reference:mla_prefill", "steps with a prefill chunk "
              "(expanded, float32)"),
)
RING: tuple[TorchPath, ...] = (
    TorchPath("ring_write", "kvforge.attention.backends.ring:RingBackend.write_cache",
              "every step (write-only: the last rows of each request)"),
)
