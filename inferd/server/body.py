"""Reading a request body: a size cap before any work, and strict JSON (`inferd.strict_json`).

Non-finite numbers and lone surrogates get a 400 that names the field, before any handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd import strict_json
from inferd.errors import InvalidRequestError
from inferd.server.errors import APIError, error_response


def parse_json(body: bytes) -> Any:
    """The body as JSON; raises json.JSONDecodeError (FastAPI's 400) or APIError (400) for what it cannot take."""
    try:
        return strict_json.loads(body)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None


class CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class CheckedRoute(APIRoute):
    """An APIRoute whose handler reads its JSON body with parse_json."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 before the app sees it, from Content-Length at once,
    or as soon as a chunked body passes the limit. The body is read here and replayed to the app.

    After the 413 the rest of the body is read and dropped (a bounded amount, for a bounded time), as nginx
    does: a client still sending would otherwise get a connection reset instead of the answer."""

    DISCARD_BYTES = 256 << 20
    DISCARD_SECONDS = 10.0

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send, headers)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if not message.get("more_body", False):
                    receive = _nothing_left
                return await self._too_large(scope, receive, send, headers)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, headers: dict) -> None:
        err = APIError(
            413,
            f"the request body is larger than this server takes ({self.max_bytes} bytes; --max-request-body)",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await error_response(err)(scope, receive, send)
        if headers.get(b"expect", b"").lower() != b"100-continue":  # such a client sends no body after a 413
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_discard(receive, self.DISCARD_BYTES), self.DISCARD_SECONDS)


async def _discard(receive: Receive, limit: int) -> None:
    dropped = 0
    while dropped < limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


async def _nothing_left() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay
