"""The model runner of a tensor-parallel rank.

Rank 0 schedules; for every step it wakes the workers, broadcasts the step's
host inputs (token ids, positions, slot mapping, rows whose logits are wanted,
pending copy-on-write block pairs as int64; query_start_loc, seq_lens, block
tables and, for linear-attention models, each sequence's state slot, the
proposals it verifies and the state-slot operations since the previous step as int32)
over the gloo group, and then every rank runs the same model
step on its own heads. Logits come back on rank 0 only.

CUDA graphs (NCCL only): every rank captures the same decode batch sizes at
startup (the NCCL communicator is warmed up by an all-reduce first, so capture
records the all-reduces of o_proj / down_proj / the embedding inside the
graphs). Rank 0 alone decides, per step, graph replay or eager and sends the
decision in the step header, so the ranks never disagree (a replay on one rank
and an eager step on another would pair different all-reduces). The gloo
broadcast of the step inputs always happens before the replay, outside any
graph; the LM head and the logits gather run eagerly after it. CPU (gloo)
steps are eager.

Async scheduling (kvforge/engine/overlap.py) at TP > 1: a step's input ids
may be in flight (sampled by the previous step on rank 0). The header then
carries the placeholder rows and sources, and after each step that samples,
rank 0 wakes the workers for the tokens and broadcasts the sampled token tensor
over the device group; every worker gathers its next placeholders (of a target
or a draft step) from the copy it received last.

A draft model (speculative method draft_model) runs on every rank too: rank 0's
draft runner is a second TPModelRunner over the draft's layers of the same pool
(``KVPool.draft_view``), whose steps wake the workers with another command and
go through the same broadcast. The two runners share one list of pending
copy-on-write pairs (one pool), so whichever step is broadcast next carries them.

The checkpoint's MTP layer (speculative method mtp) likewise: a runner over the
proposer layer of the pool on every rank, linked to that rank's target runner
(whose hidden states each rank keeps). Each of its calls (``mtp_observe``,
``mtp_first``, ``mtp_next``) wakes the workers with ``STEP_MTP`` and sends the
call's kind and integer arguments (rows, head slots, kept rows), then the step
inputs where the call runs the layer; every rank applies it to its own copies
of the hidden states and head inputs, and the logits reach rank 0 only.
"""

from __future__ import annotations

import numpy as np
import torch

from kvforge.distributed.group import TPGroup
from kvforge.engine.model_runner import HostStep, ModelRunner
from kvforge.engine.prompt_scoring import PromptScoring, set_scored_rows

# n_tok, n_seqs, table cols, n_rows (-1: every row), max_query_len, max_seq_len, n_copies, use_graph (0/1),
# n_placeholders (in-flight input ids, async scheduling), n_share (sampled tokens rank 0 broadcasts after the
# step for the next step's placeholders; 0: none), n_groups (KV-cache groups: slot mappings and block tables),
# n_state (linear-attention models: one state slot per sequence, so n_seqs; 0: none), n_spec (n_seqs when some
# sequence verifies proposals over linear-attention state: the proposals of each; 0: none), n_state_ops
# (state-slot operations every rank applies in order before this step: STATE_KEEP (a verifying slot and the
# accepted rows it replays) or STATE_COPY (a source and a destination slot: prefix snapshots), three int32
# each), n_scored,
# scored_slice_rows (the last logits rows are prompt rows, scored that many at a time:
# kvforge/engine/prompt_scoring.py) and n_snap (prefix snapshots the step stores inside its chunks: sequence,
# token offset, slot, three int32 each; HostStep.snapshots)
_HEADER = 17

