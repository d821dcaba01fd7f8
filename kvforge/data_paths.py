"""Where the project's shared data lives (GSM8K, tinyshakespeare); never copied into the repo.

Order: ``$KVFORGE_DATA_DIR``; ``../shared/data`` next to the checkout (the
development layout); ``/work/shared/data`` (the same folder seen from a clone
elsewhere, e.g. CI's temporary clone). The first that exists wins.
"""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path:
    env = os.environ.get("KVFORGE_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[1].parent / "shared" / "data", Path("/work/shared/data")]
    for path in candidates:
        if path.is_dir():
            return path.resolve()
    return candidates[0]
