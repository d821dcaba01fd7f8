"""The Triton MLA backend object (CUDA): latent cache write (with the latent's norm and rope where the model
hands its rows over before them) and MLA attention through the kernels its
routing table (:mod:`kvforge.attention.routing.mla`) picks; prefill steps by the engine's
``mla_prefill_mode``."""

from __future__ import annotations

from kvforge.attention import triton_mla
from kvforge.attention.backends.base import AttentionBackend, register_backend
from kvforge.attention.routing import mla as mla_routing
from kvforge.attention.triton_mla_backend import TRITON_MLA
from kvforge.kernels.triton_mla_rows import norm_rope_write_mla

#: Whether an MLA layer's latent norm and rope run inside its cache write (one launch where there were
#: three); assign before the engine captures its CUDA graphs.
FUSE_MLA_ROWS = True


@register_backend
class TritonMLABackend(AttentionBackend):
    declaration = TRITON_MLA
    captures_cuda_graphs = True

    @property
    def fuses_mla_rows(self) -> bool:
        return FUSE_MLA_ROWS

    def write_cache(self, kv, slot_mapping, latent, k_rope):
        triton_mla.write_mla_cache(latent, k_rope, kv.cache, slot_mapping, kv.k_scale)

    def norm_rope_and_write_mla(self, kv, slot_mapping, q_rope, kv_rows, norm_weight, eps, cos, sin, interleaved):
        return norm_rope_write_mla(q_rope, kv_rows, norm_weight, eps, cos, sin, interleaved, kv.cache, slot_mapping,
                                   kv.k_scale)

    def attend(self, kv, meta, q_nope, q_rope, w_uk, w_uv, *, num_splits=None):
        return triton_mla.mla_attention(q_nope, q_rope, kv.cache, meta, kv.k_scale, self.options.softmax_scale,
                                        w_uk, w_uv, query_dtype=kv.query_dtype, num_splits=num_splits,
                                        prefill_mode=self.options.mla_prefill_mode)  # fmt: skip

    def graph_num_splits(self, layers, batch, context, query_len=1):
        """The first decode candidate's count at ``context`` for the first layer; the Gluon kernels only
        where every layer is in their scope (one count serves every layer of the graph). Without the
        model's latent width (``options.latent_dim``) the Gluon kernels are not assumed. A verification graph
        (``query_len > 1``) attends each query token as a decode query over its causal prefix: ``batch x
        query_len`` decode rows."""
        opts, device = self.options, self.options.device
        batch *= query_len
        latent = opts.latent_dim
        gluon = device.gluon and latent is not None and all(
            mla_routing.wgmma_accepts(self._decode_shape(layer, batch, context), self._query(layer))
            for layer in layers)  # fmt: skip
        first = self._decode_shape(layers[0], batch, context)
        return mla_routing.pinned_splits(batch, first.num_heads, first.latent_dim, first.rope_dim, context,
                                         first.model_dtype, first.kv_dtype, self._query(layers[0]),
                                         type(device)(device.num_sms, gluon))  # fmt: skip

    def _query(self, layer) -> str | None:
        return None if layer.query_dtype == self.options.model_dtype else layer.query_dtype

    def _decode_shape(self, layer, batch: int, context: int) -> mla_routing.MLAShape:
        latent = self.options.latent_dim or 0
        return mla_routing.MLAShape(batch, layer.heads_per_rank, latent, (layer.head_size or 0) - latent,
                                    context, self.options.model_dtype, layer.kv_dtype, self._query(layer))

    def description(self) -> str:
        return f"{self.name} (MLA prefill mode {self.options.mla_prefill_mode})"
