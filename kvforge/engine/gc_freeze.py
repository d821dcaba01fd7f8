"""Keep the garbage collector's full collections out of the serving loop.

After startup a process holds hundreds of thousands of long-lived objects (modules, parameters' Python
wrappers, compiled kernels, imported libraries). A full (generation 2) collection walks every one of
them, about 0.2 s on one CPU core for the embedded model's process, and CPython starts one by itself
whenever enough new objects have survived: in the middle of whichever step is running, as one long
pause between two tokens of every stream.

:func:`freeze_after_startup` collects once and then moves every surviving object to the permanent
generation, which automatic collections skip. It first moves back what an earlier engine froze, so
the cycles of an engine dropped without :meth:`LLMEngine.shutdown` are still collected; a new engine
also calls :func:`collect_dropped_engines` before it counts device and host memory, so that what a
dropped engine held is free by then. :func:`thaw` makes every frozen object collectable again (a
shutdown collects the engine's cycles after it).
"""

from __future__ import annotations

import gc


def freeze_after_startup() -> None:
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def thaw() -> None:
    gc.unfreeze()


def collect_dropped_engines() -> None:
    """Free now what engines dropped without shutdown left frozen (their finalizers run: a tensor-parallel
    engine's workers end and its process group is left)."""
    gc.unfreeze()
    gc.collect()
