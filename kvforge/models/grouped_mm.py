"""Whether ``torch._grouped_mm`` works for a (device, dtype): the capture-safe MoE path needs it.

``torch._grouped_mm(a [rows, in], b [E, in, out], offs=int32 [E])`` multiplies
each expert's contiguous row range of ``a`` by its weight with no host-side
shapes, so a MoE step built on it can be captured in a CUDA graph. Its support
depends on the torch build, the GPU and the dtype, so it is probed once per
(device, dtype) with a tiny product checked against float32 matmuls and, on
CUDA, run once more under ``torch.cuda.set_sync_debug_mode("error")``: some
builds run float32 through a fallback that copies ``offs`` to the host, which
gives right answers eagerly but cannot be captured (seen with torch 2.11 on an
H200, DeepSeek float32 at TP=2). The sync check raises before any copy is
issued; a trial capture instead could leave the stream and the caching
allocator in a capture state when it fails.
"""

from __future__ import annotations

import torch

# Probe results per (device, dtype): a property of this process's torch build and GPU, computed once
# (outside any CUDA-graph capture: the check reads a value on the host).
_PROBED: dict[tuple[str, torch.dtype], str | None] = {}


def grouped_mm_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when ``torch._grouped_mm`` gives right answers on ``device`` in ``dtype`` (and, on CUDA, does not
    synchronize with the host, so it can be captured in a CUDA graph), else why not. Inside a capture an
    unprobed key is answered "unknown" and not remembered (probing there would break the capture)."""
    key = (str(torch.device(device)), dtype)
    if key not in _PROBED and key[0].startswith("cuda") and torch.cuda.is_current_stream_capturing():
        return "torch._grouped_mm was not probed before this CUDA-graph capture"
    if key not in _PROBED:
        _PROBED[key] = _probe(torch.device(device), dtype)
    return _PROBED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(24, 16, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(2, 32, 16, generator=g).to(device=device, dtype=dtype)  # [E, out, in], like the experts
        offs = torch.tensor([8, 24], dtype=torch.int32, device=device)
        got = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).float()
        want = torch.cat([a[:8].float() @ w[0].float().T, a[8:].float() @ w[1].float().T])
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return f"torch._grouped_mm gives wrong results on {device} in {dtype}"
    except Exception as e:  # unsupported dtype / GPU / layout
        return f"torch._grouped_mm fails on {device} in {dtype}: {type(e).__name__}: {str(e)[:120]}"
    if device.type == "cuda":
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        except RuntimeError as e:  # e.g. the fallback's host copy of offs
            return (f"torch._grouped_mm in {dtype} synchronizes with the host on {device} (not capturable in a "
                    f"CUDA graph): {str(e)[:120]}")
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return None
