"""The PyTorch reference backend object: full, sliding and state layers on any device (see reference.py)."""

from __future__ import annotations

from kvforge.attention import reference
from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.reference_backend import REFERENCE


@register_backend
class TorchReferenceBackend(AttentionBackend):
    """Cache write and causal paged attention in PyTorch, float32 math; one path (its routing table:
    :mod:`kvforge.attention.routing.torch_backends`).

    A step hands every layer the same ``slot_mapping`` tensor and, per KV-cache group, the same metadata:
    what follows from them alone is computed for the first layer and kept, with the objects it belongs to,
    for the layers after it: the slot mapping's targets (``reference.slot_targets``, a read of the slots'
    range on the host) and a decode step's keys per sliding window (``reference.decode_keys``). The runner
    builds new step tensors and metadata every step and never writes into ones it handed over, so an
    object's identity (held, so it cannot be reused) names its values.
    """

    declaration = REFERENCE

    def __init__(self, options):
        super().__init__(options)
        self._targets: tuple | None = None  # (slot_mapping, cache geometry, its SlotTargets)
        self._decode: tuple | None = None  # (metadata, window, device, its DecodeKeys or None)

    def write_cache(self, kv, slot_mapping, k, v):
        cache = kv.cache
        geometry = (cache.shape[0], cache.shape[3], cache.device, cache.shape[2])
        last = self._targets
        if last is not None and last[0] is slot_mapping and last[1] == geometry:
            targets = last[2]
        else:
            targets = reference.slot_targets(slot_mapping, *geometry)
            self._targets = (slot_mapping, geometry, targets)
        reference.write_kv_cache(k, v, cache, slot_mapping, kv.k_scale, kv.v_scale, targets=targets)

    def attend(self, kv, meta, q, *, num_splits=None):
        cache = kv.cache
        last = self._decode
        if last is not None and last[0] is meta and last[1] == kv.window and last[2] == cache.device:
            decode = last[3]
        else:
            decode = reference.decode_keys(meta, kv.window, cache.device)
            self._decode = (meta, kv.window, cache.device, decode)
        return reference.paged_attention(q, cache, meta, kv.k_scale, kv.v_scale, self.options.softmax_scale,
                                         kv.window, sinks=kv.sinks, decode=decode)
