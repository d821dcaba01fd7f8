"""Server-sent event responses: the headers and what happens when the client goes away."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def event_stream(request: web.Request, write_events: Callable[[web.StreamResponse], Awaitable[None]]
                       ) -> web.StreamResponse:
    """A prepared event-stream response that ``write_events`` fills and ends. A client gone at any point
    (before the headers went out, mid-stream, or before the last event) ends it quietly: nothing more can be
    written, the requests are aborted as their streams close, and aiohttp ends a response whose client left
    without logging an error."""
    resp = web.StreamResponse(headers=HEADERS)
    try:
        await resp.prepare(request)
        await write_events(resp)
    except ConnectionResetError:
        pass
    return resp
