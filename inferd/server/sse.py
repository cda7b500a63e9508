"""Server-Sent Events framing, and a streaming response that always releases its engine requests."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(body: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {body.model_dump_json(exclude=exclude)}\n\n"


class SSEResponse(StreamingResponse):
    """`on_close` runs however the response ends: finished, client gone, or cancelled before it began
    (in which case the body generator never ran and its own clean-up would not)."""

    def __init__(self, content, on_close: Callable[[], None], headers: dict[str, str] | None = None):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
