"""CUDA graphs for decode-only and speculative verification steps.

A decode-only step (every scheduled sequence brings exactly one new token) of
``n`` sequences replays the graph captured for the smallest capture size
``B >= n``; larger batches, prefill and mixed steps run eagerly. With
speculative decoding, a verification step in which every sequence brings the
same ``Q = 1 + k`` query tokens (its last token and ``k`` proposals) replays a
graph captured for ``(B, Q)`` too; a step whose sequences verify different
counts runs eagerly. The graph
covers the model forward (embedding, every layer with its KV write and paged
attention, final norm); the LM head and sampling run eagerly after it.

Invariants (what makes a replay equal to an eager step):

1. **Static inputs.** One set of device buffers sized for the largest capture
   size ``Bmax`` and query length ``Qmax``: ``i64[2 + G, Bmax * Qmax]`` (token ids, positions, and one
   slot mapping per KV-cache group, ``G`` groups), ``seq_lens[Bmax]``, ``decode_order[Bmax]`` (the
   ``Q = 1`` graphs' longest-first order: the real rows sorted, then the padding rows in order, so the
   leading ``B`` entries are a permutation of ``0 .. B-1`` for every ``B`` at least the step's size),
   ``query_start_loc = Q * arange(Bmax + 1)`` per query length ``Q`` (constant) and
   ``block_tables[G, Bmax, max_blocks]`` (one table per group) with
   ``max_blocks = ceil(max_model_len / block_size)``. The graph of size ``B``
   reads the leading ``B`` rows of each. :meth:`DecodeGraphs.run` writes them on the
   current stream before the replay (stream order makes the replay see them).
   Host data travels through pinned memory with ``non_blocking`` copies; a
   replay never syncs with the host.
2. **Padding rows** ``n .. B-1``: token 0, position 0, slot -1 (the cache
   write skips it, so no page is touched), ``seq_len`` ``Q`` and block-table rows
   of zeros, so the kernel reads block 0, offsets ``0 .. Q-1`` only: in bounds. Their
   outputs are computed and ignored; every layer is row-independent, so they
   cannot change the real rows. The KV pool is zero-filled on CUDA at startup,
   so even that read sees finite numbers.
3. **Stale columns.** Only the first ``ceil(max seq_len / block_size)``
   columns of the table rows are rewritten each step; later columns keep old
   ids, and the kernel never reads past ``seq_len``.
4. **Fixed split-K per context bucket.** Each capture size ``B`` is captured once per context bucket
   ``C`` of :func:`graph_contexts` (the longest context a replay of that graph may see); a step replays
   the graph of the smallest bucket at least its longest ``seq_len``. ``num_splits`` of ``(B, C)`` is
   what the layers' backend pins for ``B`` decode rows at context ``C`` (its CUDA-graph hook,
   ``AttentionBackend.graph_num_splits``, the routing table's count; kvforge/attention/routing/) and
   ``max_seq_len`` in the captured metadata is ``C``, so the table picks the kernel it would pick
   eagerly at context ``C``. The grid and partial buffers are then fixed; the kernels divide each
   sequence's own context among the splits, so shorter contexts than ``C`` are served correctly.
   Without buckets, a short context would replay the kernel and split count chosen for
   ``max_model_len`` (many near-empty splits). Buckets double, so a replay's longest context is more than
   half of ``C`` (beyond the first bucket; more than 4/9 of it in the last bucket where the fixed bucket
   within an eighth below ``max_model_len`` is left out): a split then holds nearly half the tokens the rule
   gave it or more.
5. **Lifetime.** Captured once at startup, after the weights and the KV pool
   exist and before any request, largest size first, in one memory pool per
   runner (the target's, an MTP layer's). The
   weights, the pool's buffer and the fp8 scale tensors must never be
   reallocated afterwards (fp8 calibration updates scales in place; no graph
   replays before calibration is done). A graph's output lives in its runner's
   pool and is valid until that runner's next replay.
6. **Verification graphs** (``Q > 1``): the paged kernels take the ``Q`` query rows of a sequence with
   causal masking, as eagerly; an MLA group's metadata is the per-token form (each query token a
   one-token sequence over its causal prefix, ``kvforge.attention.triton_mla.per_token_metadata``),
   derived from the static buffers by device operations recorded inside the graph, so a replay
   recomputes it from the step's ``seq_lens`` and tables. Split counts are pinned per ``(B, C, Q)``.
   Models with rings capture ``Q = 1`` only. Models with linear-attention state capture ``Q > 1`` only
   for steps where every sequence verifies ``Q - 1`` proposals (invariant 7).
7. **State slots** (linear-attention layers): ``slot_ids[Bmax]`` int32 and
   ``has_initial_state[Bmax]`` bool are static too, with ``query_start_loc``
   the same ``arange``; :meth:`DecodeGraphs.load` writes each row's slot and
   whether its slot already holds its state (False only for a one-token
   prompt), padding rows slot -1 (the decode kernels neither read nor write
   it). The captured decode kernels update the slots in place. A verification
   graph (``Q > 1``, every sequence verifying ``Q - 1`` proposals) stores no
   state (``store_slot_ids`` all -1) and keeps its rows' inputs in the verify
   rows through two more static buffers, ``verify_src`` / ``verify_dest``
   ``[Bmax * Q]`` int64: a real row ``j`` of sequence ``i`` goes to
   ``slot * Q + j``; padding rows repeat the first real row's copy (the same
   value to the same place, so the result does not depend on their order).
   The engine's replay of the accepted rows runs after the step, from graphs of its own where every
   sequence keeps the same count (kvforge/engine/replay_graphs.py), else eagerly.
8. Only when every attention layer's backend ``captures_cuda_graphs`` (the Triton
   backends; the reference backends read tensor values on the host, which
   capture forbids), there are no per-request rings,
   and the model has no ``cuda_graph_unsupported_reason`` (e.g. MoE layers
   without a working ``torch._grouped_mm``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvforge.attention.metadata import AttentionMetadata

logger = logging.getLogger("kvforge.engine")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to 256 and of 16 beyond, those below ``max_num_seqs``, then
    ``max_num_seqs`` itself (ascending, no repeats). A decode batch above 4 sequences then pads by at most
    7 rows (15 above 256); powers of two would pad a batch of 129 to 256, whose GEMMs are compute-bound
    where 129 rows are still close to the weight-read time."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs, 16)]
    return [b for b in ladder if b < max_num_seqs] + [max_num_seqs]


#: Context buckets below ``max_model_len`` that get graphs of their own (module docstring, invariant 4).
GRAPH_CONTEXT_BUCKETS: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768, 65536)


def graph_contexts(max_model_len: int) -> list[int]:
    """The context buckets captured for every size: the fixed buckets below ``max_model_len``, then
    ``max_model_len`` itself (ascending). A fixed bucket that ``max_model_len`` exceeds by at most an eighth
    is left out: its graphs would differ from the last bucket's by a few blocks (32768 beside 32808)."""
    return [c for c in GRAPH_CONTEXT_BUCKETS if c + c // 8 < max_model_len] + [max_model_len]


def graphs_unsupported_reason(runner) -> str | None:
    """None when decode graphs can be captured for ``runner``, else why not."""
    if runner.device.type != "cuda":
        return "not a CUDA device"
    # State layers run no attention backend: their slots go through the linear-state kernels below.
    attention = [b for b, layer in zip(runner.backends, runner.plan.layers) if layer.kind != "state"]
    other = sorted({b.name for b in attention if not b.captures_cuda_graphs})
    if other:
        capturable = sorted({b.name for b in attention if b.captures_cuda_graphs})
        return (f"layers planned on backend(s) {', '.join(other)}, which read tensor values on the host "
                f"(graphs need backends that capture{': ' + ', '.join(capturable) if capturable else ''})")
    if runner.pool.ring_pages:
        return "per-request rings (CsaRingTest) are written eagerly"
    if runner.linear_states is not None:
        from kvforge.kernels import triton_gated_delta_rule

        if not triton_gated_delta_rule.HAS_TRITON:
            return "linear-attention state slots need the Triton decode kernels (Triton is not importable)"
    model_reason = getattr(runner.model, "cuda_graph_unsupported_reason", None)
    if model_reason:
        return f"the model is not capturable: {model_reason}"
    return None


class DecodeGraphs:
    """Captures and replays decode-only steps (see the module docstring)."""

    def __init__(self, runner, *, max_num_seqs: int, sizes: list[int] | None = None, capture: bool = True,
                 query_lens: tuple[int, ...] = (1,)):
        self.runner = runner
        self.device = runner.device
        plan = runner.plan
        self.sizes = sorted(set(sizes or default_capture_sizes(max_num_seqs)))
        self.max_size = self.sizes[-1]
        self.max_model_len = plan.max_model_len
        self.block_size = plan.block_size
        self.max_blocks = -(-plan.max_model_len // plan.block_size)
        self.contexts = graph_contexts(plan.max_model_len)
        # Linear-attention state slots: each row's slot (-1: padding) and whether the slot holds its state.
        self.has_slots = runner.linear_states is not None
        # State models verify in graphs only with verify rows of the graph's query length (1 + k).
        verify_q = runner.linear_states.verify_rows if self.has_slots else 0
        self.query_lens = tuple(sorted({1, *(q for q in query_lens if not self.has_slots or q == verify_q)}))
        self.num_splits = {(b, c, q): runner.pinned_num_splits(b, c, q)
                           for b in self.sizes for c in self.contexts for q in self.query_lens}
        dev, bmax, qmax = self.device, self.max_size, self.query_lens[-1]
        self.num_groups = G = runner.num_groups
        self.mla_groups = frozenset(runner.layer_group[i] for i, layer in enumerate(plan.layers) if layer.kind == "mla")
        self.i64 = torch.zeros((2 + G, bmax * qmax), dtype=torch.int64, device=dev)
        self.i64[2:].fill_(-1)
        self.qsl = {q: q * torch.arange(bmax + 1, dtype=torch.int32, device=dev) for q in self.query_lens}
        self.token_qsl = torch.arange(bmax * qmax + 1, dtype=torch.int32, device=dev)
        # Per-token MLA metadata: query token j of a sequence sees its causal prefix, seq_len - Q + j + 1.
        self.within = {q: torch.arange(q, dtype=torch.int32, device=dev).repeat(bmax) + (1 - q)
                       for q in self.query_lens if q > 1}
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=dev)
        self.decode_order = torch.arange(bmax, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((G, bmax, self.max_blocks), dtype=torch.int32, device=dev)
        # The int32 staging of a load: lengths, order, block tables, then (state models) slots, held-state flags
        # and the verify rows' sources and destinations; one host->device copy.
        slot_part = 2 * bmax + 2 * bmax * qmax if self.has_slots else 0
        self.scratch32 = torch.empty(2 * bmax + G * bmax * self.max_blocks + slot_part, dtype=torch.int32, device=dev)
        self._host64 = np.zeros((2 + G, bmax * qmax), dtype=np.int64)
        self.slot_ids = torch.full((bmax,), -1, dtype=torch.int32, device=dev)
        self.has_initial_state = torch.ones(bmax, dtype=torch.bool, device=dev)
        self.no_store = torch.full((bmax,), -1, dtype=torch.int32, device=dev)
        self.verify_src = torch.zeros(bmax * qmax, dtype=torch.int64, device=dev)
        self.verify_dest = torch.zeros(bmax * qmax, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    # ---- static views ---------------------------------------------------------
    def _inputs(self, b: int, context: int, q: int = 1):
        """Views of the static buffers for ``b`` sequences of ``q`` query tokens; for ``q > 1`` an MLA group's
        per-token metadata is computed here from them (call it inside the capture: invariant 6)."""
        t = b * q
        metas = []
        for g in range(self.num_groups):
            if q > 1 and g in self.mla_groups:
                metas.append(AttentionMetadata(
                    query_start_loc=self.token_qsl[:t + 1],
                    seq_lens=self.seq_lens[:b].repeat_interleave(q) + self.within[q][:t],
                    block_tables=self.block_tables[g, :b].repeat_interleave(q, dim=0),
                    slot_mapping=self.i64[2 + g, :t], max_query_len=1, max_seq_len=context,
                    block_size=self.block_size))
            else:
                metas.append(AttentionMetadata(
                    query_start_loc=self.qsl[q][:b + 1], seq_lens=self.seq_lens[:b],
                    block_tables=self.block_tables[g, :b], slot_mapping=self.i64[2 + g, :t], max_query_len=q,
                    max_seq_len=context, block_size=self.block_size,
                    decode_order=self.decode_order[:b] if q == 1 else None))
        return self.i64[0, :t], self.i64[1, :t], tuple(metas)

    def _slot_batch(self, b: int, host_slots=None, host_init=None, q: int = 1):
        """The static slot batch of size ``b`` (None without state layers); ``q > 1``: every sequence verifies
        ``q - 1`` proposals (invariant 7). ``host_slots``/``host_init``: the step's values for the host copies
        (the PyTorch path of uncaptured runs); padding otherwise."""
        if not self.has_slots:
            return None
        from kvforge.attention.linear_state import SlotBatch

        slots = tuple(host_slots) if host_slots is not None else (-1,) * b
        init = tuple(host_init) if host_init is not None else (True,) * b
        verify = {}
        if q > 1:
            verify = dict(host_spec_lens=tuple((q - 1) * (s >= 0) for s in slots), store_slot_ids=self.no_store[:b],
                          verify_src=self.verify_src[:b * q], verify_dest=self.verify_dest[:b * q])
        return SlotBatch(query_start_loc=self.qsl[q][:b + 1], slot_ids=self.slot_ids[:b],
                         has_initial_state=self.has_initial_state[:b], max_query_len=q,
                         host_query_start_loc=tuple(range(0, q * b + 1, q)), host_slot_ids=slots,
                         host_has_initial_state=init, **verify)

    def size_for(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def context_for(self, max_seq_len: int) -> int:
        """The smallest context bucket holding ``max_seq_len`` (``max_model_len`` beyond the others)."""
        for c in self.contexts:
            if c >= max_seq_len:
                return c
        return self.contexts[-1]

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.max_size

    def accepts(self, host) -> bool:
        """Whether ``host`` is a step a captured graph serves: at most ``Bmax`` sequences, each with the same
        number of query tokens, one of the captured query lengths."""
        q = host.max_query_len
        if not self.can_run(host.num_seqs) or q not in self.query_lens:
            return False
        if q > 1 and self.has_slots and (host.spec_lens is None or not (host.spec_lens == q - 1).all()):
            return False  # a state model's verification graph keeps its slots: only verifying sequences fit
        return q == 1 or bool((np.diff(host.qsl) == q).all())

    # ---- capture ----------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        runner = self.runner
        calib, runner.needs_calibration = runner.needs_calibration, False
        try:
            pool = torch.cuda.graph_pool_handle()
            self.decode_order.copy_(torch.arange(self.max_size, dtype=torch.int32))
            for key in sorted(self.num_splits, reverse=True):
                b, context, q = key
                self.seq_lens.fill_(q)  # every row a padding sequence of q tokens: the warm-up reads block 0 only
                ids, pos, meta = self._inputs(b, context, q)
                slot_batch = self._slot_batch(b, q=q)  # every row padding: no state slot is touched
                runner.forward(ids, pos, meta, self.num_splits[key], slot_batch)  # warm-up: compiles, writes nothing
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    ids, pos, meta = self._inputs(b, context, q)
                    out = runner.forward(ids, pos, meta, self.num_splits[key], slot_batch)
                self.graphs[key] = (graph, out)
            torch.cuda.synchronize(self.device)
        finally:
            runner.needs_calibration = calib
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %s x contexts %s x query lengths %s, split-K %s) "
                    "in %.1f s", len(self.graphs), self.sizes, self.contexts, list(self.query_lens),
                    [self.num_splits[k] for k in sorted(self.num_splits)], self.capture_seconds)

    def release(self) -> None:
        """Free every captured graph (and with them the graph memory pool), the static buffers and the
        reference to the runner. Idempotent; nothing replays afterwards."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.runner = None
        self.i64 = self.qsl = self.token_qsl = self.within = self.seq_lens = self.block_tables = self.scratch32 = None
        self.decode_order = None
        self.slot_ids = self.has_initial_state = self.no_store = self.verify_src = self.verify_dest = None
        self.sizes, self.max_size = [], 0

    # ---- replay -------------------------------------------------------------------
    def load(self, host) -> int:
        """Write a decode-only or uniform verification step (``HostStep``) into the static buffers; returns
        the padded size."""
        n, q = host.num_seqs, host.max_query_len
        b = self.size_for(n)
        if b is None or not self.accepts(host):
            raise ValueError(f"not a step that fits a captured graph (n={n}, max {self.max_size}, query length {q}, "
                             f"captured {list(self.query_lens)})")
        h, G = self._host64, self.num_groups
        t, tb = n * q, b * q
        h[0, :t], h[1, :t], h[2:, :t] = host.ids, host.pos, host.slots
        h[0, t:tb], h[1, t:tb], h[2:, t:tb] = 0, 0, -1
        cols = host.tables.shape[2]
        if cols > self.max_blocks:
            raise ValueError(f"block table of {cols} columns exceeds max_model_len's {self.max_blocks}")
        bmax = self.max_size
        tables_end = 2 * bmax + G * b * cols
        slot_part = (2 * bmax + (2 * bmax * q if q > 1 else 0)) if self.has_slots else 0
        i32 = np.zeros(tables_end + slot_part, dtype=np.int32)
        i32[:bmax] = q  # padding sequences: q tokens at positions 0 .. q-1 of block 0
        i32[:n] = host.seq_lens
        i32[bmax:2 * bmax] = AttentionMetadata.longest_first(host.seq_lens, bmax)  # padding rows last
        i32[2 * bmax:tables_end].reshape(G, b, cols)[:, :n] = host.tables
        if self.has_slots:
            slots, init = i32[tables_end:tables_end + bmax], i32[tables_end + bmax:tables_end + 2 * bmax]
            slots[:] = -1
            slots[:n] = host.state_slots
            init[:] = 1
            init[:n] = host.has_initial_state()
            if q > 1:  # verify rows: real row j of sequence i to slot * q + j, padding rows as the first real row
                src = i32[tables_end + 2 * bmax:tables_end + 2 * bmax + bmax * q]
                dest = i32[tables_end + 2 * bmax + bmax * q:]
                src[:t] = np.arange(t)
                dest[:] = slots[0] * q
                dest[:t] = (slots[:n, None] * q + np.arange(q)).reshape(-1)
        a64, a32 = torch.from_numpy(h), torch.from_numpy(i32)
        if self.device.type == "cuda":
            a64, a32 = a64.pin_memory(), a32.pin_memory()
        self.i64.copy_(a64, non_blocking=True)
        scratch = self.scratch32[:i32.shape[0]]
        scratch.copy_(a32, non_blocking=True)
        self.seq_lens.copy_(scratch[:bmax])
        self.decode_order.copy_(scratch[bmax:2 * bmax])
        self.block_tables[:, :b, :cols].copy_(scratch[2 * bmax:tables_end].view(G, b, cols))
        if self.has_slots:
            self.slot_ids.copy_(scratch[tables_end:tables_end + bmax])
            self.has_initial_state.copy_(scratch[tables_end + bmax:tables_end + 2 * bmax])  # nonzero: held
            if q > 1:
                at = tables_end + 2 * bmax
                self.verify_src[:bmax * q].copy_(scratch[at:at + bmax * q])
                self.verify_dest[:bmax * q].copy_(scratch[at + bmax * q:at + 2 * bmax * q])
        return b

    def run(self, host) -> torch.Tensor:
        """Replay for a decode-only or uniform verification step; returns hidden states of the real rows."""
        b = self.load(host)
        q = host.max_query_len
        t = host.num_seqs * q
        key = (b, self.context_for(host.max_seq_len), q)
        self.runner.patch_placeholders(self.i64[0, :t], host)
        if key not in self.graphs:
            # capture=False (CPU tests): the same static, padded inputs, run eagerly.
            ids, pos, meta = self._inputs(*key)
            splits = self.num_splits[key] if graphs_unsupported_reason(self.runner) is None else None
            n = host.num_seqs
            slot_batch = None
            if self.has_slots:
                slot_batch = self._slot_batch(b, list(host.state_slots) + [-1] * (b - n),
                                              list(host.has_initial_state()) + [True] * (b - n), q)
            return self.runner.forward(ids, pos, meta, splits, slot_batch)[:t]
        graph, out = self.graphs[key]
        graph.replay()
        return out[:t]
