"""The Triton paged-attention backend object (CUDA): cache write (with rope on q and k where the model hands
them over before rope) and paged attention through the kernels
its routing table (:mod:`kvforge.attention.routing.paged`) picks, long prefill chunks through torch's fused
attention where the table sends them (:mod:`kvforge.attention.paged_prefill_sdpa`)."""

from __future__ import annotations

from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.paged_prefill_sdpa import routed_paged_attention
from kvforge.attention.routing import paged as paged_routing
from kvforge.attention.triton_backend import TRITON_PAGED
from kvforge.kernels.triton_cache_write import write_kv_cache
from kvforge.kernels.triton_rope_cache_write import rope_and_write_kv

#: Rope on q and k and the cache write of k and v as one kernel (kvforge/kernels/triton_rope_cache_write.py);
#: False: the rope kernel, then the write kernel.
FUSE_ROPE_WITH_CACHE_WRITE = True


@register_backend
class TritonPagedBackend(AttentionBackend):
    declaration = TRITON_PAGED
    captures_cuda_graphs = True

    @property
    def fuses_rope_with_cache_write(self) -> bool:
        return FUSE_ROPE_WITH_CACHE_WRITE

    def write_cache(self, kv, slot_mapping, k, v):
        write_kv_cache(k, v, kv.cache, slot_mapping, kv.k_scale, kv.v_scale)

    def rope_and_write_cache(self, kv, slot_mapping, q, k, v, cos, sin, rotary_dim):
        return rope_and_write_kv(q, k, v, cos, sin, rotary_dim, kv.cache, slot_mapping, kv.k_scale, kv.v_scale)

    def attend(self, kv, meta, q, *, num_splits=None):
        return routed_paged_attention(q, kv.cache, meta, kv.k_scale, kv.v_scale, self.options.softmax_scale,
                                      kv.window, num_splits=num_splits, sinks=kv.sinks)

    def graph_num_splits(self, layers, batch, context, query_len=1):
        """The routing table's count at ``context`` for the first layer's shape; the Gluon rows only
        where every layer is in their scope, which layers with attention sinks are not (one count serves every
        layer of the graph)."""
        device = self.options.device
        shapes = [self._decode_shape(layer, batch, context, query_len) for layer in layers]
        gluon = device.gluon and all(paged_routing.applies(paged_routing.GLUON_FP8_CTA, s, device) for s in shapes)
        first = shapes[0]
        return paged_routing.pinned_splits(batch, first.num_q_heads, first.num_kv_heads, first.head_size,
                                           context, first.query_dtype, first.kv_dtype,
                                           type(device)(device.num_sms, gluon), first.sinks,
                                           query_len)  # fmt: skip

    def _decode_shape(self, layer, batch: int, context: int, query_len: int = 1) -> paged_routing.PagedShape:
        return paged_routing.PagedShape(batch, layer.heads_per_rank, layer.kv_heads_per_rank, layer.head_size,
                                        query_len, context, self.options.model_dtype, layer.kv_dtype, sinks=layer.sinks)
