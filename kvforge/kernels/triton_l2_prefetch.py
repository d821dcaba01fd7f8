"""Triton kernel: start pulling a tensor's bytes from HBM into L2, without waiting for them.

A one-row decode step leaves the memory system idle while small, latency-bound kernels run (rope, the KV
write, attention over a short context, its split merge), then streams the next weight at full bandwidth.
Prefetching that weight into L2 when the idle window starts moves its first bytes into the window: the
product that follows finds them in L2.

Each thread issues one ``cp.async.bulk.prefetch.L2.global`` (sm_90 and later) for a ``CHUNK_BYTES`` slice:
a hint with no destination register, so the kernel ends as soon as the requests are issued and the
transfers finish on their own; the stream's next kernel is not held back. Nothing is written anywhere, so
the prefetch never changes a result, and a wrong or late prefetch only costs bandwidth.

:func:`l2_prefetch` is the entry: no host synchronization, no allocation; safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: Bytes one thread's bulk prefetch covers (a multiple of 16, the instruction's granule).
CHUNK_BYTES = 16384
#: Threads (chunks) per program.
BLOCK = 128
#: The instruction's size granule: the prefetched length is rounded down to it.
GRANULE = 16
#: The first compute capability with ``cp.async.bulk.prefetch``.
MIN_CAPABILITY_MAJOR = 9


if HAS_TRITON:

    @triton.jit
    def issue_l2_prefetch(base_ptr, offs, nbytes, CHUNK: tl.constexpr):
        """Prefetch bytes ``[offs, offs + CHUNK)`` of the ``nbytes`` at ``base_ptr`` (a uint8 pointer; ``offs``
        int64 multiples of 16, one per thread), clipped to ``nbytes`` (a multiple of 16); nothing past it."""
        size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
        issue_l2_prefetch(base_ptr, offs, nbytes, CHUNK)


def l2_prefetch(t: torch.Tensor) -> None:
    """Start moving ``t``'s storage (its contiguous span, rounded down to 16 bytes) into L2. A CUDA tensor on
    a GPU of compute capability 9 or later; the caller checks (:func:`prefetch_supported`)."""
    if not HAS_TRITON:
        raise RuntimeError("l2_prefetch needs triton")
    if not t.is_contiguous():
        raise ValueError("l2_prefetch takes a contiguous tensor")
    nbytes = (t.numel() * t.element_size()) // GRANULE * GRANULE
    if nbytes == 0:
        return
    raw = t.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(triton.cdiv(nbytes, CHUNK_BYTES * BLOCK),)](raw, nbytes, CHUNK=CHUNK_BYTES, BLOCK=BLOCK,
                                                                     num_warps=BLOCK // 32)


def prefetch_supported(device: torch.device) -> bool:
    """Whether :func:`l2_prefetch` runs on ``device``: CUDA, compute capability 9 or later, Triton present."""
    return (HAS_TRITON and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY_MAJOR)  # fmt: skip
