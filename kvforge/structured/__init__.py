"""Structured outputs: token masks that keep a request's output inside a JSON schema, a regular expression,
a list of choices or a grammar (vLLM's ``StructuredOutputsParams``), compiled and matched by xgrammar."""

from kvforge.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
