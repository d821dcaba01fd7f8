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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvforge.attention import causal_conv1d, gated_delta_rule


@dataclass(frozen=True)
class LinearStateLayout:
    """One linear-attention layer's per-sequence state: conv ``[W - 1, D]`` and recurrent ``[Hv, K, V]``."""

    conv_channels: int
    conv_width: int
    num_value_heads: int
    key_dim: int
    value_dim: int

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


@dataclass(frozen=True)
class SlotBatch:
    """Which state slot each sequence of a step uses (see the module docstring).

    ``query_start_loc`` int32 [N + 1], ``slot_ids`` int32 [N], ``has_initial_state`` bool [N] on the
    device; the ``host_*`` tuples hold the same values for the PyTorch paths. ``max_query_len`` is
    the longest sequence's token count this step (1: a decode-only step).
    """

    query_start_loc: torch.Tensor
    slot_ids: torch.Tensor
    has_initial_state: torch.Tensor
    max_query_len: int
    host_query_start_loc: tuple[int, ...]
    host_slot_ids: tuple[int, ...]
    host_has_initial_state: tuple[bool, ...]

    @classmethod
    def build(cls, query_lens: Sequence[int], slot_ids: Sequence[int], has_initial_state: Sequence[bool],
              device) -> SlotBatch:
        if not len(query_lens) == len(slot_ids) == len(has_initial_state):
            raise ValueError("query_lens, slot_ids and has_initial_state need one entry per sequence")
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + int(n))
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            slot_ids=torch.tensor(list(slot_ids), dtype=torch.int32, device=device),
            has_initial_state=torch.tensor(list(has_initial_state), dtype=torch.bool, device=device),
            max_query_len=max(query_lens, default=0),
            host_query_start_loc=tuple(qsl), host_slot_ids=tuple(int(s) for s in slot_ids),
            host_has_initial_state=tuple(bool(x) for x in has_initial_state),
        )

    def spans(self):
        """``(sequence index, first token, end token, slot, has_initial_state)`` of every non-padding sequence."""
        qsl = self.host_query_start_loc
        for i, slot in enumerate(self.host_slot_ids):
            if slot >= 0:
                yield i, qsl[i], qsl[i + 1], slot, self.host_has_initial_state[i]


KERNEL_DEVICES = ("cuda",)  # tests add "cpu" to run the kernels in Triton's interpreter


def _use_kernels(x: torch.Tensor) -> bool:
    if x.device.type not in KERNEL_DEVICES:
        return False
    from kvforge.kernels import triton_gated_delta_rule

    return triton_gated_delta_rule.HAS_TRITON


class LinearStates:
    """The conv and recurrent state slots of every linear-attention layer, and the current step's batch."""

    def __init__(self, conv: Mapping[int, torch.Tensor], recurrent: Mapping[int, torch.Tensor]):
        if set(conv) != set(recurrent):
            raise ValueError("every linear-attention layer needs both a conv and a recurrent state")
        self.conv = dict(conv)
        self.recurrent = dict(recurrent)
        self.batch: SlotBatch | None = None

    @classmethod
    def allocate(cls, layouts: Mapping[int, LinearStateLayout], num_slots: int, dtype: torch.dtype,
                 device) -> LinearStates:
        """Zeroed state tensors ``[num_slots, ...]`` of ``dtype`` for each layer of ``layouts``."""
        conv = {i: torch.zeros(num_slots, *lay.conv_shape, dtype=dtype, device=device) for i, lay in layouts.items()}
        rec = {i: torch.zeros(num_slots, *lay.recurrent_shape, dtype=dtype, device=device)
               for i, lay in layouts.items()}
        return cls(conv, rec)

    def set_batch(self, batch: SlotBatch) -> None:
        self.batch = batch

    def _batch(self) -> SlotBatch:
        if self.batch is None:
            raise RuntimeError("LinearStates.set_batch must be called before a step")
        return self.batch

    def short_conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   activation: str | None = "silu") -> torch.Tensor:
        """The causal conv of ``x [T, D]`` (``weight [D, W]``) continuing each sequence's conv state."""
        b, states = self._batch(), self.conv[layer]
        if _use_kernels(x):
            from kvforge.kernels.triton_causal_conv1d import conv1d_decode, conv1d_prefill

            if b.max_query_len == 1:
                return conv1d_decode(x, states, b.slot_ids, weight, bias, activation,
                                     has_initial_state=b.has_initial_state)
            return conv1d_prefill(x, states, b.slot_ids, b.query_start_loc, weight, bias, activation,
                                  has_initial_state=b.has_initial_state)
        out = torch.zeros_like(x)
        for _, start, end, slot, has_state in b.spans():
            o, s = causal_conv1d.causal_conv1d(x[start:end], weight, bias, states[slot] if has_state else None,
                                               activation)
            out[start:end] = o
            states[slot].copy_(s)
        return out

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, *, scale: float | None = None, normalize_qk: bool = True) -> torch.Tensor:
        """``o [T, Hv, V]`` of the gated delta rule continuing each sequence's recurrent state."""
        b, states = self._batch(), self.recurrent[layer]
        if _use_kernels(v):
            from kvforge.kernels import triton_gated_delta_rule as kernels

            if b.max_query_len == 1:
                return kernels.decode(q, k, v, g, beta, states, b.slot_ids, has_initial_state=b.has_initial_state,
                                      scale=scale, normalize_qk=normalize_qk)
            return kernels.prefill(q, k, v, g, beta, states, b.slot_ids, b.query_start_loc,
                                   has_initial_state=b.has_initial_state, scale=scale, normalize_qk=normalize_qk)
        out = torch.zeros_like(v)
        for _, start, end, slot, has_state in b.spans():
            form = gated_delta_rule.recurrent if end - start == 1 else gated_delta_rule.chunked
            o, s = form(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
                        states[slot] if has_state else None, scale=scale, normalize_qk=normalize_qk)
            out[start:end] = o
            states[slot].copy_(s)
        return out
