"""The logger aiohttp's connection handler writes to: a request aiohttp cannot parse is the client's error.

aiohttp answers a request it cannot parse itself (a bad chunk size, both Content-Length and chunked, a
header line over 8,190 bytes, an unknown method, TLS on the plain port, a Content-Encoding it cannot
decode) with a plain-text 400 and closes the connection, before any handler runs; it logs each as an
ERROR with a traceback. Here each becomes one WARNING line naming the client and the problem, as other
servers log a malformed request. A body that fails to decode after a handler has answered (the handler
says 400 itself) is logged by aiohttp again as it drains the rest: that record becomes one DEBUG line. Every
other record (a handler's unexpected 500) passes unchanged.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

#: The logger the server's runner gives aiohttp (``AppRunner(logger=...)``).
HTTP_LOGGER_NAME = "kvforge.server.http"
#: Characters of aiohttp's description kept in the line (it quotes the offending bytes).
MAX_PROBLEM_CHARS = 200


class MalformedRequestFilter(logging.Filter):
    """Rewrites aiohttp's "Error handling request" records of a parse error into one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RequestPayloadError):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            record.msg, record.args = "the rest of a request body that failed to decode was dropped: %s", (
                " ".join(str(exc).split())[:MAX_PROBLEM_CHARS],)
            record.exc_info, record.exc_text = None, None
        elif isinstance(exc, HttpProcessingError):
            # aiohttp's description spans lines, with a caret under the offending byte: one line, no caret
            problem = " ".join(w for w in str(exc.message or type(exc).__name__).split() if w != "^")
            if len(problem) > MAX_PROBLEM_CHARS:
                problem = problem[:MAX_PROBLEM_CHARS] + "..."
            client = record.args[0] if isinstance(record.args, tuple) and record.args else "a client"
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.msg, record.args = "malformed HTTP request from %s, answered 400: %s", (client, problem)
            record.exc_info, record.exc_text = None, None
        return True


def http_logger() -> logging.Logger:
    """The logger for aiohttp's connection handler, with :class:`MalformedRequestFilter` on it (once)."""
    log = logging.getLogger(HTTP_LOGGER_NAME)
    if not any(isinstance(f, MalformedRequestFilter) for f in log.filters):
        log.addFilter(MalformedRequestFilter())
    return log
