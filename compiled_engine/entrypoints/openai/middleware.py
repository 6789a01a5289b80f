"""ASGI middleware: the API key check and the request body size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which wraps responses in a way that
interferes with streaming bodies and with seeing a client's disconnect.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus

from compiled_engine.entrypoints.openai.errors import BodyTooLargeError, error_response

# An oversized body announced by Content-Length is read (and dropped) up to this many times the
# limit before the 413 goes out: a client still sending when the server answers and closes sees a
# broken connection instead of the 413. Beyond it the connection is simply closed after answering.
_DRAIN_FACTOR = 4


class ApiKeyMiddleware:
    """Requests to /v1/* need `Authorization: Bearer <key>`; /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            response = error_response(
                HTTPStatus.UNAUTHORIZED,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _drain(receive, self.max_bytes * _DRAIN_FACTOR)
            await BodyTooLargeError(self.max_bytes).response()(scope, receive, send)
            return

        # Bodies without a Content-Length (chunked) are counted as they are read.
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


async def _drain(receive, limit: int) -> None:
    read = 0
    while read <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def add_request_guards(app, max_request_bytes: int, api_key: str | None) -> None:
    """Both guards on `app` (a FastAPI app), in the order they must run: the last middleware
    added runs first, so the key is checked before any body is read."""
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
