"""ModelRunner: turns a scheduler step into tensors, runs the model, returns logits.

The attention callable handed to the model writes each layer's new K/V into
its paged cache (quantizing when the plan says fp8) and runs the layer's
planned backend over the block tables. Nothing here decides a KV question:
backends, dtypes, block size and scales all come from the plan.

KV-cache groups: each sequence brings one block table per group of the plan
(``Sequence.block_tables``); the step gets one block table and one slot
mapping per group, so one AttentionMetadata per group, and each layer is
handed its group's (``KVPool.layer_group``).

Input preparation never waits for the device: every step tensor (token ids,
positions, slots, query_start_loc, seq_lens, block tables, the rows whose
logits are wanted) is built on the host with numpy, placed in pinned memory
and copied with ``non_blocking=True`` (two copies per step: one int64 and one
int32 buffer). On CPU the host tensors are used directly. The only host sync
of a step is the engine reading the sampled tokens.

Linear-attention layers (Qwen3-Next, Kimi-Linear) read and write their
sequences' state slots (``KVPool.linear_states``): the engine hands each step
one slot per sequence (``step_state_slots``, in the step's order), and the
step's ``SlotBatch`` marks a sequence's first chunk (start position 0) as
having no initial state, so a fresh or recomputed sequence never reads what
the slot's previous owner left. With speculative decoding the engine also hands
each step the proposals every sequence verifies (``step_spec_lens``): those
sequences keep their slots' states and their rows, and after verification
:meth:`ModelRunner.keep_verified` replays the accepted rows onto the slots. With
prefix caching it hands the snapshots to take inside the step's sequences
(``step_snapshots``, kvforge/engine/state_prefix.py).

Decode-only steps (every sequence brings one token) on CUDA replay a captured
CUDA graph when one is available (kvforge/engine/cuda_graphs.py); prefill and
mixed steps, and everything with ``enforce_eager``, run eagerly.

With ``keep_hidden`` set (speculative method mtp), a step also keeps the hidden
states of all its tokens (``last_hidden``, the model's output before the head;
no copy) for the proposer to take; a runner over the plan's proposer layers
(``KVPool.draft_view``) runs the model's multi-token-prediction layer with
:meth:`ModelRunner.run_mtp` (or, linked to the target runner, ``mtp_observe`` / ``mtp_first`` /
``mtp_next``, which keep their tensors on the runner: at tensor parallelism every rank holds its own
copies), through the same block tables.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

from kvforge.attention.backends.base import AttentionBackend, BackendOptions, LayerKV, backend_class
from kvforge.attention.fp8 import compute_scales, is_fp8
from kvforge.attention.linear_state import SlotBatch
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing.mla import check_prefill_mode
from kvforge.engine.block_table_cache import BlockTableCache
from kvforge.engine.kv_pool import KVPool
from kvforge.engine.prompt_scoring import PromptScoring, score_rows, set_scored_rows
from kvforge.errors import ConfigError
from kvforge.host_copies import values_to_device
from kvforge.kv_dtypes import is_quantized
from kvforge.models.layers import fused_kernels, store_input_major
from kvforge.planner.kv_plan import KVPlan
from kvforge.planner.registry import builtin_backends


class HostStep:
    """One step's inputs as host numpy arrays (filled by :meth:`ModelRunner.build_host`).

    ``slots`` is int64 ``[num_groups, num_tokens]`` and ``tables`` int32
    ``[num_groups, num_seqs, cols]``: one slot mapping and one block table per
    KV-cache group.
    """

    __slots__ = ("ids", "pos", "slots", "qsl", "seq_lens", "tables", "rows", "max_query_len", "max_seq_len",
                 "placeholders", "state_slots", "spec_lens", "snapshots", "num_scored",
                 "scored_slice_rows")

    def __init__(self, ids, pos, slots, qsl, seq_lens, tables, rows, max_query_len, max_seq_len,
                 placeholders=None):
        self.ids, self.pos, self.slots = ids, pos, slots
        self.qsl, self.seq_lens, self.tables, self.rows = qsl, seq_lens, tables, rows
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        # Overlapped scheduling (kvforge/engine/overlap.py): None, or (token rows [k], source rows [k],
        # device tensor) meaning ids[token rows] = tensor[source rows], gathered on the device.
        self.placeholders = placeholders
        # Linear-attention models: int32 [num_seqs], each sequence's state slot (None otherwise), and the
        # proposals each verifies this step (None: none).
        self.state_slots = None
        self.spec_lens = None
        # int32 [k, 3]: (sequence index, offset, slot) of the prefix-cache snapshots taken inside the step
        # (SlotBatch.host_snapshots); None: none.
        self.snapshots = None
        # The last ``num_scored`` logits rows are prompt rows scored ``scored_slice_rows`` at a time and
        # not returned (kvforge/engine/prompt_scoring.py); every rank takes the same slices.
        self.num_scored = 0
        self.scored_slice_rows = 0

    def has_initial_state(self) -> np.ndarray:
        """bool [num_seqs]: whether each sequence's slot already holds its state (its chunk starts after 0)."""
        return self.seq_lens > np.diff(self.qsl)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class ModelRunner:
    """Runs ``model`` over the KV pool. ``calibrate``: set fp8 scales from the
    first batch's K/V (amax / format max), else keep the default 1.0; every
    scale is multiplied by ``scale_multiplier`` (a diagnostic, default 1).
    ``enforce_eager``: never use CUDA graphs (CPU never does). ``graph_sizes``:
    decode batch sizes to capture (default ``cuda_graphs.default_capture_sizes``:
    1, 2, 4, multiples of 8 up to 256 and of 16 beyond, and ``max_num_seqs`` itself). ``mla_prefill_mode``: how the
    Triton MLA backend attends steps with a prefill chunk (``kvforge.attention.routing.mla.PREFILL_MODES``).
    ``static_decode_on_cpu``: on CPU, decode steps take the CUDA-graph path's static, padded inputs (run
    eagerly; there is no capture on CPU), so tests exercise that path without a GPU. ``mtp_proposals`` (> 0):
    a runner of the model's multi-token-prediction layer proposing up to that many tokens a step; its
    :meth:`forward` is the MTP layer over the static previous-hidden rows :attr:`mtp_hidden`, and its graphs
    capture every query length 1 .. 1 + ``mtp_proposals`` (a decoding sequence's observed rows)."""

    def __init__(self, model, pool: KVPool, plan: KVPlan, device: torch.device, *, calibrate: bool = False,
                 scale_multiplier: float = 1.0, enforce_eager: bool = True, max_num_seqs: int = 256,
                 graph_sizes: list[int] | None = None, ring_rows: int = 0, ring_row_bytes: int = 0,
                 mla_prefill_mode: str = "auto", static_decode_on_cpu: bool = False, verify_query_len: int = 1,
                 mtp_proposals: int = 0):
        self.model = model
        self.pool = pool
        self.plan = plan
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.block_size = plan.block_size
        self.backend_names = [layer.backend for layer in plan.layers]
        # The plan's query dtype per layer: None = model dtype, else the quantized query it declared (MLA).
        self.query_dtypes = [layer.query_dtype if is_quantized(layer.query_dtype) else None for layer in plan.layers]
        self.windows = [model.sliding_window(i) for i in range(len(plan.layers))]
        self.layer_group = pool.layer_group
        self.num_groups = pool.num_groups
        for i, layer in enumerate(plan.layers):
            if layer.kind == "sliding" and self.windows[i] != layer.sliding_window:
                # The block manager frees what leaves the plan's window: the model must not look further back.
                raise ConfigError(f"layer {i}: the model attends over a window of {self.windows[i]} tokens but the "
                                  f"plan's sliding window is {layer.sliding_window}")
        self.softmax_scale = model.softmax_scale
        from kvforge.kernels.gluon_support import routing_device

        config = getattr(model, "config", None)
        self.backend_options = BackendOptions(
            softmax_scale=model.softmax_scale, model_dtype=plan.model_dtype, device=routing_device(device),
            latent_dim=config.get("kv_lora_rank") if isinstance(config, dict) else None,
            mla_prefill_mode=check_prefill_mode(mla_prefill_mode))
        declarations = {d.name: d for d in builtin_backends()}
        by_name = {name: backend_class(declarations[name])(self.backend_options)
                   for name in dict.fromkeys(self.backend_names)}
        #: The backend object of each layer (one object per planned backend, shared by its layers).
        self.backends: list[AttentionBackend] = [by_name[name] for name in self.backend_names]
        self._layer_kv: list[LayerKV | None] = [None] * len(plan.layers)
        self.scale_scheme = plan.layers[0].scale_scheme or "per_tensor"
        self.needs_calibration = calibrate and any(is_fp8(c.dtype) for c in pool.kv_caches if c is not None)
        self.scale_multiplier = scale_multiplier
        if scale_multiplier != 1.0:
            for s in pool.k_scales + pool.v_scales:
                if s is not None:  # state layers have no cache and no scales
                    s.mul_(scale_multiplier)
        self._metas: tuple[AttentionMetadata, ...] | None = None  # this step's, one per KV-cache group
        # The attention callable handed to the model: attn(layer, q, k, v) and attn.rope_attend(...); models
        # with MLA layers also get attn.mla(...).
        self._attn_api = _MLAAttn(self) if any(x.kind == "mla" for x in plan.layers) else _PagedAttn(self)
        # Rings (CsaRingTest): R rows of ring_row_bytes in one page per request and layer.
        self.ring_rows, self.ring_row_bytes = ring_rows, ring_row_bytes
        self.ring_of_layer = {layer: j for j, layer in enumerate(pool.ring_layers)}
        self.step_ring_slots: list[int] | None = None  # per chunk of the next run(); set by the engine
        self._ring_targets = None
        #: State slots of the linear-attention layers (None without them), and the slot of each sequence of
        #: the next run(), set by the engine.
        self.linear_states = pool.linear_states
        self.step_state_slots: list[int] | None = None
        self.step_spec_lens: list[int] | None = None  # per sequence: proposals it verifies (speculative decoding)
        # (sequence index, offset, slot) of the prefix-cache snapshots the step takes inside its sequences
        self.step_snapshots: list[tuple[int, int, int]] | None = None
        if self.linear_states is not None:
            self._attn_api = _LinearAttn(self)
        if pool.ring_pages:
            if ring_rows * ring_row_bytes > pool.ring_page_bytes_unpadded:
                raise ConfigError(f"ring of {ring_rows} x {ring_row_bytes} bytes does not fit its "
                                  f"{pool.ring_page_bytes_unpadded}-byte page (the plan should have refused)")
            self._attn_api = _RingAttn(self)
            from kvforge.attention.ring_backend import RING

            self.ring_backend = backend_class(RING)(self.backend_options)
        self._num_splits: int | None = None  # pinned split-K factor (CUDA-graph decode)
        #: Keep each step's hidden states [tokens, hidden] in ``last_hidden`` (speculative method mtp).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        #: A runner of the MTP layer: the target runner whose hidden states it reads (``link_mtp``), the head
        #: input of each sequence's next proposal by head slot, the rows of the proposal step under way.
        self.mtp_target: ModelRunner | None = None
        self._mtp_heads: torch.Tensor | None = None
        self._mtp_current: torch.Tensor | None = None
        self.mtp_proposals = mtp_proposals
        query_lens = (1, verify_query_len) if not mtp_proposals else tuple(range(1, mtp_proposals + 2))
        #: The MTP layer's previous hidden state of each row of a step (``mtp_proposals`` > 0): the static input
        #: its graphs read, sized for the largest captured batch at the longest query.
        self.mtp_hidden: torch.Tensor | None = None
        if mtp_proposals and not enforce_eager and (device.type == "cuda" or static_decode_on_cpu):
            from kvforge.engine.cuda_graphs import default_capture_sizes

            rows = max(graph_sizes or default_capture_sizes(max_num_seqs)) * query_lens[-1]
            self.mtp_hidden = torch.zeros((rows, model.args.hidden_size), dtype=getattr(torch, plan.model_dtype),
                                          device=device)
        self._tables = BlockTableCache()
        self._pin = device.type == "cuda"
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.graphs = None
        #: Graphs of the replay of accepted verify rows onto the state slots (kvforge/engine/replay_graphs.py).
        self.replay_graphs = None
        self.num_graph_replays = 0
        self.graphs_off_reason: str | None = "enforce_eager" if enforce_eager else None
        if device.type == "cuda" and not enforce_eager:
            from kvforge.engine.cuda_graphs import DecodeGraphs, graphs_unsupported_reason

            why = graphs_unsupported_reason(self)
            if why is None:
                stream = torch.cuda.current_stream(device)
                try:
                    self.graphs = DecodeGraphs(self, max_num_seqs=max_num_seqs, sizes=graph_sizes,
                                               query_lens=query_lens)
                except RuntimeError as e:  # an op the capture forbids: serve eagerly, say why (stats, log)
                    torch.cuda.set_stream(stream)  # a capture_end that raised skipped the capture stream's exit
                    self.graphs = None
                    why = f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:300]}{_failure_origin(e)}); running eager"
            if self.graphs is not None and self.linear_states is not None and self.linear_states.verify:
                self._capture_replay_graphs(capture=True)
            if self.graphs is None:
                self.mtp_hidden = None  # no graph reads it
            if why is not None:
                import logging

                self.graphs_off_reason = why
                logging.getLogger("kvforge.engine").warning("CUDA graphs off: %s", why)
        elif device.type == "cpu" and not enforce_eager and not pool.ring_pages and static_decode_on_cpu:
            from kvforge.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs=max_num_seqs, sizes=graph_sizes, capture=False,
                                       query_lens=query_lens)
            if self.linear_states is not None and self.linear_states.verify and self.linear_states.on_kernels():
                self._capture_replay_graphs(capture=False)
        elif device.type != "cuda":
            self.graphs_off_reason = "not a CUDA device"
        if device.type == "cpu":
            input_major = getattr(model, "input_major_modules", None)
            if input_major is not None:
                store_input_major(input_major())  # one-row products stream the weights faster this way

    # ---- inputs ---------------------------------------------------------------
    def invalidate_block_tables(self) -> None:
        """Call when block tables were changed in place (copy-on-write)."""
        self._tables.clear()

    def build_host(self, chunks: list[tuple[list[int], int, list]],
                   logits_rows: list[int] | None = None) -> HostStep:
        """chunks: per sequence (new token ids, start position, block tables: one list of block ids per
        KV-cache group, or, in every chunk, one flat list for a single-group pool).

        Positions of sequence i's new tokens are start .. start + n - 1; its
        context after the step is start + n. Unused block-table entries are 0.
        """
        bs = self.block_size
        n_seqs = len(chunks)
        G = self.num_groups
        # Vectorized over sequences (per-sequence numpy scalar writes cost ~1 ms at 256 sequences).
        lens = np.fromiter((len(c[0]) for c in chunks), dtype=np.int64, count=n_seqs)
        starts = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n_seqs)
        # A sequence's tables have one length in every group (the block manager's invariant): each sequence
        # brings a [G, width] array, and one boolean assignment fills every group's rows.
        if n_seqs and isinstance(chunks[0][2][0], list):  # one table per group
            if len(chunks[0][2]) != G:
                raise ValueError(f"{len(chunks[0][2])} block tables for a pool of {G} KV-cache groups")
            get = self._tables.get_groups
            arrays = [get(c[2]) for c in chunks]
        else:  # a flat list of block ids: the one group's table
            if G != 1:
                raise ValueError(f"one block table given for a pool of {G} KV-cache groups")
            get = self._tables.get
            arrays = [get(c[2])[None] for c in chunks]
        widths = np.fromiter((a.shape[1] for a in arrays), dtype=np.int64, count=n_seqs)
        cols = max(1, int(widths.max()) if n_seqs else 1)
        tables = np.zeros((G, n_seqs, cols), dtype=np.int32)
        if n_seqs:
            filled = np.arange(cols) < widths[:, None]
            # Row-major boolean assignment: row i of every group gets its table in its first widths[i] columns.
            flat = np.concatenate(arrays, axis=1)
            for g in range(G):
                tables[g][filled] = flat[g]
        n_tok = int(lens.sum())
        qsl = np.zeros(n_seqs + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        seq_lens = (starts + lens).astype(np.int32)
        max_q = int(lens.max()) if n_seqs else 0
        if max_q == 1 and n_tok == n_seqs:  # decode: one token per sequence
            ids = np.fromiter((c[0][0] for c in chunks), dtype=np.int64, count=n_seqs)
            pos = starts
            seq_idx = np.arange(n_seqs)
        else:
            ids = np.fromiter(itertools.chain.from_iterable(c[0] for c in chunks), dtype=np.int64, count=n_tok)
            seq_idx = np.repeat(np.arange(n_seqs), lens)
            pos = starts[seq_idx] + (np.arange(n_tok, dtype=np.int64) - qsl[:-1][seq_idx])
        slots = tables[:, seq_idx, pos // bs].astype(np.int64) * bs + pos % bs  # [G, n_tok]
        self._tables.end_step()
        rows = None if logits_rows is None else np.asarray(logits_rows, dtype=np.int64)
        return HostStep(ids, pos, slots, qsl, seq_lens, tables, rows, max_q,
                        int(seq_lens.max()) if n_seqs else 0)

    def _to_device(self, host: HostStep):
        """Two host->device copies (pinned, non_blocking) and views of them. Every view starts 16 bytes into
        its buffer times a whole number (:func:`pack_aligned`), so the pointers a kernel gets are 16-byte
        aligned whatever the batch: Triton specializes a kernel on its pointers' alignment, and a view's
        alignment changing with the number of sequences or tokens would compile new variants mid-serving."""
        n_tok, n_seqs = host.ids.shape[0], host.num_seqs
        n_rows = 0 if host.rows is None else host.rows.shape[0]
        G = host.tables.shape[0]
        # Segments: ids, pos, each group's slots, [rows] | qsl, seq_lens, each group's table, [decode order].
        i64, at64 = pack_aligned([host.ids, host.pos, *host.slots] + ([host.rows] if n_rows else []))
        decode = host.max_query_len == 1 and n_seqs > 0
        order = [AttentionMetadata.longest_first(host.seq_lens)] if decode else []
        i32, at32 = pack_aligned([host.qsl, host.seq_lens, *host.tables] + order)
        a64, a32 = torch.from_numpy(i64), torch.from_numpy(i32)
        if self.device.type != "cpu":
            if self._pin:
                a64, a32 = a64.pin_memory(), a32.pin_memory()
            a64 = a64.to(self.device, non_blocking=True)
            a32 = a32.to(self.device, non_blocking=True)
        ids, pos = a64[at64[0]:at64[0] + n_tok], a64[at64[1]:at64[1] + n_tok]
        slots = [a64[at64[2 + g]:at64[2 + g] + n_tok] for g in range(G)]
        if host.rows is None:  # every row's logits
            rows = None
        elif n_rows:
            rows = a64[at64[2 + G]:at64[2 + G] + n_rows]
        else:  # no row samples (a prompt's chunk before its last): no logits, not all of them
            rows = torch.empty(0, dtype=torch.int64, device=self.device)
        qsl = a32[at32[0]:at32[0] + n_seqs + 1]
        seq_lens = a32[at32[1]:at32[1] + n_seqs]
        cols = host.tables.shape[2]
        tables = [a32[at32[2 + g]:at32[2 + g] + n_seqs * cols].view(n_seqs, cols) for g in range(G)]
        decode_order = a32[at32[2 + G]:at32[2 + G] + n_seqs] if decode else None
        host_qsl, host_lens = tuple(host.qsl.tolist()), tuple(host.seq_lens.tolist())
        metas = tuple(AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables[g], slot_mapping=slots[g],
            max_query_len=host.max_query_len, max_seq_len=host.max_seq_len, block_size=self.block_size,
            host_query_start_loc=host_qsl, host_seq_lens=host_lens, decode_order=decode_order,
        ) for g in range(G))
        return ids, pos, metas, rows

    def prepare(self, chunks: list[tuple[list[int], int, list]]):
        """(input_ids, positions, metadata) on the runner's device for ``chunks``; the metadata is one
        AttentionMetadata for a single-group pool, else a tuple of one per KV-cache group."""
        ids, pos, metas, _ = self._to_device(self.build_host(chunks))
        return ids, pos, metas[0] if len(metas) == 1 else metas

    # ---- attention ------------------------------------------------------------
    def layer_kv(self, layer: int) -> LayerKV:
        """``layer``'s cache, scales, window and query dtype as its backend takes them (built once)."""
        kv = self._layer_kv[layer]
        if kv is None:
            pool = self.pool
            sinks_of = getattr(self.model, "attention_sinks", None)
            sinks = sinks_of(layer) if sinks_of is not None else None
            if sinks is not None and not self.backends[layer].declaration.sinks:
                raise ConfigError(f"layer {layer} has attention sinks but its planned backend "
                                  f"{self.backends[layer].name} does not declare them")
            kv = LayerKV(pool.kv_caches[layer], pool.k_scales[layer], pool.v_scales[layer], self.windows[layer],
                         self.query_dtypes[layer], sinks)
            self._layer_kv[layer] = kv
        return kv

    def pinned_num_splits(self, batch: int, context: int | None = None, query_len: int = 1) -> int | None:
        """The split count a CUDA graph of ``batch`` sequences of ``query_len`` query tokens over contexts up to
        ``context`` (default ``max_model_len``) pins: the first layer's backend's hook over the layers planned
        on it."""
        backend = self.backends[0]
        layers = [layer for layer in self.plan.layers if layer.backend == backend.name]
        return backend.graph_num_splits(layers, batch, context or self.plan.max_model_len, query_len)

    def _attn(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend, kv, meta = self.backends[layer], self.layer_kv(layer), self._metas[self.layer_group[layer]]
        if self.needs_calibration:
            self._calibrate(layer, k, v)
        backend.write_cache(kv, meta.slot_mapping, k, v)
        return backend.attend(kv, meta, q, num_splits=self._num_splits)

    def _rope_attn(self, layer: int, qk: torch.Tensor, num_q_heads: int, v: torch.Tensor, rope,
                   rotary) -> torch.Tensor:
        """:meth:`_attn` of q and k before rope, given as one ``[T, Hq + Hkv, D]`` tensor (q's heads first;
        ``rope``: the step's ``rotary.cos_sin`` tables). Where the layer's backend rotates k on its way into
        the cache (``fuses_rope_with_cache_write``), one kernel rotates q and k and stores k and v; else (and
        while fp8 scales are calibrated from k) rope runs first."""
        backend = self.backends[layer]
        if not backend.fuses_rope_with_cache_write or self.needs_calibration or fused_kernels(qk) is None:
            q, k = rotary.apply_packed(rope, qk, num_q_heads)
            return self._attn(layer, q, k, v)
        kv, meta = self.layer_kv(layer), self._metas[self.layer_group[layer]]
        q = backend.rope_and_write_cache(kv, meta.slot_mapping, qk[:, :num_q_heads], qk[:, num_q_heads:], v,
                                         *rope, rotary.rotary_dim)
        return backend.attend(kv, meta, q, num_splits=self._num_splits)

    def _mla(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
             k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """One MLA layer: store [latent | k_rope] rows, attend (see kvforge/attention/mla_reference.py)."""
        backend, kv, meta = self.backends[layer], self.layer_kv(layer), self._metas[self.layer_group[layer]]
        if self.needs_calibration:
            rows = torch.cat([latent, k_rope.to(latent.dtype)], dim=-1)
            self._calibrate(layer, rows, rows)
        backend.write_cache(kv, meta.slot_mapping, latent, k_rope)
        return backend.attend(kv, meta, q_nope, q_rope, w_uk, w_uv, num_splits=self._num_splits)

    def _mla_rows(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor, norm,
                  rope, rotary, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """:meth:`_mla` from the rows before the latent's norm and rope: ``kv_rows [T, R + P]`` (the latent,
        then the key's rope features), ``norm`` the latent's RMSNorm, ``q_rope`` before rope (``rope``:
        ``rotary.cos_sin`` of the step, ``rotary`` a :class:`kvforge.models.deepseek.DeepseekRotary`). Where
        the layer's backend makes the rows in its cache write (``fuses_mla_rows``), one kernel normalizes,
        rotates and stores them; else (and while fp8 scales are calibrated) the three run apart."""
        backend = self.backends[layer]
        weight = getattr(norm, "weight", None)
        if (not backend.fuses_mla_rows or self.needs_calibration or fused_kernels(kv_rows) is None
                or not getattr(norm, "norm_is_plain_rms", False) or weight is None or weight.dtype != kv_rows.dtype):
            q_rope, latent, k_rope = rotary.latent_rows(rope, q_rope, kv_rows, norm)
            return self._mla(layer, q_nope, q_rope, latent, k_rope, w_uk, w_uv)
        kv, meta = self.layer_kv(layer), self._metas[self.layer_group[layer]]
        q_rope = backend.norm_rope_and_write_mla(kv, meta.slot_mapping, q_rope, kv_rows, weight, norm.eps, *rope,
                                                 rotary.interleave)
        return backend.attend(kv, meta, q_nope, q_rope, w_uk, w_uv, num_splits=self._num_splits)

    def _ring_write(self, layer: int, rows: torch.Tensor) -> None:
        """Store each kept token's row at (its request's slot, position mod R) of the layer's ring page."""
        targets = self._ring_targets
        if targets is None:
            return
        tokens, slots, ring_rows = targets
        page = self.pool.ring_pages[self.ring_of_layer[layer]]
        rings = page[:, : self.ring_rows * self.ring_row_bytes].view(page.shape[0], self.ring_rows,
                                                                    self.ring_row_bytes)
        self.ring_backend.write_cache(LayerKV(rings, None, None), slots, ring_rows, rows[tokens])

    def _ring_step_targets(self, host: HostStep):
        """(token indices, slots, rows) to write this step: only each chunk's last R tokens, so no two
        writes of one step hit the same row (indexed stores with duplicates have no defined order)."""
        slots_per_chunk = self.step_ring_slots
        if not self.pool.ring_pages or slots_per_chunk is None:
            return None
        toks, slots, rows = [], [], []
        R = self.ring_rows
        for i, slot in enumerate(slots_per_chunk):
            lo, hi = int(host.qsl[i]), int(host.qsl[i + 1])
            for t in range(max(lo, hi - R), hi):
                toks.append(t)
                slots.append(slot)
                rows.append(int(host.pos[t]) % R)
        at = values_to_device([toks, slots, rows], self.device)
        return at[0], at[1], at[2]

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        dtype = self.pool.kv_caches[layer].dtype
        ks = compute_scales(k, scheme=self.scale_scheme, dtype=dtype)
        vs = compute_scales(v, scheme=self.scale_scheme, dtype=dtype)
        n = self.pool.k_scales[layer].numel()
        self.pool.k_scales[layer].copy_(ks.float().reshape(-1).expand(n) * self.scale_multiplier)
        self.pool.v_scales[layer].copy_(vs.float().reshape(-1).expand(n) * self.scale_multiplier)
        if layer == max(i for i, c in enumerate(self.pool.kv_caches) if c is not None):  # the last cache calibrated
            self.needs_calibration = False

    def slot_batch(self, host: HostStep) -> SlotBatch:
        """The step's state slots on the device (eager steps; CUDA graphs fill static buffers instead)."""
        spec = host.spec_lens.tolist() if host.spec_lens is not None else None
        snapshots = [tuple(x) for x in host.snapshots.tolist()] if host.snapshots is not None else ()
        return SlotBatch.build(np.diff(host.qsl).tolist(), host.state_slots.tolist(),
                               host.has_initial_state().tolist(), self.device, spec_lens=spec,
                               verify_rows=self.linear_states.verify_rows, snapshots=snapshots)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, num_splits: int | None = None,
                slot_batch: SlotBatch | None = None) -> torch.Tensor:
        """The model over one step's tensors; returns hidden states [T, hidden]. ``meta``: one
        AttentionMetadata per KV-cache group (a tuple), or one AttentionMetadata for a single group.
        ``slot_batch``: the sequences' state slots (required with linear-attention layers)."""
        if self.linear_states is not None:
            if slot_batch is None:
                raise RuntimeError("a model with linear-attention layers needs the step's SlotBatch")
            self.linear_states.set_batch(slot_batch)
        self._metas = (meta,) if isinstance(meta, AttentionMetadata) else tuple(meta)
        if len(self._metas) != self.num_groups:
            raise ValueError(f"{len(self._metas)} attention metadata for {self.num_groups} KV-cache groups")
        self._num_splits = num_splits
        try:
            if self.mtp_proposals:
                hidden = self.mtp_hidden[:input_ids.shape[0]]
                return self.model.mtp_forward(input_ids, positions, hidden, self._attn_api)
            return self.model(input_ids, positions, self._attn_api)
        finally:
            self._metas, self._num_splits = None, None
            if self.linear_states is not None:
                self.linear_states.batch = None

    def release(self) -> None:
        """Give back the device memory this runner holds: the captured CUDA graphs and their static
        inputs, the model's weights (every parameter and buffer becomes an empty tensor, so a caller
        still holding the model does not keep them), the KV pool and the per-layer views, the backend
        objects; and drop the references that tie the runner to its graphs and attention callables.
        Idempotent; the runner cannot run afterwards."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.replay_graphs is not None:
            self.replay_graphs.release()
            self.replay_graphs = None
        self.mtp_hidden = None
        self.graphs_off_reason = "shut down"
        if self.model is not None:
            free_module_tensors(self.model)
            self.model = None
        if self.pool is not None:
            self.pool.release()
        self._layer_kv, self.backends = [], []
        self.ring_backend = None
        self._attn_api = self._ring_targets = None
        self.linear_states = None
        self._metas = ()

    def reset_counters(self) -> None:
        """Step counters back to zero, as on a runner that never stepped (after the startup warm-up)."""
        self.num_graph_steps = self.num_eager_steps = self.num_graph_replays = 0

    def counters(self) -> dict:
        """Step counters and the graph set-up of this runner (rank 0 at TP=1)."""
        g = self.graphs
        return {"rank": 0, "num_graph_steps": self.num_graph_steps, "num_eager_steps": self.num_eager_steps,
                "graph_sizes": g.sizes if g is not None else None,
                "graph_capture_seconds": g.capture_seconds if g is not None else None,
                "graphs_off_reason": self.graphs_off_reason}

    # ---- forward --------------------------------------------------------------
    def wants_graph(self, host: HostStep) -> bool:
        """Whether ``host`` replays a captured decode or verification graph (else the step runs eagerly; so does
        a step that takes prefix-cache snapshots inside its chunks, which no graph captures)."""
        graphs = self.graphs
        return (graphs is not None and graphs.accepts(host) and not self.needs_calibration
                and host.snapshots is None)

    @torch.inference_mode()
    def run(self, chunks, logits_rows: list[int] | None, placeholders=None, share_sampled: int = 0,
            scoring: PromptScoring | None = None):
        """Run one step; return float32 logits for ``logits_rows`` (flat token
        indices), or for every token when ``logits_rows`` is None. ``placeholders``:
        see ``HostStep.placeholders`` (the ids at those rows in ``chunks`` are ignored).
        ``share_sampled`` (the number of tokens the engine will sample from the first
        logits rows) matters only at TP > 1 (kvforge/distributed/runner.py).
        ``scoring``: the last ``scoring.num_rows`` of ``logits_rows`` are prompt rows, scored
        into ``scoring.result`` and left out of the returned logits."""
        host = self.build_host(chunks, logits_rows)
        host.placeholders = placeholders
        self.take_state_slots(host)
        if logits_rows is not None and list(logits_rows) == list(range(host.ids.shape[0])):
            host.rows = None  # every row, in order: no gather
        set_scored_rows(host, scoring)
        return self.execute(host, self.wants_graph(host), scoring)

    def run_picked(self, chunks, logits_rows: list[int] | None, tokens: torch.Tensor):
        """:meth:`run` over one-token chunks whose ids are ``tokens`` [len(chunks)] (int64 on the device: a
        proposer's picks, gathered there, not read to the host; the chunks' own ids are ignored)."""
        rows = list(range(len(chunks)))
        return self.run(chunks, logits_rows, placeholders=(rows, rows, tokens))

    def take_state_slots(self, host: HostStep) -> None:
        """Linear-attention models: move the engine's ``step_state_slots`` (one per sequence) into ``host``."""
        if self.linear_states is None:
            return
        slots, self.step_state_slots = self.step_state_slots, None
        if slots is None or len(slots) != host.num_seqs:
            raise RuntimeError(f"a step of {host.num_seqs} sequences over linear-attention state needs one state "
                               f"slot per sequence (step_state_slots), got {slots!r}")
        host.state_slots = np.asarray(slots, dtype=np.int32)
        spec, self.step_spec_lens = self.step_spec_lens, None
        if spec is not None and any(spec):
            if len(spec) != host.num_seqs:
                raise RuntimeError(f"step_spec_lens needs one entry per sequence ({host.num_seqs}), got {spec!r}")
            host.spec_lens = np.asarray(spec, dtype=np.int32)
        snapshots, self.step_snapshots = self.step_snapshots, None
        if snapshots:
            host.snapshots = np.asarray(snapshots, dtype=np.int32).reshape(-1, 3)

    @torch.inference_mode()
    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Linear-attention state: copy slot ``src`` into slot ``dest`` for each ``(src, dest)`` (stream-ordered
        after the steps launched so far, before the next)."""
        self.linear_states.copy_slots(pairs)

    def _capture_replay_graphs(self, capture: bool) -> None:
        from kvforge.engine.replay_graphs import MAX_BATCH, ReplayGraphs

        if min(self.graphs.sizes) > MAX_BATCH:
            return  # no batch a replay graph serves: every replay runs eagerly
        stream = torch.cuda.current_stream(self.device) if capture else None
        try:
            self.replay_graphs = ReplayGraphs(self.linear_states, self.graphs.sizes, self.device, capture=capture)
        except RuntimeError as e:  # an op the capture forbids: replay eagerly, say why
            if stream is not None:
                torch.cuda.set_stream(stream)
            import logging

            logging.getLogger("kvforge.engine").warning(
                "verified-state replay graphs off: capture failed (%s: %s%s); replaying eagerly", type(e).__name__,
                str(e)[:300], _failure_origin(e))

    @torch.inference_mode()
    def keep_verified(self, slots: list[int], num_rows: list[int]) -> None:
        """After a verify step: each slot advances over the first ``num_rows`` of its sequence's verify rows
        (1 + the accepted proposals); see :meth:`LinearStates.keep_verified`. A replay graph serves it where
        every sequence keeps the same count (kvforge/engine/replay_graphs.py)."""
        graphs = self.replay_graphs
        if graphs is not None and graphs.accepts(list(num_rows)):
            graphs.run(list(slots), list(num_rows))
            self.num_graph_replays += 1
            return
        self.linear_states.keep_verified(slots, num_rows)

    def share_sampled_tokens(self, token_ids: torch.Tensor) -> None:
        """Hand a step's sampled tokens to the other ranks (TP > 1); nothing to do on one rank."""

    def patch_placeholders(self, ids: torch.Tensor, host: HostStep) -> None:
        """Fill in-flight input ids on the device (``HostStep.placeholders``), stream-ordered
        after the host->device copy of ``ids`` and after the step that sampled them."""
        if host.placeholders is None:
            return
        rows, src, tokens = host.placeholders
        idx = values_to_device(np.stack([np.asarray(rows, dtype=np.int64), np.asarray(src, dtype=np.int64)]), self.device)
        ids.index_copy_(0, idx[0], tokens.index_select(0, idx[1]))

    def execute(self, host: HostStep, use_graph: bool, scoring: PromptScoring | None = None) -> torch.Tensor | None:
        """One step from host arrays: graph replay (``use_graph``) or eager; the model's logits
        (float32; None on tensor-parallel ranks other than 0). The last ``host.num_scored`` rows are
        scored into ``scoring`` (every rank takes part; only rank 0 passes ``scoring``)."""
        if use_graph:
            hidden = self.graphs.run(host)
            self.num_graph_steps += 1
            if self.keep_hidden:
                self.last_hidden = hidden
            if host.rows is not None:
                hidden = hidden[self._rows_on_device(host)]
            return self.head(hidden, host, scoring)
        input_ids, positions, meta, rows = self._to_device(host)
        self.patch_placeholders(input_ids, host)
        self._ring_targets = self._ring_step_targets(host)
        slot_batch = self.slot_batch(host) if self.linear_states is not None else None
        try:
            hidden = self.forward(input_ids, positions, meta, slot_batch=slot_batch)
        finally:
            self._ring_targets, self.step_ring_slots = None, None
        self.num_eager_steps += 1
        if self.keep_hidden:
            self.last_hidden = hidden
        if rows is not None:
            hidden = hidden[rows]
        return self.head(hidden, host, scoring)

    def _rows_on_device(self, host: HostStep) -> torch.Tensor:
        """``host.rows`` on the device, copied without waiting (pinned on CUDA): the rows a graph replay's
        output is gathered at."""
        return values_to_device(host.rows, self.device)

    def head(self, hidden: torch.Tensor, host: HostStep, scoring: PromptScoring | None) -> torch.Tensor | None:
        """Logits of the rows of ``hidden`` but its last ``host.num_scored``, which are scored a slice at a
        time (kvforge/engine/prompt_scoring.py) and never held as logits all at once."""
        if not host.num_scored:
            return self.model.compute_logits(hidden)
        kept = hidden.shape[0] - host.num_scored
        score_rows(self.model.compute_logits, hidden[kept:], host.scored_slice_rows, scoring)
        return self.model.compute_logits(hidden[:kept])

    # ---- the multi-token-prediction layer (a runner over the plan's proposer layers) ------------------
    @torch.inference_mode()
    def run_mtp(self, chunks, hidden: torch.Tensor, logits_rows: list[int],
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The model's multi-token-prediction layer over ``chunks`` (as :meth:`run`; the ids are the tokens
        that follow each position) with ``hidden`` [tokens, hidden], one previous hidden state per token;
        returns (float32 logits or None without ``logits``, head inputs) of ``logits_rows``. Its KV goes to
        this runner's layer 0 (a runner over the plan's proposer layers), through the block tables given; a
        captured graph runs it where the chunks fit one (``mtp_proposals``), else it runs eagerly."""
        out = self._mtp_layer(self.build_host(chunks, logits_rows), hidden)
        return (self.mtp_logits(out) if logits else None), out

    def _mtp_layer(self, host: HostStep, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer over ``host`` with previous hidden states ``hidden``; the rows ``host.rows`` of its output
        (``rows``: those already on the device, for a graph replay)."""
        if self.mtp_hidden is not None and self.wants_graph(host):
            self.mtp_hidden[:hidden.shape[0]].copy_(hidden)
            out = self.graphs.run(host)  # valid until this runner's next replay
            self.num_graph_steps += 1
            if host.rows is None or np.array_equal(host.rows, np.arange(out.shape[0])):
                return out
            return out.index_select(0, rows if rows is not None else self._rows_on_device(host))
        self.num_eager_steps += 1
        ids, positions, metas, rows = self._to_device(host)
        self.patch_placeholders(ids, host)
        self._metas, self._num_splits = metas, None
        try:
            out = self.model.mtp_forward(ids, positions, hidden, self._attn_api)
        finally:
            self._metas = None
        return out[rows] if rows is not None else out

    @torch.inference_mode()
    def mtp_logits(self, out: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of the MTP layer's head inputs ``out`` [rows, hidden] (None on a tensor-parallel
        rank other than 0; every rank calls it)."""
        return self.model.mtp_logits(out)

    def link_mtp(self, target: ModelRunner) -> None:
        """Take the MTP layer's input from the hidden states ``target`` keeps of each step."""
        self.mtp_target = target
        target.keep_hidden = True

    @torch.inference_mode()
    def mtp_observe(self, chunks, source_rows: list[int], head_rows: list[int], head_slots: list[int]) -> None:
        """The MTP layer over ``chunks`` (their KV written), row ``j`` reading the linked target's last step's
        hidden state ``source_rows[j]`` (taken: the target holds it no longer); the outputs ``head_rows`` are
        kept as head inputs in ``head_slots`` (slots < ``max_num_seqs``, chosen by the caller)."""
        self._mtp_observe(self.build_host(chunks, head_rows), source_rows, head_slots)

    def _mtp_observe(self, host: HostStep, source_rows, head_slots) -> None:
        hidden, self.mtp_target.last_hidden = self.mtp_target.last_hidden, None
        rows = host.rows if host.rows is not None else np.zeros(0, dtype=np.int64)
        # One copy: the source rows, the rows kept of the output, the head slots.
        idx = values_to_device(np.concatenate([np.asarray(source_rows, dtype=np.int64), rows,
                                             np.asarray(head_slots, dtype=np.int64)]), hidden.device)
        ns, nr = len(source_rows), len(rows)
        out = self._mtp_layer(host, hidden.index_select(0, idx[:ns]), idx[ns:ns + nr])
        if len(head_slots):
            if self._mtp_heads is None:
                self._mtp_heads = out.new_empty((self.max_num_seqs, out.shape[1]))
            self._mtp_heads.index_copy_(0, idx[ns + nr:], out)

    @torch.inference_mode()
    def mtp_first(self, head_slots: list[int]) -> torch.Tensor | None:
        """Logits of the head inputs in ``head_slots`` (a proposal step's first guesses); they are the rows
        :meth:`mtp_next` goes on from."""
        slots = values_to_device(head_slots, self._mtp_heads.device)
        self._mtp_current = self._mtp_heads.index_select(0, slots)
        return self.mtp_logits(self._mtp_current)

    @torch.inference_mode()
    def mtp_next(self, chunks, keep: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The layer again, one token per chunk, row ``j`` going on from row ``keep[j]`` of the last
        :meth:`mtp_first` / :meth:`mtp_next`; the logits of the new rows, which the next call goes on from.
        ``tokens`` (int64 on the device): row ``j``'s token is ``tokens[keep[j]]`` (the chunks' ids are ignored),
        gathered on the device."""
        host = self.build_host(chunks, list(range(len(chunks))))
        if tokens is not None:
            host.placeholders = (list(range(len(chunks))), keep, tokens)
        return self._mtp_next(host, keep)

    def _mtp_next(self, host: HostStep, keep) -> torch.Tensor | None:
        sel = values_to_device(keep, self._mtp_current.device)
        self._mtp_current = self._mtp_layer(host, self._mtp_current.index_select(0, sel))
        return self.mtp_logits(self._mtp_current)


def pack_aligned(arrays: list[np.ndarray], align_bytes: int = 16) -> tuple[np.ndarray, list[int]]:
    """One flat array of ``arrays`` (one dtype) and each one's start offset (elements); every start is a
    multiple of ``align_bytes``, the gaps between them zero."""
    step = max(1, align_bytes // arrays[0].dtype.itemsize)
    starts, at = [], 0
    for a in arrays:
        starts.append(at)
        at += -(-a.size // step) * step
    out = np.zeros(at, dtype=arrays[0].dtype)
    for a, start in zip(arrays, starts):
        out[start:start + a.size] = a.reshape(-1)
    return out, starts


def free_module_tensors(module: torch.nn.Module) -> None:
    """Replace every parameter's data and every buffer of ``module`` (and its children) with an empty
    tensor of the same dtype and device, so their memory is freed even while the module is referenced."""
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(0, dtype=b.dtype, device=b.device)


class _PagedAttn:
    """The attention callable handed to the model: ``attn(layer, q [T, Hq, D], k [T, Hkv, D], v) -> [T, Hq,
    D]`` stores the step's k and v in the layer's cache and attends over it (q and k after rope);
    ``attn.rope_attend(layer, qk [T, Hq + Hkv, D], num_q_heads, v, rope, rotary)`` does the same with q and
    k before rope, q's heads first in ``qk`` (``rotary`` a :class:`kvforge.models.layers.RotaryEmbedding`,
    ``rope`` its ``cos_sin`` tables of the step), so a backend may rotate k on its way into the cache."""

    __slots__ = ("runner",)

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.runner._attn(layer, q, k, v)

    def rope_attend(self, layer: int, qk: torch.Tensor, num_q_heads: int, v: torch.Tensor, rope,
                    rotary) -> torch.Tensor:
        return self.runner._rope_attn(layer, qk, num_q_heads, v, rope, rotary)


class _MLAAttn(_PagedAttn):
    """The attention callable handed to models with MLA layers.

    ``attn(layer, q, k, v)`` is the usual paged attention; ``attn.mla(layer,
    q_nope [T, H, Dn], q_rope [T, H, P], latent [T, R], k_rope [T, P],
    w_uk [H, Dn, R], w_uv [H, V, R]) -> [T, H, V]`` writes the layer's latent
    cache rows and runs its planned MLA backend (``k_rope``/``q_rope`` after
    rope; ``w_uk``/``w_uv`` are ``kv_b_proj.weight.view(H, Dn + V, R)`` split);
    ``attn.mla_rows(layer, q_nope, q_rope, kv_rows [T, R + P], norm, rope,
    rotary, w_uk, w_uv)`` does the same from the rows before the latent's norm
    and rope (DeepSeek's rotary), so a backend may make them in its cache write.
    """

    __slots__ = ()

    def mla(self, layer: int, q_nope, q_rope, latent, k_rope, w_uk, w_uv) -> torch.Tensor:
        return self.runner._mla(layer, q_nope, q_rope, latent, k_rope, w_uk, w_uv)

    def mla_rows(self, layer: int, q_nope, q_rope, kv_rows, norm, rope, rotary, w_uk, w_uv) -> torch.Tensor:
        return self.runner._mla_rows(layer, q_nope, q_rope, kv_rows, norm, rope, rotary, w_uk, w_uv)


class _LinearAttn(_MLAAttn):
    """The attention callable for linear-attention hybrids: ``attn(layer, q, k, v)`` (full layers) and
    ``attn.mla(...)`` (MLA layers) as usual, plus ``attn.short_conv`` / ``attn.delta_rule`` over the pool's
    state slots (:class:`kvforge.attention.linear_state.LinearStates`, batch set by ``forward``)."""

    __slots__ = ()

    def short_conv(self, layer: int, x, weight, bias, activation="silu") -> torch.Tensor:
        return self.runner.linear_states.short_conv(layer, x, weight, bias, activation)

    def delta_rule(self, layer: int, q, k, v, gates, **kw) -> torch.Tensor:
        return self.runner.linear_states.delta_rule(layer, q, k, v, gates, **kw)


class _RingAttn(_PagedAttn):
    """The attention callable for ring models: ``attn(layer, q, k, v)`` as usual,
    plus ``attn.ring(layer, rows [T, ring_row_bytes / elem])`` (see kvforge/models/csa_ring.py)."""

    __slots__ = ()

    def ring(self, layer: int, rows: torch.Tensor) -> None:
        self.runner._ring_write(layer, rows)


def _failure_origin(error: BaseException) -> str:
    """`` at kvforge/x.py:123 (fn)``: where a failed capture's forbidden operation ran, the deepest frame inside
    this package of the first exception in ``error``'s chain that has one (an op that invalidates a capture
    raises there, and ``capture_end`` then raises again in the ``with`` statement's exit), plus that first
    exception's message when it is not ``error`` itself; empty when no frame is in the package."""
    import traceback

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    for exc in reversed(chain):  # the earliest first
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if os.path.abspath(f.filename).startswith(root + os.sep)]
        if frames:
            f = frames[-1]
            where = f" at {os.path.relpath(f.filename, os.path.dirname(root))}:{f.lineno} ({f.name})"
            return where if exc is error else f"{where}; first error {type(exc).__name__}: {str(exc)[:200]}"
    return ""
