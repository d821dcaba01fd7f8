"""CUDA graphs for decode-only steps.

A decode-only step (every scheduled sequence brings exactly one new token) of
``n`` sequences replays the graph captured for the smallest capture size
``B >= n``; larger batches, prefill and mixed steps run eagerly. The graph
covers the model forward (embedding, every layer with its KV write and paged
attention, final norm); the LM head and sampling run eagerly after it.

Invariants (what makes a replay equal to an eager step):

1. **Static inputs.** One set of device buffers sized for the largest capture
   size ``Bmax``: ``i64[3, Bmax]`` (token ids, positions, slots),
   ``seq_lens[Bmax]``, ``query_start_loc = arange(Bmax + 1)`` (constant: one
   token per row) and ``block_tables[Bmax, max_blocks]`` with
   ``max_blocks = ceil(max_model_len / block_size)``. The graph of size ``B``
   reads the leading ``B`` rows. :meth:`DecodeGraphs.run` writes them on the
   current stream before the replay (stream order makes the replay see them).
   Host data travels through pinned memory with ``non_blocking`` copies; a
   replay never syncs with the host.
2. **Padding rows** ``n .. B-1``: token 0, position 0, slot -1 (the cache
   write skips it, so no page is touched), ``seq_len`` 1 and a block-table row
   of zeros, so the kernel reads block 0, offset 0 only: in bounds. Their
   outputs are computed and ignored; every layer is row-independent, so they
   cannot change the real rows. The KV pool is zero-filled on CUDA at startup,
   so even that read sees finite numbers.
3. **Stale columns.** Only the first ``ceil(max seq_len / block_size)``
   columns of the table rows are rewritten each step; later columns keep old
   ids, and the kernel never reads past ``seq_len``.
4. **Fixed split-K.** ``num_splits`` per size is the kernel's own heuristic at
   the longest context. GQA (``triton_paged``): ``min(ceil(4 * SMs / (B *
   kv_heads)), max(1, max_model_len // 256), 64)``; fp8 caches on the Gluon
   decode kernels: ``gluon_fp8_decode.pinned_num_splits`` (its variant rule;
   the kernel variant follows the shape, so capture and eager agree); MLA
   (``triton_mla``): ``triton_mla_decode.pinned_num_splits`` (per head block;
   the tl.dot rule, at most 32, or the wgmma kernel's when ``routes`` sends the
   plan there: whole waves of 1 or 2 programs per SM, at most 64).
   Grid and partial buffers are then fixed; shorter contexts leave trailing
   splits empty (they add nothing in the merge). ``max_seq_len`` in the
   captured metadata is ``max_model_len``.
5. **Lifetime.** Captured once at startup, after the weights and the KV pool
   exist and before any request, largest size first, in one memory pool. The
   weights, the pool's buffer and the fp8 scale tensors must never be
   reallocated afterwards (fp8 calibration updates scales in place; no graph
   replays before calibration is done). A graph's output lives in the shared
   pool and is valid until the next replay of any graph.
6. Only when every layer's planned backend is in ``GRAPH_BACKENDS``
   (``triton_paged``, ``triton_mla``; the reference backends read tensor
   values on the host, which capture forbids), there are no per-request rings,
   and the model has no ``cuda_graph_unsupported_reason`` (e.g. MoE layers
   without a working ``torch._grouped_mm``).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from kvforge.attention.metadata import AttentionMetadata

logger = logging.getLogger("kvforge.engine")

GRAPH_BACKENDS = frozenset({"triton_paged", "triton_mla"})


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to ``max_num_seqs`` (powers of two), plus ``max_num_seqs``."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def fixed_num_splits(batch: int, kv_heads: int, num_sms: int, max_model_len: int) -> int:
    """Split-K factor pinned for a captured decode batch size (invariant 4)."""
    by_len = max(1, max_model_len // 256)
    return max(1, min(math.ceil(4 * num_sms / max(1, batch * kv_heads)), by_len, 64))


def graphs_unsupported_reason(runner) -> str | None:
    """None when decode graphs can be captured for ``runner``, else why not."""
    if runner.device.type != "cuda":
        return "not a CUDA device"
    other = sorted(set(runner.backend_names) - GRAPH_BACKENDS)
    if other:
        return f"layers planned on backend(s) {', '.join(other)} (graphs need {', '.join(sorted(GRAPH_BACKENDS))})"
    if runner.pool.ring_pages:
        return "per-request rings (CsaRingTest) are written eagerly"
    model_reason = getattr(runner.model, "cuda_graph_unsupported_reason", None)
    if model_reason:
        return f"the model is not capturable: {model_reason}"
    return None


class DecodeGraphs:
    """Captures and replays decode-only steps (see the module docstring)."""

    def _gluon_mla_decode(self, plan, latent_dim: int | None) -> bool:
        """Whether every MLA layer's decode runs the wgmma kernel (kvforge/kernels/gluon_mla_decode.py): the
        same ``routes`` rule ``mla_decode`` applies, on the plan's dtypes and the model's latent size."""
        from kvforge.engine.kv_pool import TORCH_KV_DTYPES
        from kvforge.kernels import gluon_mla_decode as g
        from kvforge.kernels.gluon_support import GLUON_ENABLED, TESTED_COMPUTE_CAPABILITY_MAJOR

        if not GLUON_ENABLED or self.device.type != "cuda" or latent_dim is None:
            return False
        if torch.cuda.get_device_capability(self.device)[0] != TESTED_COMPUTE_CAPABILITY_MAJOR:
            return False
        q_dtype = TORCH_KV_DTYPES[plan.model_dtype]
        return all(
            layer.backend == "triton_mla"
            and g.routes(layer.heads_per_rank, q_dtype, TORCH_KV_DTYPES[layer.kv_dtype],
                         None if layer.query_dtype == plan.model_dtype else layer.query_dtype,
                         latent_dim, (layer.head_size or 0) - latent_dim)
            for layer in plan.layers
        )  # fmt: skip

    def _gluon_fp8_decode(self, plan) -> bool:
        """Whether every layer's decode runs the Gluon fp8 kernels (kvforge/kernels/gluon_fp8_decode.py)."""
        from kvforge.kernels import gluon_fp8_decode as g
        from kvforge.kernels.gluon_support import GLUON_ENABLED, TESTED_COMPUTE_CAPABILITY_MAJOR

        if not GLUON_ENABLED or self.device.type != "cuda":
            return False
        if torch.cuda.get_device_capability(self.device)[0] != TESTED_COMPUTE_CAPABILITY_MAJOR:
            return False
        return all(
            layer.backend == "triton_paged" and layer.kv_dtype.startswith("fp8")
            and layer.head_size in g.SUPPORTED_HEAD_SIZES
            and layer.heads_per_rank // max(1, layer.kv_heads_per_rank) <= g.MAX_GROUP
            for layer in plan.layers
        )  # fmt: skip

    def __init__(self, runner, *, max_num_seqs: int, sizes: list[int] | None = None, capture: bool = True):
        self.runner = runner
        self.device = runner.device
        plan = runner.plan
        self.sizes = sorted(set(sizes or default_capture_sizes(max_num_seqs)))
        self.max_size = self.sizes[-1]
        self.max_model_len = plan.max_model_len
        self.block_size = plan.block_size
        self.max_blocks = -(-plan.max_model_len // plan.block_size)
        kv_heads = plan.layers[0].kv_heads_per_rank
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" \
            else 132
        if all(layer.kind == "mla" for layer in plan.layers):  # the MLA kernel's own rule (per head block)
            from kvforge.kernels.triton_mla_decode import pinned_num_splits

            heads = plan.layers[0].heads_per_rank
            wgmma = self._gluon_mla_decode(plan, getattr(runner.model, "config", {}).get("kv_lora_rank"))
            fp8 = plan.layers[0].kv_dtype.startswith("fp8")
            self.num_splits = {b: pinned_num_splits(b, heads, plan.max_model_len, sms, wgmma=wgmma, is_fp8=fp8)
                               for b in self.sizes}
        elif self._gluon_fp8_decode(plan):  # the Gluon fp8 decode's own rule (kernel variant + splits)
            from kvforge.kernels.gluon_fp8_decode import pinned_num_splits

            self.num_splits = {b: pinned_num_splits(b, kv_heads, plan.max_model_len, sms) for b in self.sizes}
        else:
            self.num_splits = {b: fixed_num_splits(b, kv_heads, sms, plan.max_model_len) for b in self.sizes}
        dev, bmax = self.device, self.max_size
        self.i64 = torch.zeros((3, bmax), dtype=torch.int64, device=dev)
        self.i64[2].fill_(-1)
        self.qsl = torch.arange(bmax + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((bmax, self.max_blocks), dtype=torch.int32, device=dev)
        self.scratch32 = torch.empty(bmax + bmax * self.max_blocks, dtype=torch.int32, device=dev)
        self._host64 = np.zeros((3, bmax), dtype=np.int64)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    # ---- static views ---------------------------------------------------------
    def _inputs(self, b: int):
        meta = AttentionMetadata(
            query_start_loc=self.qsl[:b + 1], seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.i64[2, :b], max_query_len=1, max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        return self.i64[0, :b], self.i64[1, :b], meta

    def size_for(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.max_size

    # ---- capture ----------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        runner = self.runner
        calib, runner.needs_calibration = runner.needs_calibration, False
        try:
            pool = torch.cuda.graph_pool_handle()
            for b in sorted(self.sizes, reverse=True):
                ids, pos, meta = self._inputs(b)
                runner.forward(ids, pos, meta, self.num_splits[b])  # warm-up: compiles kernels, no KV write
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.forward(ids, pos, meta, self.num_splits[b])
                self.graphs[b] = (graph, out)
            torch.cuda.synchronize(self.device)
        finally:
            runner.needs_calibration = calib
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %s, split-K %s) in %.1f s", len(self.graphs),
                    self.sizes, [self.num_splits[b] for b in self.sizes], self.capture_seconds)

    # ---- replay -------------------------------------------------------------------
    def load(self, host) -> int:
        """Write a decode-only step (``HostStep``) into the static buffers; returns the padded size."""
        n = host.num_seqs
        b = self.size_for(n)
        if b is None or host.max_query_len != 1:
            raise ValueError(f"not a decode step that fits a captured size (n={n}, max {self.max_size})")
        h = self._host64
        h[0, :n], h[1, :n], h[2, :n] = host.ids, host.pos, host.slots
        h[0, n:b], h[1, n:b], h[2, n:b] = 0, 0, -1
        cols = host.tables.shape[1]
        if cols > self.max_blocks:
            raise ValueError(f"block table of {cols} columns exceeds max_model_len's {self.max_blocks}")
        bmax = self.max_size
        i32 = np.zeros(bmax + b * cols, dtype=np.int32)
        i32[:bmax] = 1
        i32[:n] = host.seq_lens
        i32[bmax:bmax + n * cols] = host.tables.reshape(-1)
        a64, a32 = torch.from_numpy(h), torch.from_numpy(i32)
        if self.device.type == "cuda":
            a64, a32 = a64.pin_memory(), a32.pin_memory()
        self.i64.copy_(a64, non_blocking=True)
        scratch = self.scratch32[:i32.shape[0]]
        scratch.copy_(a32, non_blocking=True)
        self.seq_lens.copy_(scratch[:bmax])
        self.block_tables[:b, :cols].copy_(scratch[bmax:].view(b, cols))
        return b

    def run(self, host) -> torch.Tensor:
        """Replay for a decode-only step; returns hidden states of the ``n`` real rows."""
        b = self.load(host)
        self.runner.patch_placeholders(self.i64[0, :host.num_seqs], host)
        if b not in self.graphs:
            # capture=False (CPU tests): the same static, padded inputs, run eagerly.
            ids, pos, meta = self._inputs(b)
            splits = self.num_splits[b] if graphs_unsupported_reason(self.runner) is None else None
            return self.runner.forward(ids, pos, meta, splits)[:host.num_seqs]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:host.num_seqs]
