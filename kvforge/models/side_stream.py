"""Work of a layer that can run beside the main stream's next kernels, on a second CUDA stream.

A MoE layer's shared experts read only the layer's input, while its routed experts first wait for the
router, the grouping of the rows and their own kernels: a chain of small, latency-bound launches during
which the GPU's memory system is mostly idle. :func:`beside` queues a function on the device's side stream
after everything queued so far on the current stream and returns a :class:`Joined` whose ``result()`` makes
the current stream wait for the side stream and hands back the function's output. Inside a CUDA-graph
capture the side stream forks from the capturing stream and joins it again, so a replayed step overlaps
the two branches as well. The same holds for an MLA layer's query products beside its latent's (projection
and norm).

The rule (:func:`use_side_stream`): the switch :data:`SIDE_STREAM` is on (assign the module attribute
before a forward, and before CUDA-graph capture, which records whichever path ran), the input is on a CUDA
device and autograd is off. Elsewhere the function runs at once, in order, on the current stream: the same
values either way (the same kernels on the same inputs; only their timing differs).

Safety of the memory the branches share: the side stream starts after the work already queued (so it
reads its input complete), and its output is read only after ``result()`` (the join). A tensor the side
stream allocates returns, when freed, to that stream's pool; the side stream's next use of the block comes
after its next fork, which waits for everything queued on the current stream, readers included. The
function must not launch collectives: their order across tensor-parallel ranks would depend on timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Whether independent branches run on a second stream where the rule allows (see the module docstring).
SIDE_STREAM = True

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, made on first use


def use_side_stream(x: torch.Tensor) -> bool:
    """Whether :func:`beside` runs its function on the side stream for an input like ``x``."""
    return SIDE_STREAM and x.is_cuda and not torch.is_grad_enabled()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


class Joined:
    """The output of a function queued by :func:`beside`; ``result()`` joins the streams first."""

    def __init__(self, out, main: torch.cuda.Stream | None = None, side: torch.cuda.Stream | None = None):
        self._out, self._main, self._side = out, main, side

    def result(self):
        if self._side is not None:
            self._main.wait_stream(self._side)
            self._side = None
        return self._out


def beside(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Joined:
    """``fn(x)`` on the side stream of ``x``'s device where :func:`use_side_stream` holds, else at once."""
    if not use_side_stream(x):
        return Joined(fn(x))
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(x)
    return Joined(out, main, side)
