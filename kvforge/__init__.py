"""kvforge: an LLM inference engine whose KV cache is planned, not discovered."""

__version__ = "0.1.0"