#: Worker wake-up commands (one byte on its stdin): a step of the target model, a step of the draft model, a
#: call of the MTP layer, rank 0's sampled tokens of the last target step (async scheduling).
STEP_TARGET, STEP_DRAFT, STEP_MTP, SHARE_TOKENS = b"s", b"d", b"m", b"t"
#: The calls of the MTP layer's runner (``ModelRunner.mtp_observe`` / ``mtp_first`` / ``mtp_next``).
MTP_OBSERVE, MTP_FIRST, MTP_NEXT = 0, 1, 2
#: Worker commands between steps: report the step counters (to the store), set them to zero.
REPORT_COUNTERS, RESET_COUNTERS = b"c", b"z"
#: State-slot operations (linear-attention models), applied by every rank in rank 0's order.
STATE_KEEP, STATE_COPY = 0, 1


def apply_state_ops(linear_states, ops, keep=None) -> None:
    """Apply ``(kind, a, b)`` state-slot operations in order: STATE_KEEP replays ``b`` accepted verify rows
    onto slot ``a`` (``keep(slots, num_rows)``, default LinearStates.keep_verified; a worker passes its
    runner's, which replays from its graphs where it can); STATE_COPY copies slot ``a`` into slot ``b``. Consecutive
    operations of one kind run as one call while none touches a slot an earlier one of the call writes or
    reads as a copy's source (a restore may read the snapshot the copy before it wrote)."""
    i = 0
    while i < len(ops):
        j, reads, writes = i, set(), set()
        while j < len(ops) and ops[j][0] == ops[i][0]:
            _, a, b = ops[j]
            if ops[i][0] == STATE_COPY:
                if a in writes or b in writes or b in reads:
                    break
                reads.add(a)
                writes.add(b)
            j += 1
        pairs = [(a, b) for _, a, b in ops[i:j]]
        if ops[i][0] == STATE_KEEP:
            (keep or linear_states.keep_verified)([a for a, _ in pairs], [b for _, b in pairs])
        elif ops[i][0] == STATE_COPY:
            linear_states.copy_slots(pairs)
        else:
            raise ValueError(f"unknown state-slot operation {ops[i][0]}")
        i = j


