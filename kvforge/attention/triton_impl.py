"""The Triton backend's implementation: cache write + paged attention (CUDA only)."""

from kvforge.kernels.triton_cache_write import write_kv_cache
from kvforge.kernels.triton_paged_attention import paged_attention

__all__ = ["write_kv_cache", "paged_attention"]
