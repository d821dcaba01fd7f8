"""Shared fixtures: the embedded SmolLM2 engine is loaded once per test run and config."""

from __future__ import annotations

import collections
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA the Triton kernels run in Triton's CPU interpreter (tests/triton_kernel_device.py). Triton
# reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test imports a kernel
# module; a value already in the environment wins. With CUDA nothing changes: the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread: CI has 2 cores, and with 2 threads small CPU ops slow
# down by up to 10x whenever anything else runs (measured on the dev machine).
torch.set_num_threads(1)

#: Engines :func:`smol_llm` keeps, the most recently asked for last.
_ENGINES: collections.OrderedDict = collections.OrderedDict()
#: How many it keeps: a test uses at most two configurations, and each kept engine holds its weights and
#: KV cache for the rest of the worker's run (about 1.5 GiB), so older ones are shut down.
_MAX_ENGINES = 3


@pytest.fixture(scope="session")
def smol_llm():
    """Factory: ``smol_llm(**engine_kwargs)`` -> a kvforge.LLM on the embedded model, cached by its arguments.
    Only the :data:`_MAX_ENGINES` most recently asked-for engines stay alive: hold an engine within one test,
    never across tests."""
    from kvforge import LLM

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(progress=False, **kwargs)
        _ENGINES.move_to_end(key)
        while len(_ENGINES) > _MAX_ENGINES:
            _ENGINES.popitem(last=False)[1].shutdown()
        return _ENGINES[key]

    return make


@pytest.fixture
def engines(request):
    """Factory ``engines(path, **kw)`` -> kvforge.LLM with the test module's ``ENGINE`` defaults;
    every engine is shut down afterwards (tensor-parallel workers included)."""
    from kvforge import LLM

    made = []

    def make(path, **kw):
        llm = LLM(str(path), **{**request.module.ENGINE, **kw})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.shutdown()
