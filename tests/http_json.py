"""A JSON request to a test server with urllib: ``(status, parsed body)``, HTTP errors returned, not raised."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http(method: str, url: str, body=None, headers=None, timeout: float = 60):
    """``body``: None (no body), bytes (sent as they are) or a JSON value."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
