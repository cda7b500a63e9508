"""Bearer-token auth as plain ASGI middleware, so it answers 401 before the body is even read.

The scheme is case-insensitive (RFC 9110 section 11.1): `Bearer KEY`, `bearer KEY` and `BEARER KEY` all work.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.errors import APIError, error_response

# endpoints that stay open: probes and scrapers carry no key
OPEN_PATHS = {"/health", "/metrics", "/ping", "/version", "/dashboard"}
# the dashboard's page and script hold no data; its event stream (/dashboard/events) needs the key
OPEN_PREFIXES = ("/dashboard/static/",)


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"] in OPEN_PATHS
            or scope["path"].startswith(OPEN_PREFIXES)
        ):
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            err = APIError(
                401,
                "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)
