"""Per-sequence state slots of linear-attention layers and the two operations models run on them.

A linear-attention layer (Gated DeltaNet, KDA) keeps, per sequence, a fixed-size state instead of
a growing KV cache: the last ``W - 1`` inputs of its short causal conv (``conv [W - 1, D]``) and
the delta rule's recurrent state (``recurrent [Hv, K, V]``). :class:`LinearStates` holds both for
every linear layer as tensors indexed by a slot id (``[num_slots, ...]``); a step's
:class:`SlotBatch` says which slot each sequence of the flat batch uses and whether the slot
already holds that sequence's state (False for a sequence's first chunk: it starts from zeros,
whatever the slot's previous owner left). A slot id < 0 is a padding row (nothing read or written).

Models call :meth:`LinearStates.short_conv` and :meth:`LinearStates.delta_rule` (through the
runner's ``attn`` object); both read each sequence's state from its slot and write the state after
the step's tokens back in place, so a prompt cut into chunks across steps gives the state of one
chunk. On CUDA with Triton (devices in ``KERNEL_DEVICES``): decode-only steps run the slot kernels
(kvforge/kernels/triton_gated_delta_rule.py, triton_causal_conv1d.py: no host sync), prefill steps
the prefill kernels; elsewhere the PyTorch reference
(kvforge/attention/gated_delta_rule.py, causal_conv1d.py) per sequence, from the host copies of
the batch.

Speculative decoding (docs/LINEAR_ATTENTION.md, "Speculative decoding"): a sequence verifying ``k``
proposals brings ``1 + k`` rows (``SlotBatch.spec_lens``). Its outputs are computed from its slot as
for any chunk, but its state is not written back: the slot keeps the state before the step, and the
rows' inputs (conv input, k, v, gate, beta; float32) go to the sequence's verify rows
(:class:`VerifyRows`, ``1 + k`` per slot and layer). Once verification accepted ``a`` proposals,
:meth:`LinearStates.keep_verified` replays the first ``1 + a`` kept rows onto the slot: the slot then
holds the state after exactly the sequence's computed tokens, as if the rejected rows never ran.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvforge.attention import causal_conv1d, gated_delta_rule
from kvforge.attention.delta_rule_gates import DeltaGates, GateValues
from kvforge.attention.routing import delta_rule as delta_rule_route
from kvforge.host_copies import values_to_device


@dataclass(frozen=True)
class LinearStateLayout:
    """One linear-attention layer's per-sequence state: conv ``[W - 1, D]`` and recurrent ``[Hv, K, V]``;
    ``num_key_heads`` (``Hk``) and ``gate_per_channel`` (a gate per key channel, KDA, or one per head) shape
    the inputs a verify step keeps per row."""

    conv_channels: int
    conv_width: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    num_key_heads: int
    gate_per_channel: bool

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_width - 1, self.conv_channels)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_dim, self.value_dim)

    @property
    def elements(self) -> int:
        """State elements per sequence (the spec's ``StateLayerSpec.state_elements``)."""
        return (self.conv_width - 1) * self.conv_channels + self.num_value_heads * self.key_dim * self.value_dim

    @property
    def gate_shape(self) -> tuple[int, ...]:
        return (self.num_value_heads, self.key_dim) if self.gate_per_channel else (self.num_value_heads,)

    def verify_row_shapes(self) -> dict[str, tuple[int, ...]]:
        """One verify row's kept inputs: conv input ``[D]``, k ``[Hk, K]``, v ``[Hv, V]``, gate, beta ``[Hv]``."""
        return {"conv_input": (self.conv_channels,), "k": (self.num_key_heads, self.key_dim),
                "v": (self.num_value_heads, self.value_dim), "g": self.gate_shape, "beta": (self.num_value_heads,)}

    @property
    def token_input_elements(self) -> int:
        """Elements of one verify row (the spec's ``StateLayerSpec.token_input_elements``)."""
        return sum(_numel(shape) for shape in self.verify_row_shapes().values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: The dtype of verify rows: every input a kernel reads converts to it exactly.
VERIFY_ROW_DTYPE = torch.float32
#: The most bytes a replay of accepted rows gathers from the verify table at once for every layer; a larger
#: replay gathers each layer's columns alone (a row of every layer is 2.07 MB on one rank of Qwen3-Next-80B,
#: so 256 sequences keeping 4 rows would take 2.1 GB at once).
KEPT_GATHER_BYTES = 256 << 20
#: The prefix-cache snapshots one sequence may take inside one step (kvforge/engine/state_prefix.py plans at
#: most this many; the kernels read this many pairs a sequence, a power of two).
SNAPSHOTS_PER_SEQUENCE = 4


class VerifyRows:
    """One layer's kept inputs of verify steps: per name of :meth:`LinearStateLayout.verify_row_shapes`, row
    ``s * rows + j`` (``rows`` = 1 + the speculative token count) holds the ``j``-th row of the last verify
    step of the sequence holding slot ``s``. The names sit side by side in columns ``column ..`` of ``table``
    (float32 ``[num_slots * rows, width]``), which other layers' rows may share, so one gather of the table's
    rows reads every name of every such layer."""

    def __init__(self, table: torch.Tensor, layout: LinearStateLayout, rows: int, column: int = 0):
        if table.dim() != 2 or table.shape[0] % rows:
            raise ValueError(f"verify rows need a table [num_slots * {rows}, width], got {tuple(table.shape)}")
        self.table, self.rows = table, rows
        #: The table column of this layer's first.
        self.first = column
        #: name -> (first column in the table, shape of one row)
        self.columns: dict[str, tuple[int, tuple[int, ...]]] = {}
        for name, shape in layout.verify_row_shapes().items():
            self.columns[name] = (column, tuple(shape))
            column += _numel(shape)
        #: The column after this layer's last.
        self.end = column
        #: Bytes of one slot's rows of this layer.
        self.bytes_per_slot = rows * sum(_numel(shape) for _, shape in self.columns.values()) * table.element_size()
        if column > table.shape[1]:
            raise ValueError(f"verify rows take columns up to {column}, the table has {table.shape[1]}")

    @classmethod
    def allocate(cls, layout: LinearStateLayout, num_slots: int, rows: int, device,
                 dtype: torch.dtype = VERIFY_ROW_DTYPE) -> VerifyRows:
        """Zeroed rows in a table of their own; ``dtype`` float64 only for float64 reference runs (the pool's
        rows are float32)."""
        table = torch.zeros((num_slots * rows, layout.token_input_elements), dtype=dtype, device=device)
        return cls(table, layout, rows)

    def of(self, name: str, table_rows: torch.Tensor, first: int = 0) -> torch.Tensor:
        """``[n, *shape]``: the name's columns of ``table_rows`` (rows of the table, or of a gather of them,
        whose column 0 is the table's column ``first``) as a view."""
        start, shape = self.columns[name]
        start -= first
        return table_rows[:, start:start + _numel(shape)].unflatten(1, shape)

    def flat(self, name: str) -> torch.Tensor:
        """``[num_slots * rows, *shape]``: row ``j`` of slot ``s`` at ``s * rows + j`` (a view of the table)."""
        return self.of(name, self.table)

    def keep(self, name: str, x: torch.Tensor, batch: SlotBatch) -> None:
        """Store the step's verify rows of ``x`` (token-major) at their sequences' slots."""
        flat = self.flat(name)
        flat.index_copy_(0, batch.verify_dest, x.index_select(0, batch.verify_src).to(flat.dtype))


@dataclass(frozen=True)
class SlotBatch:
    """Which state slot each sequence of a step uses (see the module docstring).

    ``query_start_loc`` int32 [N + 1], ``slot_ids`` int32 [N], ``has_initial_state`` bool [N] on the
    device; the ``host_*`` tuples hold the same values for the PyTorch paths. ``max_query_len`` is
    the longest sequence's token count this step (1: a decode-only step).

    ``host_spec_lens``: per sequence, the proposals it verifies this step (its last ``spec_lens[i]``
    rows; 0 for every other sequence). Verifying sequences keep their slot's state unwritten:
    ``store_slot_ids`` is ``slot_ids`` with -1 at them (where the kernels store final states), and
    their rows go to the verify rows: token ``verify_src[j]`` to flat row ``verify_dest[j]``
    (``slot * verify_rows + row``), int64; both None without verifying sequences.

    ``host_snapshots``: ``(sequence index, offset, slot)`` of each prefix-cache snapshot taken inside the
    step (kvforge/engine/state_prefix.py): the sequence's state after its token ``offset`` of the step (0 its
    first) is also stored at ``slot``; ``snapshots`` the same as the kernels read it (int32 ``[N, 2 *
    SNAPSHOTS_PER_SEQUENCE]``, per sequence its ``(offset, slot)`` pairs, -1 for none), None without snapshots.
    """

    query_start_loc: torch.Tensor
    slot_ids: torch.Tensor
    has_initial_state: torch.Tensor
    max_query_len: int
    host_query_start_loc: tuple[int, ...]
    host_slot_ids: tuple[int, ...]
    host_has_initial_state: tuple[bool, ...]
    host_spec_lens: tuple[int, ...] = ()
    store_slot_ids: torch.Tensor | None = None
    verify_src: torch.Tensor | None = None
    verify_dest: torch.Tensor | None = None
    host_snapshots: tuple[tuple[int, int, int], ...] = ()
    snapshots: torch.Tensor | None = None

    @classmethod
    def build(cls, query_lens: Sequence[int], slot_ids: Sequence[int], has_initial_state: Sequence[bool],
              device, spec_lens: Sequence[int] | None = None, verify_rows: int = 0,
              snapshots: Sequence[tuple[int, int, int]] = ()) -> SlotBatch:
        """``spec_lens`` (optional, one per sequence): proposals verified per sequence; ``verify_rows``: the
        verify rows per slot (1 + the speculative token count), needed when any ``spec_lens`` is non-zero;
        ``snapshots``: ``(sequence index, offset, slot)``, at most ``SNAPSHOTS_PER_SEQUENCE`` per sequence at
        distinct offsets, each before the sequence's last token of the step (a snapshot at its end is a copy
        after the step)."""
        spec_lens = [0] * len(query_lens) if spec_lens is None else [int(n) for n in spec_lens]
        if not len(query_lens) == len(slot_ids) == len(has_initial_state) == len(spec_lens):
            raise ValueError("query_lens, slot_ids, has_initial_state and spec_lens need one entry per sequence")
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + int(n))
        src, dest, store = [], [], [int(x) for x in slot_ids]
        for i, n in enumerate(spec_lens):
            if n and store[i] >= 0:
                if not 0 < n + 1 <= min(verify_rows, int(query_lens[i])):
                    raise ValueError(f"sequence {i} verifies {n} proposals in {query_lens[i]} rows but a slot keeps "
                                     f"{verify_rows} verify rows")
                src.extend(range(qsl[i + 1] - n - 1, qsl[i + 1]))
                dest.extend(store[i] * verify_rows + j for j in range(n + 1))
                store[i] = -1
        snap_rows = [[] for _ in query_lens]
        for i, offset, slot in snapshots:
            row = snap_rows[i]
            if not (0 <= offset < int(query_lens[i]) - 1 and slot >= 0 and int(slot_ids[i]) >= 0 and not spec_lens[i]):
                raise ValueError(f"snapshot ({i}, {offset}, {slot}) is not inside sequence {i}'s tokens of the step")
            if offset in row[0::2]:
                raise ValueError(f"sequence {i} has two snapshots after its token {offset}")
            if len(row) == 2 * SNAPSHOTS_PER_SEQUENCE:
                raise ValueError(f"sequence {i} has more than {SNAPSHOTS_PER_SEQUENCE} snapshots in one step")
            row.extend((offset, slot))
        snap_rows = [row + [-1] * (2 * SNAPSHOTS_PER_SEQUENCE - len(row)) for row in snap_rows]
        slots_t = values_to_device(list(slot_ids), device, torch.int32)
        return cls(
            query_start_loc=values_to_device(qsl, device, torch.int32),
            slot_ids=slots_t,
            has_initial_state=values_to_device(list(has_initial_state), device, torch.bool),
            max_query_len=max(query_lens, default=0),
            host_query_start_loc=tuple(qsl), host_slot_ids=tuple(int(s) for s in slot_ids),
            host_has_initial_state=tuple(bool(x) for x in has_initial_state),
            host_spec_lens=tuple(spec_lens),
            store_slot_ids=values_to_device(store, device, torch.int32) if src else slots_t,
            verify_src=values_to_device(src, device) if src else None,
            verify_dest=values_to_device(dest, device) if src else None,
            host_snapshots=tuple((int(i), int(o), int(sl)) for i, o, sl in snapshots),
            snapshots=values_to_device(snap_rows, device, torch.int32) if snapshots else None,
        )

    @property
    def verifies(self) -> bool:
        """Whether some sequence of the step verifies proposals."""
        return self.verify_src is not None

    def spans(self):
        """``(sequence index, first token, end token, slot, has_initial_state)`` of every non-padding sequence."""
        qsl = self.host_query_start_loc
        for i, slot in enumerate(self.host_slot_ids):
            if slot >= 0:
                yield i, qsl[i], qsl[i + 1], slot, self.host_has_initial_state[i]

    @functools.cached_property
    def host_query_lens(self) -> tuple[int, ...]:
        """Each sequence's tokens in the step, 0 for padding sequences (slot -1); computed once a step, read
        by every state layer."""
        qsl = self.host_query_start_loc
        return tuple(qsl[i + 1] - qsl[i] if slot >= 0 else 0 for i, slot in enumerate(self.host_slot_ids))

    @functools.cached_property
    def _delta_rule_forms(self) -> dict[bool, delta_rule_route.PrefillForm]:
        return {}

    def delta_rule_form(self, per_channel: bool) -> delta_rule_route.PrefillForm:
        """The delta-rule route's form for this step's prefill with per-head or per-channel gates
        (kvforge/attention/routing/delta_rule.py), decided once a step for every state layer."""
        forms = self._delta_rule_forms
        if per_channel not in forms:
            lens = self.host_query_lens
            forms[per_channel] = delta_rule_route.prefill_form(len(lens), self.host_query_start_loc[-1],
                                                               per_channel, lens)
        return forms[per_channel]

    def snapshots_of(self, i: int) -> list[tuple[int, int]]:
        """``(offset, slot)`` of sequence ``i``'s snapshots in this step, by offset."""
        return sorted((o, sl) for j, o, sl in self.host_snapshots if j == i)

    def writes_state(self, i: int) -> bool:
        """Whether sequence ``i`` stores its state after the step (False while it verifies proposals)."""
        return not (self.host_spec_lens and self.host_spec_lens[i])


KERNEL_DEVICES = ("cuda",)  # tests add "cpu" to run the kernels in Triton's interpreter


def _use_kernels(x: torch.Tensor) -> bool:
    if x.device.type not in KERNEL_DEVICES:
        return False
    from kvforge.kernels import triton_gated_delta_rule

    return triton_gated_delta_rule.HAS_TRITON


class LinearStates:
    """The conv and recurrent state slots of every linear-attention layer, their verify rows (speculative
    decoding only; None otherwise), and the current step's batch."""

    def __init__(self, conv: Mapping[int, torch.Tensor], recurrent: Mapping[int, torch.Tensor],
                 verify: Mapping[int, VerifyRows] | None = None):
        if set(conv) != set(recurrent) or (verify is not None and set(verify) != set(conv)):
            raise ValueError("every linear-attention layer needs a conv and a recurrent state (and verify rows, "
                             "when any layer has them)")
        self.conv = dict(conv)
        self.recurrent = dict(recurrent)
        self.verify = dict(verify) if verify is not None else None
        self.verify_rows = next(iter(self.verify.values())).rows if self.verify else 0
        self.batch: SlotBatch | None = None
        #: Per layer, whether the last verify step normalised q and k (a replay normalises k as it did).
        self._normalize_qk: dict[int, bool] = {}

    @classmethod
    def allocate(cls, layouts: Mapping[int, LinearStateLayout], num_slots: int, dtype: torch.dtype,
                 device, verify_rows: int = 0) -> LinearStates:
        """Zeroed state tensors ``[num_slots, ...]`` of ``dtype`` for each layer of ``layouts``; with
        ``verify_rows`` (1 + the speculative token count), zeroed verify rows as well."""
        conv = {i: torch.zeros(num_slots, *lay.conv_shape, dtype=dtype, device=device) for i, lay in layouts.items()}
        rec = {i: torch.zeros(num_slots, *lay.recurrent_shape, dtype=dtype, device=device)
               for i, lay in layouts.items()}
        rows_dtype = torch.float64 if dtype == torch.float64 else VERIFY_ROW_DTYPE
        verify = ({i: VerifyRows.allocate(lay, num_slots, verify_rows, device, rows_dtype)
                   for i, lay in layouts.items()} if verify_rows else None)
        return cls(conv, rec, verify)

    def set_batch(self, batch: SlotBatch) -> None:
        if batch.verifies and self.verify is None:
            raise RuntimeError("a step verifies speculative proposals but the state slots keep no verify rows "
                               "(the plan was made without speculative tokens)")
        self.batch = batch

    def _batch(self) -> SlotBatch:
        if self.batch is None:
            raise RuntimeError("LinearStates.set_batch must be called before a step")
        return self.batch

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   activation: str | None = "silu") -> torch.Tensor:
        """The causal conv of ``x [T, D]`` (``weight [D, W]``) continuing each sequence's conv state."""
        b, states = self._batch(), self.conv[layer]
        if b.verifies:
            self.verify[layer].keep("conv_input", x, b)
        if b.host_snapshots:  # before the step's conv rewrites the sequences' slots
            for i, start, _, slot, has_state in b.spans():
                for offset, dest in b.snapshots_of(i):
                    before = states[slot] if has_state else torch.zeros_like(states[slot])
                    states[dest].copy_(causal_conv1d.state_after(before, x[start:start + offset + 1]))
        if _use_kernels(x):
            from kvforge.kernels.triton_causal_conv1d import conv1d_decode, conv1d_prefill

            if b.max_query_len == 1:
                return conv1d_decode(x, states, b.slot_ids, weight, bias, activation,
                                     has_initial_state=b.has_initial_state)
            return conv1d_prefill(x, states, b.slot_ids, b.query_start_loc, weight, bias, activation,
                                  has_initial_state=b.has_initial_state, store_slot_ids=b.store_slot_ids)
        out = torch.zeros_like(x)
        for i, start, end, slot, has_state in b.spans():
            o, s = causal_conv1d.causal_conv1d(x[start:end], weight, bias, states[slot] if has_state else None,
                                               activation)
            out[start:end] = o
            if b.writes_state(i):
                states[slot].copy_(s)
        return out

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   gates: GateValues | DeltaGates, *, scale: float | None = None,
                   normalize_qk: bool = True) -> torch.Tensor:
        """``o [T, Hv, V]`` of the gated delta rule continuing each sequence's recurrent state. A one-token
        step on the kernels computes :class:`DeltaGates` inside the recurrent kernel; others compute them
        first (kvforge/attention/delta_rule_gates.py)."""
        b, states = self._batch(), self.recurrent[layer]
        if isinstance(gates, DeltaGates) and _use_kernels(v) and b.max_query_len == 1 and not b.verifies:
            from kvforge.kernels import triton_gated_delta_rule as kernels

            f, raw_b = gates.projections()
            return kernels.decode(q, k, v, f, raw_b, states, b.slot_ids, has_initial_state=b.has_initial_state,
                                  scale=scale, normalize_qk=normalize_qk, dt_bias=gates.dt_bias, a_log=gates.a_log)
        g, beta = gates.values()
        if b.verifies:
            rows = self.verify[layer]
            for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
                rows.keep(name, x, b)
            self._normalize_qk[layer] = normalize_qk
        if _use_kernels(v):
            from kvforge.kernels import triton_gated_delta_rule as kernels

            if b.max_query_len == 1:
                return kernels.decode(q, k, v, g, beta, states, b.slot_ids, has_initial_state=b.has_initial_state,
                                      scale=scale, normalize_qk=normalize_qk)
            return kernels.prefill(q, k, v, g, beta, states, b.slot_ids, b.query_start_loc,
                                   has_initial_state=b.has_initial_state, scale=scale, normalize_qk=normalize_qk,
                                   store_slot_ids=b.store_slot_ids, snapshots=b.snapshots,
                                   host_query_lens=b.host_query_lens, form=b.delta_rule_form(g.dim() == 3))
        out = torch.zeros_like(v)
        for i, start, end, slot, has_state in b.spans():
            s = states[slot] if has_state else None
            pieces = [(start + offset + 1, dest) for offset, dest in b.snapshots_of(i)] + [(end, None)]
            for piece_end, dest in pieces:  # each snapshot ends a piece; the state goes on from it
                form = gated_delta_rule.recurrent if piece_end - start == 1 else gated_delta_rule.chunked
                o, s = form(q[start:piece_end], k[start:piece_end], v[start:piece_end], g[start:piece_end],
                            beta[start:piece_end], s, scale=scale, normalize_qk=normalize_qk)
                out[start:piece_end] = o
                if dest is not None:
                    states[dest].copy_(s)
                start = piece_end
            if b.writes_state(i):
                states[slot].copy_(s)
        return out

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slot ``src`` into slot ``dest`` for each ``(src, dest)`` of ``pairs``, conv and recurrent state
        of every layer (no destination may be a source of the same call)."""
        if not pairs:
            return
        src, dest = zip(*pairs)
        if set(src) & set(dest) or len(set(dest)) != len(dest):
            raise ValueError(f"state slot copies need distinct destinations that are no source: {list(pairs)}")
        dev = next(iter(self.conv.values())).device
        idx = torch.tensor([src, dest], dtype=torch.int64)
        if dev.type == "cuda":
            idx = idx.pin_memory().to(dev, non_blocking=True)  # no host sync with the steps in flight
        src_t, dest_t = idx[0], idx[1]
        for states in (*self.conv.values(), *self.recurrent.values()):
            states.index_copy_(0, dest_t, states.index_select(0, src_t))

    def keep_verified(self, slot_ids: Sequence[int], num_rows: Sequence[int]) -> None:
        """After verification: slot ``slot_ids[i]`` (which holds its sequence's state before its last verify
        step) advances over that step's first ``num_rows[i]`` rows (1 + the accepted proposals), replayed from
        the verify rows, in every layer. The slot then holds the state after exactly the sequence's computed
        tokens; the rejected rows leave no trace."""
        if len(slot_ids) != len(num_rows):
            raise ValueError("keep_verified needs one row count per slot")
        if not slot_ids:
            return
        if self.verify is None:
            raise RuntimeError("keep_verified needs verify rows (a plan made with speculative tokens)")
        self.check_kept(slot_ids, num_rows)
        r = self.verify_rows
        src, qsl = [], [0]
        for slot, n in zip(slot_ids, num_rows):
            src.extend(slot * r + j for j in range(n))
            qsl.append(qsl[-1] + n)
        some = next(iter(self.conv.values()))
        dev = some.device
        src_t = values_to_device(src, dev)
        if _use_kernels(some):
            slots_t = values_to_device(list(slot_ids), dev, torch.int32)
            qsl_t = values_to_device(qsl, dev, torch.int32)
            self.replay_on_kernels(src_t, slots_t, qsl_t, list(num_rows))
            return
        kept_of = self._gather_kept(src_t)
        for layer, rows in self.verify.items():
            x, k, v, g, beta = (rows.of(name, *kept_of[layer]) for name in ("conv_input", "k", "v", "g", "beta"))
            normalize = self._normalize_qk.get(layer, True)
            for i, slot in enumerate(slot_ids):
                span = slice(qsl[i], qsl[i + 1])
                conv = self.conv[layer][slot]
                conv.copy_(causal_conv1d.state_after(conv, x[span]))
                _, s = gated_delta_rule.recurrent(k[span], k[span], v[span], g[span], beta[span],
                                                  self.recurrent[layer][slot], normalize_qk=normalize)
                self.recurrent[layer][slot].copy_(s)

    def on_kernels(self) -> bool:
        """Whether the state operations run on the Triton kernels (a device in ``KERNEL_DEVICES``)."""
        return _use_kernels(next(iter(self.conv.values())))

    def check_kept(self, slot_ids: Sequence[int], num_rows: Sequence[int]) -> None:
        """Refuse a replay of rows a verify step cannot have kept (a slot below 0, a count outside 1 .. 1 + k)."""
        r = self.verify_rows
        for slot, n in zip(slot_ids, num_rows):
            if not 0 < n <= r or slot < 0:
                raise ValueError(f"slot {slot}: {n} rows to keep, a verify step has 1 .. {r}")

    def replay_normalization(self) -> tuple[bool, ...]:
        """Per state layer (in order), whether a replay normalises k: as the layer's last verify step did
        (True before any)."""
        return tuple(self._normalize_qk.get(layer, True) for layer in self.verify or ())

    def _gather_kept(self, src: torch.Tensor) -> dict[int, tuple[torch.Tensor, int]]:
        """Per state layer, the verify-table rows ``src`` of its columns and the table column their column 0
        is: one gather of each table for every layer in it, or, where that gather would pass
        :data:`KEPT_GATHER_BYTES`, one gather of each layer's own columns."""
        kept, whole = {}, {}
        for layer, rows in self.verify.items():
            table = rows.table
            if src.shape[0] * table.shape[1] * table.element_size() <= KEPT_GATHER_BYTES:
                if id(table) not in whole:
                    whole[id(table)] = table.index_select(0, src)
                kept[layer] = (whole[id(table)], 0)
            else:
                kept[layer] = (table[:, rows.first:rows.end].index_select(0, src), rows.first)
        return kept

    def replay_on_kernels(self, src: torch.Tensor, slot_ids: torch.Tensor, query_start_loc: torch.Tensor,
                          lengths: Sequence[int]) -> None:
        """The device part of :meth:`keep_verified` on the Triton kernels: sequence ``i`` (slot ``slot_ids[i]``,
        -1 a padding sequence the kernels skip) advances over the verify-table rows ``src[query_start_loc[i]:
        query_start_loc[i + 1]]``; ``lengths`` its row counts (the route's). No host read: a CUDA graph may
        capture it over static inputs."""
        from kvforge.kernels import triton_gated_delta_rule as rule_kernels
        from kvforge.kernels.triton_causal_conv1d import conv1d_update_states

        every_slot_held = torch.ones_like(slot_ids, dtype=torch.bool)
        forms: dict[bool, delta_rule_route.PrefillForm] = {}  # the route asked once a replay, per gate kind
        kept_of = self._gather_kept(src)
        for layer, rows in self.verify.items():
            x, k, v, g, beta = (rows.of(name, *kept_of[layer]) for name in ("conv_input", "k", "v", "g", "beta"))
            conv1d_update_states(x, self.conv[layer], slot_ids, query_start_loc, has_initial_state=every_slot_held)
            per_channel = g.dim() == 3
            if per_channel not in forms:
                forms[per_channel] = delta_rule_route.prefill_form(len(lengths), sum(lengths), per_channel, lengths)
            rule_kernels.prefill(k, k, v, g, beta, self.recurrent[layer], slot_ids, query_start_loc,
                                 normalize_qk=self._normalize_qk.get(layer, True), store_output=False,
                                 host_query_lens=lengths, form=forms[per_channel])
