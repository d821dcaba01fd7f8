"""kvforge: an LLM inference engine whose KV cache is planned, not discovered.

``kvforge.plan(...)`` resolves a KV-cache plan without torch; ``LLM`` and
``SamplingParams`` are imported lazily so that planning stays light.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "plan"]


def __getattr__(name):
    if name == "plan":
        from kvforge.planner.api import plan

        return plan
    if name == "SamplingParams":
        from kvforge.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "LLM":
        from kvforge.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