def broadcast_step(group: TPGroup, host: HostStep | None, copies: list[tuple[int, int]], use_graph: bool = False,
                   n_share: int = 0, state_ops: list[tuple[int, int, int]] = ()):
    """Rank 0 sends ``(host, copies, use_graph, n_share, state_ops)``; the other ranks receive and return them.
    A received ``host.placeholders`` is ``(rows, sources, None)``: the receiver supplies the token tensor.
    ``state_ops``: the state-slot operations rank 0 applied since the last step (``apply_state_ops``), which
    the receivers apply before the step."""
    if group.rank == 0:
        n_rows = -1 if host.rows is None else host.rows.shape[0]
        ph = host.placeholders
        n_ph = 0 if ph is None else len(ph[0])
        n_state = 0 if host.state_slots is None else host.num_seqs
        n_spec = 0 if host.spec_lens is None else host.num_seqs
        n_snap = 0 if host.snapshots is None else host.snapshots.shape[0]
        header = np.array([host.ids.shape[0], host.num_seqs, host.tables.shape[2], n_rows, host.max_query_len,
                           host.max_seq_len, len(copies), int(use_graph), n_ph, n_share, host.tables.shape[0],
                           n_state, n_spec, len(state_ops), host.num_scored,
                           host.scored_slice_rows, n_snap], dtype=np.int64)
        i64 = np.concatenate([host.ids, host.pos, host.slots.reshape(-1)] + ([host.rows] if n_rows > 0 else [])
                             + [np.asarray(copies, dtype=np.int64).reshape(-1)]
                             + ([np.asarray(ph[0], dtype=np.int64), np.asarray(ph[1], dtype=np.int64)] if n_ph else []))
        i32 = np.concatenate([host.qsl, host.seq_lens, host.tables.reshape(-1)]
                             + ([host.state_slots.astype(np.int32)] if n_state else [])
                             + ([host.spec_lens.astype(np.int32)] if n_spec else [])
                             + ([host.snapshots.astype(np.int32).reshape(-1)] if n_snap else [])
                             + [np.asarray(state_ops, dtype=np.int32).reshape(-1)])
        group.broadcast_host(header, np.int64, _HEADER)
        group.broadcast_host(i64, np.int64, i64.shape[0])
        group.broadcast_host(i32, np.int32, i32.shape[0])
        return host, copies, use_graph, n_share, list(state_ops)
    (n_tok, n_seqs, cols, n_rows, max_q, max_seq, n_copies, graph, n_ph, n_share, n_groups,
     n_state, n_spec, n_ops, n_scored, slice_rows, n_snap) = group.broadcast_host(None, np.int64, _HEADER).tolist()
    i64 = group.broadcast_host(None, np.int64, (2 + n_groups) * n_tok + max(n_rows, 0) + 2 * n_copies + 2 * n_ph)
    n_i32 = 2 * n_seqs + 1 + n_groups * n_seqs * cols
    i32 = group.broadcast_host(None, np.int32, n_i32 + n_state + n_spec + 3 * n_snap + 3 * n_ops)
    start = (2 + n_groups) * n_tok
    end = start + max(n_rows, 0)
    rows = i64[start:end] if n_rows >= 0 else None
    copies = [tuple(p) for p in i64[end:end + 2 * n_copies].reshape(-1, 2).tolist()]
    ph_at = end + 2 * n_copies
    placeholders = (i64[ph_at:ph_at + n_ph], i64[ph_at + n_ph:ph_at + 2 * n_ph], None) if n_ph else None
    host = HostStep(i64[:n_tok], i64[n_tok:2 * n_tok], i64[2 * n_tok:start].reshape(n_groups, n_tok),
                    i32[:n_seqs + 1], i32[n_seqs + 1:2 * n_seqs + 1],
                    i32[2 * n_seqs + 1:n_i32].reshape(n_groups, n_seqs, cols), rows, max_q, max_seq, placeholders)
    if n_state:
        host.state_slots = i32[n_i32:n_i32 + n_state]
    if n_spec:
        host.spec_lens = i32[n_i32 + n_state:n_i32 + n_state + n_spec]
    snap_at = n_i32 + n_state + n_spec
    if n_snap:
        host.snapshots = i32[snap_at:snap_at + 3 * n_snap].reshape(n_snap, 3)
    host.num_scored, host.scored_slice_rows = n_scored, slice_rows
    state_ops = [tuple(p) for p in i32[snap_at + 3 * n_snap:].reshape(-1, 3).tolist()]
    return host, copies, bool(graph), n_share, state_ops


def broadcast_mtp_call(group: TPGroup, kind: int | None, lists: tuple[list[int], ...] = ()
                       ) -> tuple[int, list[np.ndarray]]:
    """Rank 0 sends an MTP call's ``kind`` and integer arguments (at most two lists); the other ranks
    receive and return them."""
    if group.rank == 0:
        header = np.array([kind, len(lists)] + [len(x) for x in lists] + [0] * (2 - len(lists)), dtype=np.int64)
        group.broadcast_host(header, np.int64, 4)
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if lists else np.empty(0, np.int64)
        group.broadcast_host(flat, np.int64, flat.shape[0])
        return kind, [np.asarray(x, dtype=np.int64) for x in lists]
    kind, n_lists, n0, n1 = group.broadcast_host(None, np.int64, 4).tolist()
    flat = group.broadcast_host(None, np.int64, n0 + n1)
    return kind, [flat[:n0], flat[n0:n0 + n1]][:n_lists]


def run_mtp_call(runner: ModelRunner, group: TPGroup, pool) -> None:
    """Workers: receive one call of the MTP layer (after ``STEP_MTP``) and apply it to ``runner``."""
    kind, lists = broadcast_mtp_call(group, None)
    if kind == MTP_FIRST:
        runner.mtp_first(lists[0])
        return
    host, copies, _, _, _ = broadcast_step(group, None, [])
    if copies:
        pool.copy_blocks(copies)
    if kind == MTP_OBSERVE:
        runner._mtp_observe(host, lists[0], lists[1])
    elif kind == MTP_NEXT:
        runner._mtp_next(host, lists[0])
    else:
        raise RuntimeError(f"rank 0 sent an unknown MTP call {kind}")


