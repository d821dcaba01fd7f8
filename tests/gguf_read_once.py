"""transformers' GGUF loading with the file's metadata parsed once instead of once per component.

``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` open the file with
``gguf.GGUFReader`` once for each config they build and again for the weights, and each open parses
every metadata array element by element: for a 262,144-token vocabulary that is ~20 s of one CPU core
per open. The reader maps the file read-only and transformers only reads from it (tensors are
dequantized into new arrays), so inside :func:`one_gguf_reader_per_file` every open of one path gets
the same reader. What transformers computes from it is unchanged.

``opened``: a dict kept by the caller, to share readers between several such blocks (e.g. two
fixtures); the readers live as long as it does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_gguf_reader_per_file(opened: dict | None = None) -> Iterator[None]:
    import gguf

    original = gguf.GGUFReader
    opened = {} if opened is None else opened

    def reader(path, mode: str = "r"):
        if mode != "r":
            return original(path, mode)
        key = (str(path), mode)
        if key not in opened:
            opened[key] = original(path, mode)
        return opened[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
