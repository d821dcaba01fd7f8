"""The PyTorch MLA reference backend object: MLA layers on any device (see mla_reference.py)."""

from __future__ import annotations

from kvforge.attention import mla_reference
from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.mla_reference_backend import MLA_REFERENCE


@register_backend
class MLAReferenceBackend(AttentionBackend):
    """Latent cache write and MLA attention in PyTorch: absorbed decode, expanded prefill; one path each (its
    routing table: :mod:`kvforge.attention.routing.torch_backends`)."""

    declaration = MLA_REFERENCE

    def write_cache(self, kv, slot_mapping, latent, k_rope):
        mla_reference.write_mla_cache(latent, k_rope, kv.cache, slot_mapping, kv.k_scale)

    def attend(self, kv, meta, q_nope, q_rope, w_uk, w_uv, *, num_splits=None):
        return mla_reference.mla_attention(q_nope, q_rope, kv.cache, meta, kv.k_scale, self.options.softmax_scale,
                                           w_uk, w_uv, query_dtype=kv.query_dtype, num_splits=num_splits)
