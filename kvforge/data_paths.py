"""Where the evaluation data lives (GSM8K, tinyshakespeare); never copied into the repository.

Order: ``$KVFORGE_DATA_DIR`` when set (it must exist); otherwise ``../shared/data`` beside the
checkout, i.e. a ``shared/data`` folder next to the directory that holds the ``kvforge`` package's
source tree. When neither exists, :func:`shared_data_dir` raises ``FileNotFoundError`` naming both.

The data folder holds one folder per dataset (``gsm8k/``, ``text/``). A folder given on the command line
(``kvforge eval gsm8k --data-dir DIR``) means the same as ``$KVFORGE_DATA_DIR``, a folder holding
``gsm8k/``; the dataset's own folder is accepted too (:func:`dataset_dir`, the one rule for both).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "KVFORGE_DATA_DIR"
DATA_DIR_HELP = f"${ENV_VAR}, else ../shared/data beside the kvforge checkout"


def beside_checkout() -> Path:
    """``<checkout>/../shared/data``, where ``<checkout>`` holds the ``kvforge`` package."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data_dir(instead: str = "the file or folder explicitly") -> Path:
    """The data folder (see the module docstring); ``FileNotFoundError`` when there is none, whose fix names
    ``instead`` (the flag that gives the data) beside the variable."""
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
                            f"{ENV_VAR}=DIR (holding gsm8k/ and text/) or pass {instead}")


def dataset_dir(name: str, marker: str, given: str | Path | None = None, flag: str = "--data-dir") -> Path:
    """The folder of dataset ``name``, recognised by its file ``marker`` (e.g. "test.jsonl").

    ``given`` (the ``flag`` value) is read like ``$KVFORGE_DATA_DIR``: ``given/name`` when it holds
    ``marker``, else ``given`` itself when it does (the dataset's own folder). Without ``given``:
    ``name/`` in :func:`shared_data_dir`. ``FileNotFoundError`` names every folder tried and the fix.
    """
    if given is None:
        tried = [shared_data_dir(f"{flag} DIR") / name]
        fix = f"set {ENV_VAR}=DIR where DIR holds {name}/{marker}, or pass {flag}"
    else:
        root = Path(given).expanduser()
        tried = [root / name, root]
        fix = (f"pass {flag} DIR where DIR holds {name}/{marker} (the folder {ENV_VAR} names) or is the {name}/ "
               "folder itself")
    for folder in tried:
        if (folder / marker).is_file():
            return folder
    raise FileNotFoundError(f"{name} data not found: no {marker} in {' or '.join(str(t) for t in tried)}; "
                            f"fix: {fix}")