class TPModelRunner(ModelRunner):
    """ModelRunner for one TP rank. On rank 0 ``control`` wakes the workers
    before a step and turns a failed collective into a clear error. Decode
    CUDA graphs as at TP=1 (``enforce_eager`` turns them off), captured on
    every rank with the same sizes; rank 0 picks graph or eager per step."""

    def __init__(self, model, pool, plan, device, group: TPGroup, *, calibrate: bool = False,
                 scale_multiplier: float = 1.0, control=None, enforce_eager: bool = True, max_num_seqs: int = 256,
                 graph_sizes: list[int] | None = None, step_command: bytes = STEP_TARGET, **runner_options):
        if device.type == "cuda" and not enforce_eager:
            # Bring the NCCL communicator up with a real collective before any capture: the first
            # collective creates it, which must not happen inside a graph.
            group.all_reduce_(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)
        super().__init__(model, pool, plan, device, calibrate=calibrate, scale_multiplier=scale_multiplier,
                         enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, graph_sizes=graph_sizes,
                         **runner_options)
        self.group = group
        self.control = control
        self.step_command = step_command  # the byte that wakes the workers for a step of this runner's model
        self._pending_copies: list[tuple[int, int]] = []  # shared with a linked draft runner (one pool)
        self._linked: list[TPModelRunner] = []  # runners over the same pool whose block tables a copy changes
        self._pending_state_ops: list[tuple[int, int, int]] = []  # state-slot operations, for the other ranks
        self.shared_tokens: torch.Tensor | None = None  # workers: rank 0's last sampled tokens (async scheduling)

    # ---- rank 0 ---------------------------------------------------------------
    def link_draft(self, draft: TPModelRunner) -> None:
        """Make ``draft`` (a runner over this pool's draft layers) share this runner's pending block copies:
        the next step of either model carries them to the other ranks, and a copy invalidates both block
        table caches."""
        draft._pending_copies = self._pending_copies
        self._linked.append(draft)
        draft._linked.append(self)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write here now and on the other ranks before the next step (of either linked model)."""
        self.pool.copy_blocks(pairs)
        self._pending_copies.extend((int(a), int(b)) for a, b in pairs)
        for runner in (self, *self._linked):
            runner.invalidate_block_tables()

    def keep_verified(self, slots: list[int], num_rows: list[int]) -> None:
        """Replay the accepted verify rows here now and on the other ranks before the next step (every step
        that reads a state slot comes after it)."""
        super().keep_verified(slots, num_rows)
        self._pending_state_ops.extend((STATE_KEEP, int(s), int(n)) for s, n in zip(slots, num_rows))

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slots here now and on the other ranks before the next step, in order with the replays."""
        super().copy_state_slots(pairs)
        self._pending_state_ops.extend((STATE_COPY, int(a), int(b)) for a, b in pairs)

    @torch.inference_mode()
    def run(self, chunks, logits_rows: list[int] | None, placeholders=None, share_sampled: int = 0,
            scoring: PromptScoring | None = None):
        """As ``ModelRunner.run``. ``share_sampled`` (async scheduling): the engine will sample that many
        tokens (from the first logits rows) and pass them to :meth:`share_sampled_tokens`, which broadcasts
        them to the workers."""
        host = self.build_host(chunks, logits_rows)
        host.placeholders = placeholders
        self.take_state_slots(host)
        n_share = int(share_sampled)
        if logits_rows is not None and list(logits_rows) == list(range(host.ids.shape[0])):
            host.rows = None
        set_scored_rows(host, scoring)
        copies = list(self._pending_copies)
        self._pending_copies.clear()  # in place: the list is shared with a linked runner
        state_ops, self._pending_state_ops = self._pending_state_ops, []
        use_graph = self.wants_graph(host)
        self.control.before_step(self.step_command)
        try:
            broadcast_step(self.group, host, copies, use_graph, n_share, state_ops)
            return self.execute(host, use_graph, scoring)
        except Exception as e:
            raise self.control.failure(e) from e

    def run_picked(self, chunks, logits_rows: list[int] | None, tokens: torch.Tensor):
        """As ``ModelRunner.run_picked``; the workers get the step's ids from the host, so rank 0 reads them."""
        values = tokens.tolist()
        return self.run([([v], start, tables) for v, (_, start, tables) in zip(values, chunks)], logits_rows)

    def _send_mtp_call(self, kind: int, lists: tuple[list[int], ...], host: HostStep | None) -> None:
        """Wake the workers for one MTP call and send its arguments (and the step inputs of ``host``, with
        the pending block copies)."""
        self.control.before_step(self.step_command)
        try:
            broadcast_mtp_call(self.group, kind, lists)
            if host is not None:
                copies = list(self._pending_copies)
                self._pending_copies.clear()
                broadcast_step(self.group, host, copies)
        except Exception as e:
            raise self.control.failure(e) from e

    @torch.inference_mode()
    def mtp_observe(self, chunks, source_rows: list[int], head_rows: list[int], head_slots: list[int]) -> None:
        host = self.build_host(chunks, head_rows)
        self._send_mtp_call(MTP_OBSERVE, (source_rows, head_slots), host)
        self._mtp_observe(host, source_rows, head_slots)

    @torch.inference_mode()
    def mtp_first(self, head_slots: list[int]) -> torch.Tensor | None:
        if self.group.rank == 0:
            self._send_mtp_call(MTP_FIRST, (head_slots,), None)
        return super().mtp_first(head_slots)

    @torch.inference_mode()
    def mtp_next(self, chunks, keep: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        if tokens is not None:  # the workers get the step's ids from the host: read rank 0's proposals
            values = tokens.tolist()
            chunks = [([values[j]], start, tables) for j, (_, start, tables) in zip(keep, chunks)]
        host = self.build_host(chunks, list(range(len(chunks))))
        self._send_mtp_call(MTP_NEXT, (keep,), host)
        return self._mtp_next(host, keep)

    def share_sampled_tokens(self, token_ids: torch.Tensor) -> None:
        """Rank 0: send this step's sampled tokens (int64, one per logits row) to the workers, which gather
        the next step's in-flight input ids from them on their own device (stream-ordered, no host sync)."""
        if token_ids.numel():
            try:
                self.control.before_share()
                self.group.broadcast_device_(token_ids.contiguous())
            except Exception as e:
                raise self.control.failure(e) from e

    # ---- workers ----------------------------------------------------------------
    def receive_sampled_tokens(self, n: int) -> None:
        """Workers: receive rank 0's ``n`` sampled tokens of the last target step (see share_sampled_tokens)."""
        if n > 0:
            self.shared_tokens = self.group.broadcast_device_(torch.empty(n, dtype=torch.int64, device=self.device))

    # ---- every rank -----------------------------------------------------------
    def execute(self, host: HostStep, use_graph: bool, scoring: PromptScoring | None = None) -> torch.Tensor | None:
        """One step on this rank (graph replay when rank 0 says so); float32 logits on rank 0, None elsewhere
        (prompt rows scored into ``scoring`` on rank 0)."""
        if use_graph and (self.graphs is None or not self.graphs.can_run(host.num_seqs)):
            raise RuntimeError(f"rank 0 asked for a CUDA-graph step of {host.num_seqs} sequences that rank "
                               f"{self.group.rank} did not capture")
        return super().execute(host, use_graph, scoring)

    def counters(self) -> dict:
        return {**super().counters(), "rank": self.group.rank}

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._calibrate(layer, k, v)
        if self.scale_scheme == "per_tensor":  # one scale per layer over all ranks' heads, as at TP=1
            self.group.all_reduce_max_(self.pool.k_scales[layer])
            self.group.all_reduce_max_(self.pool.v_scales[layer])
