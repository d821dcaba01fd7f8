"""The interface every attention backend implements, and the registry the model runner picks from.

A backend object serves every layer the plan routed to it. Per layer it is handed a :class:`LayerKV`
(the layer's cache view, fp8 scales, window and the plan's query dtype) and, per step, the step's
:class:`~kvforge.attention.metadata.AttentionMetadata`:

- :meth:`AttentionBackend.write_cache` stores the step's new rows (``k, v`` for full/sliding layers;
  ``latent, k_rope`` for MLA layers; ring rows for rings); a backend that declares
  ``fuses_rope_with_cache_write`` also offers :meth:`AttentionBackend.rope_and_write_cache`, rope on q and
  k with the write in one kernel, and one that declares ``fuses_mla_rows``
  :meth:`AttentionBackend.norm_rope_and_write_mla`, an MLA layer's latent norm and rope with the write;
- :meth:`AttentionBackend.attend` runs the layer's attention for the step, prefill, decode or mixed
  (``q`` for full/sliding layers; ``q_nope, q_rope, w_uk, w_uv`` for MLA layers); ``num_splits`` is the
  split count a CUDA graph pinned (None when eager);
- :meth:`AttentionBackend.graph_num_splits` is the CUDA-graph hook: the split count to pin for a decode
  batch of a capture size (None: the backend's kernels take no split count). The graph runner only calls
  it; the rule is the backend's routing table.

What a backend accepts is its :class:`~kvforge.planner.declaration.BackendDeclaration` (torch-free, read by
the planner); ``declaration.implementation`` names the module that registers the object here.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing.platform import Device
from kvforge.planner.declaration import BackendDeclaration


@dataclass(frozen=True)
class BackendOptions:
    """What the engine tells every backend: the softmax scale, the model dtype, the MLA latent width
    (``kv_lora_rank``; None for other models), the MLA prefill mode (an engine argument) and the device
    facts routing reads."""

    softmax_scale: float
    model_dtype: str
    device: Device
    latent_dim: int | None = None
    mla_prefill_mode: str = "auto"


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache as a backend sees it: the cache view, the fp8 scales (float32 ``[num_kv_heads]``;
    MLA: one per-tensor value), the sliding window (None: unbounded), the plan's query dtype (None: the
    model dtype) and the attention sinks (only on backends that declare them)."""

    cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    window: int | None = None
    query_dtype: str | None = None
    sinks: torch.Tensor | None = None  # one logit per query head of this rank (attention sinks), or None


class AttentionBackend(ABC):
    """One backend (see the module docstring)."""

    declaration: ClassVar[BackendDeclaration]
    #: Whether decode steps on this backend may be captured as CUDA graphs (the PyTorch references read
    #: tensor values on the host, which capture forbids).
    captures_cuda_graphs: ClassVar[bool] = False
    #: Whether :meth:`rope_and_write_cache` serves: k rotated on its way into the cache, in one kernel with
    #: q's rope (a backend may answer per instance).
    fuses_rope_with_cache_write: bool = False
    #: Whether :meth:`norm_rope_and_write_mla` serves: an MLA layer's latent norm and rope with its cache
    #: write in one kernel.
    fuses_mla_rows: bool = False

    def __init__(self, options: BackendOptions):
        self.options = options

    @property
    def name(self) -> str:
        return self.declaration.name

    @abstractmethod
    def write_cache(self, kv: LayerKV, slot_mapping: torch.Tensor, *rows: torch.Tensor) -> None:
        """Store one step's new rows at ``slot_mapping`` (-1: skip)."""

    def rope_and_write_cache(self, kv: LayerKV, slot_mapping: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX rope (rotate-half over the first ``rotary_dim`` features, ``cos``/``sin`` of
        :meth:`kvforge.models.layers.RotaryEmbedding.cos_sin`) on ``q`` and ``k``; the rotated ``k`` and ``v``
        stored as :meth:`write_cache` stores them; returns the rotated ``q``. Only where
        ``fuses_rope_with_cache_write``."""
        raise NotImplementedError(f"{self.name} does not rotate k into its cache")

    def norm_rope_and_write_mla(self, kv: LayerKV, slot_mapping: torch.Tensor, q_rope: torch.Tensor,
                                kv_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                                sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """MLA rows made and stored at once: ``RMSNorm(kv_rows[:, :R])`` (``norm_weight``, ``eps``) and the
        rotated ``kv_rows[:, R:]`` stored as :meth:`write_cache` stores ``latent, k_rope``; returns the rotated
        ``q_rope`` (DeepSeek's rope: ``cos``/``sin`` of :meth:`kvforge.models.deepseek.DeepseekRotary.cos_sin`,
        pairs interleaved or not). Only where ``fuses_mla_rows``."""
        raise NotImplementedError(f"{self.name} does not make MLA rows in its cache write")

    @abstractmethod
    def attend(self, kv: LayerKV, meta: AttentionMetadata, *query: torch.Tensor,
               num_splits: int | None = None) -> torch.Tensor:
        """The layer's attention output for the step's query tokens."""

    def graph_num_splits(self, layers: Sequence, batch: int, context: int, query_len: int = 1) -> int | None:
        """The split count a CUDA graph of ``batch`` sequences of ``query_len`` query tokens (1: decode; more:
        speculative verification) over contexts up to ``context`` (its context bucket,
        kvforge/engine/cuda_graphs.py) pins for ``layers`` (the plan's layers on this backend), or None."""
        return None

    def description(self) -> str:
        """One line for the engine summary."""
        return self.name


#: Backend classes by declaration name, filled by :func:`register_backend` as implementation modules load.
SUPPORTED_ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make ``cls`` the object for ``cls.declaration.name``."""
    name = cls.declaration.name
    if name in SUPPORTED_ATTENTION_BACKENDS and SUPPORTED_ATTENTION_BACKENDS[name] is not cls:
        raise ValueError(f"attention backend {name!r} registered twice")
    SUPPORTED_ATTENTION_BACKENDS[name] = cls
    return cls


def backend_class(declaration: BackendDeclaration) -> type[AttentionBackend]:
    """The registered class of ``declaration``, importing its implementation module first."""
    if declaration.name not in SUPPORTED_ATTENTION_BACKENDS:
        importlib.import_module(declaration.implementation)
    try:
        return SUPPORTED_ATTENTION_BACKENDS[declaration.name]
    except KeyError:
        raise ValueError(f"{declaration.implementation} registers no attention backend named "
                         f"{declaration.name!r}") from None
