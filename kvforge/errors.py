"""User-facing errors.

Every error a user can cause (a bad flag, a bad request, a plan that cannot
work) is a ``KVForgeError`` whose message names the problem and the fix. The
CLI prints it without a traceback and exits non-zero; the server turns
``InvalidRequestError`` into an HTTP 400 with the offending field.
"""


class KVForgeError(Exception):
    """A problem the user can fix; the message says what and how."""


class ConfigError(KVForgeError):
    """Bad model config, flag or engine option (detected before weights load)."""


class PlanError(KVForgeError):
    """The KV-cache plan cannot work (names the constraint, numbers and fix)."""


class InvalidRequestError(KVForgeError):
    """A single request is invalid; other requests are unaffected.

    ``field`` names the request field at fault (for the HTTP 400 body).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, hung or failed; the engine cannot continue (not the user's to fix:
    the CLI prints it on one line and exits 1)."""
