"""Cross-origin resource sharing: which web pages may call the server from a browser (vLLM's
``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``).

The default policy is vLLM's: every origin, method and header, no credentials. A request that carries an
``Origin`` header the policy allows gets ``Access-Control-Allow-Origin`` on its response (``*``, or the origin
itself with ``Vary: Origin`` where the policy names origins or allows credentials), whatever its status, a
stream included (the headers are added as the response is prepared). A preflight (``OPTIONS`` with ``Origin``
and ``Access-Control-Request-Method``) is answered here, before authentication, as the browser sends it
without credentials: 200 with the allowed methods and headers, or 400 naming what the policy refuses.
Requests without ``Origin`` (every non-browser client) are untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvforge.errors import ConfigError

#: How long a browser may cache a preflight's answer (seconds; Starlette's default, which vLLM serves).
PREFLIGHT_MAX_AGE_S = 600
#: Request headers every policy allows (the CORS-safelisted ones, as Starlette's middleware adds them): a page
#: sending JSON names Content-Type in its preflight even where the policy lists only Authorization.
SAFELISTED_HEADERS: tuple[str, ...] = ("Accept", "Accept-Language", "Content-Language", "Content-Type")


@dataclass(frozen=True)
class CorsPolicy:
    """Allowed origins, methods and request headers (``"*"``: any), and whether credentials are allowed."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def allows_method(self, method: str) -> bool:
        return "*" in self.methods or method.upper() in (m.upper() for m in self.methods)

    def allowed_headers(self) -> tuple[str, ...]:
        """The listed headers and the safelisted ones (``*`` alone where any is allowed)."""
        if "*" in self.headers:
            return ("*",)
        listed = {h.lower() for h in self.headers}
        return tuple(sorted({*self.headers, *(h for h in SAFELISTED_HEADERS if h.lower() not in listed)}))

    def refused_headers(self, requested: list[str]) -> list[str]:
        if "*" in self.headers:
            return []
        allowed = {h.lower() for h in self.allowed_headers()}
        return [h for h in requested if h.lower() not in allowed]

    def origin_headers(self, origin: str) -> dict[str, str]:
        """The headers a response to ``origin`` (allowed) carries."""
        if "*" in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers


#: vLLM's default: every origin, method and header, no credentials.
ALLOW_ALL = CorsPolicy()


def parse_json_list(flag: str, text: str) -> tuple[str, ...]:
    """A flag's JSON list of strings (vLLM's format: ``'["https://a.example", "https://b.example"]'``)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        example = {"--allowed-origins": '["https://app.example"]', "--allowed-methods": '["GET", "POST"]',
                   "--allowed-headers": '["Authorization"]'}.get(flag, '["*"]')
        raise ConfigError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]' or '{example}'; got {text!r}")
    return tuple(value)


def add_origin_headers_on_prepare(app, policy: CorsPolicy) -> None:
    """Every response to an allowed origin gets the origin headers as it is prepared (a stream's too)."""

    async def add_origin_headers(request, response) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and policy.allows_origin(origin):
            for name, value in policy.origin_headers(origin).items():
                if name == "Vary" and value in response.headers.get("Vary", ""):
                    continue
                if name == "Vary" and "Vary" in response.headers:
                    value = f"{response.headers['Vary']}, {value}"
                response.headers[name] = value

    app.on_response_prepare.append(add_origin_headers)


def preflight_middleware(policy: CorsPolicy):
    """The middleware that answers CORS preflights; it must come before authentication (first in the list)."""
    from aiohttp import web  # the server's stack: `kvforge plan` reads this module's flags without it

    @web.middleware
    async def preflight(request, handler):
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return await handler(request)
        requested = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
                     if h.strip()]
        problems = []
        if not policy.allows_origin(origin):
            problems.append(f"origin {origin} (--allowed-origins)")
        if not policy.allows_method(method):
            problems.append(f"method {method} (--allowed-methods)")
        refused = policy.refused_headers(requested)
        if refused:
            problems.append(f"headers {', '.join(refused)} (--allowed-headers)")
        if problems:
            return web.Response(status=400, text=f"CORS preflight refused: {'; '.join(problems)}",
                                headers={"Vary": "Origin"})
        headers = {
            "Access-Control-Allow-Methods": method if "*" in policy.methods else ", ".join(policy.methods),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin",
        }
        if requested:
            headers["Access-Control-Allow-Headers"] = (", ".join(requested) if "*" in policy.headers
                                                       else ", ".join(policy.allowed_headers()))
        return web.Response(status=200, text="OK", headers=headers)  # the origin headers: add_origin_headers

    return preflight
