"""The PyTorch reference backend object: full, sliding and state layers on any device (see reference.py)."""

from __future__ import annotations

from kvforge.attention import reference
from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.reference_backend import REFERENCE


@register_backend
class TorchReferenceBackend(AttentionBackend):
    """Cache write and causal paged attention in PyTorch, float32 math; one path (its routing table:
    :mod:`kvforge.attention.routing.torch_backends`)."""

    declaration = REFERENCE

    def write_cache(self, kv, slot_mapping, k, v):
        reference.write_kv_cache(k, v, kv.cache, slot_mapping, kv.k_scale, kv.v_scale)

    def attend(self, kv, meta, q, *, num_splits=None):
        return reference.paged_attention(q, kv.cache, meta, kv.k_scale, kv.v_scale, self.options.softmax_scale,
                                         kv.window, sinks=kv.sinks)
