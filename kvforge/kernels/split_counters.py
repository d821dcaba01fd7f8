"""Arrival counters for split-K decode kernels that merge their own partials (no merge launch).

One int32 counter per (sequence, KV head) of a launch. A split program that holds tokens writes its partial
(acc, max, sum), then takes a ticket: an atomic add with acquire-release order at GPU scope, after a barrier
so every thread's stores precede it. The program that takes the last ticket has seen every other split's
partial; it merges them into the output and sets the counter back to 0. So between launches every counter
is 0 and no launch clears them.

One buffer per device, allocated and grown only in eager calls; a buffer a CUDA graph captured stays alive
(graphs keep the address they recorded), so buffers are never freed. Launches on one device share the buffer
in stream order: kernels that could run at once on two streams of one device must not both merge this way.
The engine's graph capture runs each shape eagerly first, so a captured launch finds its buffer; a launch
that cannot have one (captured before any eager call of its size) gets None and merges in a separate launch.
"""

from __future__ import annotations

import torch

#: Splits whose partials the merging program loads at once (their L2 round trips overlap; one at a time,
#: the merge is a chain of them).
MERGE_CHUNK = 8
#: Counters of the first buffer on a device: 8,192 sequences x 8 KV heads (256 KiB).
FIRST_BUFFER_COUNTERS = 1 << 16

_buffers: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``count`` counters on ``device`` (the newest buffer when it is large
    enough), or None while a CUDA graph is being captured and no buffer that large exists yet."""
    device = torch.device(device)
    held = _buffers.setdefault(device, [])
    if held and held[-1].numel() >= count:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(FIRST_BUFFER_COUNTERS, 1 << max(0, count - 1).bit_length())
    held.append(torch.zeros(size, dtype=torch.int32, device=device))
    return held[-1]
