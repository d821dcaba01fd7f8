"""CUDA graphs of the replay of accepted verify rows onto the linear-attention state slots.

After a verification step, :meth:`LinearStates.keep_verified` advances each verifying sequence's slot over
its first ``n`` verify rows (1 + the accepted proposals): a gather of the verify table, then per state layer
a conv-state launch and a delta-rule launch, whose host work grows with the layers (Qwen3-Next-80B: 36 state
layers, 72 launches). When every verifying sequence keeps the same ``n`` rows, the step replays the graph
captured for ``(B, n)``, ``B`` the smallest capture size holding the sequences; a step with mixed counts, or
more sequences than the largest size (at most :data:`MAX_BATCH`), runs eagerly.

Invariants (what makes a replay equal to the eager replay):

1. **Static inputs.** ``src [Bmax * R]`` int64 (``R`` = 1 + k: verify-table rows, sequence ``i``'s row ``j``
   at ``i * n + j``), ``slots [Bmax]`` int32 and, per ``n``, the constant ``n * arange(Bmax + 1)``; the graph
   of ``(B, n)`` reads their leading ``B * n``, ``B`` and ``B + 1`` entries. :meth:`ReplayGraphs.run` writes
   them on the current stream (pinned memory, ``non_blocking``) before the replay.
2. **Padding sequences** ``m .. B-1``: slot -1, which the kernels skip (no state read or written), and
   ``src`` 0, a row of the table (read, never stored).
3. **Capture** at startup, after the pool exists, with every slot -1: the warm-up call and the capture touch
   no state. The route's form is the one for ``B`` sequences of ``n`` rows, as the eager replay of that
   batch asks; each layer's q/k normalisation is the one recorded when captured (the models always
   normalise); a step whose layers recorded another runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvforge.host_copies import values_to_device

logger = logging.getLogger("kvforge.engine")

#: The largest batch a replay graph serves. The host work a graph saves is per launch, the same at any batch,
#: while the gathered rows its capture keeps in the graph pool grow with it: a row of every state layer's inputs
#: is 2.07 MB on one rank of Qwen3-Next-80B (36 layers x 14,400 float32), so 8 sequences x 4 rows take 66 MB
#: and 256 x 4 would take 2.1 GB.
MAX_BATCH = 8


class ReplayGraphs:
    """Captures and replays :meth:`LinearStates.replay_on_kernels` (see the module docstring). ``capture``
    False (CPU tests, kernels in Triton's interpreter): the same static, padded inputs, run eagerly."""

    def __init__(self, states, sizes: list[int], device: torch.device, capture: bool = True):
        """``sizes``: the decode graphs' batch sizes; those up to :data:`MAX_BATCH` are captured."""
        self.states = states
        self.device = device
        self.rows = states.verify_rows
        self.sizes = sorted({b for b in sizes if b <= MAX_BATCH})
        if not self.sizes:
            raise ValueError(f"no capture size up to {MAX_BATCH} sequences among {sorted(sizes)}")
        self.max_size = self.sizes[-1]
        bmax = self.max_size
        self.src = torch.zeros(bmax * self.rows, dtype=torch.int64, device=device)
        self.slots = torch.full((bmax,), -1, dtype=torch.int32, device=device)
        self.qsl = {n: n * torch.arange(bmax + 1, dtype=torch.int32, device=device) for n in range(1, self.rows + 1)}
        self.normalize = states.replay_normalization()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    def _replay(self, b: int, n: int) -> None:
        self.states.replay_on_kernels(self.src[:b * n], self.slots[:b], self.qsl[n][:b + 1], [n] * b)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.slots.fill_(-1)
        for b in reversed(self.sizes):
            for n in range(self.rows, 0, -1):
                self._replay(b, n)  # warm-up: compiles; every slot -1, so no state is touched
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._replay(b, n)
                self.graphs[(b, n)] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs of the verified-state replay (batch sizes %s x kept rows 1-%d) in %.1f s",
                    len(self.graphs), self.sizes, self.rows, self.capture_seconds)

    def accepts(self, num_rows: list[int]) -> bool:
        """Whether a replay of these sequences' kept rows fits a graph: one count for all, at most ``Bmax``
        sequences, and the q/k normalisation of the capture."""
        return (0 < len(num_rows) <= self.max_size and len(set(num_rows)) == 1
                and self.states.replay_normalization() == self.normalize)

    def run(self, slot_ids: list[int], num_rows: list[int]) -> None:
        """The replay of ``keep_verified(slot_ids, num_rows)`` (arguments as it checks them) from the graph."""
        if len(slot_ids) != len(num_rows):
            raise ValueError("a replay needs one row count per slot")
        self.states.check_kept(slot_ids, num_rows)
        m, n = len(slot_ids), num_rows[0]
        b = next(size for size in self.sizes if size >= m)
        host = np.zeros(b * n + b, dtype=np.int64)
        slots = np.asarray(slot_ids, dtype=np.int64)
        host[:m * n] = (slots[:, None] * self.rows + np.arange(n)).reshape(-1)
        host[b * n:b * n + b] = -1
        host[b * n:b * n + m] = slots
        staged = values_to_device(host, self.device)
        self.src[:b * n].copy_(staged[:b * n])
        self.slots[:b].copy_(staged[b * n:])
        graph = self.graphs.get((b, n))
        if graph is None:  # capture=False: the static inputs, eagerly
            self._replay(b, n)
        else:
            graph.replay()

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.states = self.src = self.slots = self.qsl = None
