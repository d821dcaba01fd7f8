"""Where the server and the HTTP clients (``kvforge bench serve``, ``kvforge eval gsm8k``) take their
API key from: the one rule for both.

* ``kvforge serve`` requires the key given by ``--api-key``, else ``$KVFORGE_API_KEY`` (as vLLM's server
  reads ``$VLLM_API_KEY``); neither set: no authentication.
* A client sends ``--api-key``, else ``$KVFORGE_API_KEY`` (so one variable serves the server and the
  tools started next to it), else ``$OPENAI_API_KEY`` (what the ``openai`` client and lm-eval read);
  none set: no ``Authorization`` header.

An empty value counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SERVER_API_KEY_ENV = "KVFORGE_API_KEY"
CLIENT_API_KEY_ENVS = (SERVER_API_KEY_ENV, "OPENAI_API_KEY")
CLIENT_API_KEY_HELP = (f"sent as 'Authorization: Bearer KEY' (default: ${CLIENT_API_KEY_ENVS[0]}, "
                       f"else ${CLIENT_API_KEY_ENVS[1]}; neither set: no key)")
UNAUTHORIZED_HINT = ("the server wants an API key: pass --api-key KEY or set "
                     f"{CLIENT_API_KEY_ENVS[0]} (or {CLIENT_API_KEY_ENVS[1]})")
REFUSED_KEY_HINT = ("the server refused the API key sent (--api-key, else ${}, else ${}): give the key the "
                    "server was started with").format(*CLIENT_API_KEY_ENVS)


def unauthorized_hint(key_sent: bool) -> str:
    """The fix for an HTTP 401: send a key, or (``key_sent``) send the right one."""
    return REFUSED_KEY_HINT if key_sent else UNAUTHORIZED_HINT


def server_api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key ``kvforge serve`` requires: ``flag`` (``--api-key``), else ``$KVFORGE_API_KEY``, else None."""
    return flag or environ.get(SERVER_API_KEY_ENV) or None


def client_api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client sends: ``flag`` (``--api-key``), else ``$KVFORGE_API_KEY``, else
    ``$OPENAI_API_KEY``, else None."""
    if flag:
        return flag
    for name in CLIENT_API_KEY_ENVS:
        if environ.get(name):
            return environ[name]
    return None
