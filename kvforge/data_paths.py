"""Where the evaluation data lives (GSM8K, tinyshakespeare); never copied into the repository.

Order: ``$KVFORGE_DATA_DIR`` when set (it must exist); otherwise ``../shared/data`` beside the
checkout, i.e. a ``shared/data`` folder next to the directory that holds the ``kvforge`` package's
source tree. When neither exists, :func:`shared_data_dir` raises ``FileNotFoundError`` naming both.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "KVFORGE_DATA_DIR"
DATA_DIR_HELP = f"${ENV_VAR}, else ../shared/data beside the kvforge checkout"


def beside_checkout() -> Path:
    """``<checkout>/../shared/data``, where ``<checkout>`` holds the ``kvforge`` package."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data_dir() -> Path:
    """The data folder (see the module docstring); ``FileNotFoundError`` when there is none."""
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{ENV_VAR}={env} is not a directory; point it at the folder holding "
                                    "gsm8k/ and text/, or unset it")
        return path.resolve()
    path = beside_checkout()
    if path.is_dir():
        return path
    raise FileNotFoundError(f"no evaluation data: {ENV_VAR} is not set and {path} does not exist; set "
                            f"{ENV_VAR}=DIR (holding gsm8k/ and text/) or pass the file or folder explicitly")
