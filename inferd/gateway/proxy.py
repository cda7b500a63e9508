"""Sending one request to one replica, and relaying its answer: whole JSON bodies, or SSE event by event.

An attempt ends in one of three ways: `Retry` (the replica could not be reached, dropped the
connection, or answered 503, all before the client saw a byte: another replica may serve it), an
answer from the replica (any status, relayed as it is), or a gateway error (the request timed out).
For a stream the gateway waits for the replica's first chunk before it answers the client, so a
replica that dies before streaming is still a retry; once a byte went out, a failure ends the stream
with one SSE error event and no `[DONE]`.

Events are relayed with their bytes untouched, as soon as they are complete. The only change: when
the gateway forced `stream_options.include_usage` on (to settle budgets on the real usage) and the
client did not ask for it, the usage-only chunk is read and dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from inferd.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

# headers of the replica's answer that the client gets
PASSED_HEADERS = ("content-type", "x-request-id", "retry-after")


@dataclass
class Usage:
    prompt: int
    completion: int
    cached: int = 0


def parse_usage(obj: object) -> Usage | None:
    u = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    try:
        return Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0), int(cached or 0))
    except (TypeError, ValueError):
        return None


class Retry(Exception):
    """This replica cannot serve the request; nothing reached the client; another replica may."""

    def __init__(self, kind: str, replica_failed: bool):
        super().__init__(kind)
        self.kind = kind
        self.replica_failed = replica_failed  # counts toward ejection (a 503 does not)


@dataclass
class Upstream:
    """An open response from a replica, headers read, body (or the first stream chunk) not yet sent on."""

    response: httpx.Response
    first_chunk: bytes | None
    headers_at: float
    rest: AsyncIterator[bytes] | None = None  # the stream after the first chunk


async def open_upstream(
    client: httpx.AsyncClient, url: str, payload: bytes, headers: dict[str, str], stream: bool, deadline: float
) -> Upstream:
    """Send the request; raise Retry, or GatewayError 504 at the deadline."""
    req = client.build_request("POST", url, content=payload, headers=headers)
    resp = None
    try:
        async with asyncio.timeout_at(deadline):
            resp = await client.send(req, stream=True)
            headers_at = time.monotonic()
            if resp.status_code == 503:
                await resp.aclose()
                raise Retry("overloaded", replica_failed=False)
            if stream and resp.status_code == 200:
                rest = resp.aiter_raw().__aiter__()
                return Upstream(resp, await _first_chunk(rest), headers_at, rest)
            await resp.aread()
            return Upstream(resp, None, headers_at)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
        raise Retry(f"connect: {type(e).__name__}", replica_failed=True) from None
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
        await _close(resp)
        raise Retry(f"dropped: {type(e).__name__}", replica_failed=True) from None
    except (TimeoutError, httpx.TimeoutException):
        await _close(resp)
        raise GatewayError(504, "the request timed out at the gateway", "server_error", code="timeout") from None


async def _first_chunk(it: AsyncIterator[bytes]) -> bytes:
    async for chunk in it:
        if chunk:
            return chunk
    return b""


async def _close(resp: httpx.Response | None) -> None:
    if resp is not None:
        await resp.aclose()


def passed_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: resp.headers[k] for k in PASSED_HEADERS if k in resp.headers}


class SSEFilter:
    """Splits a byte stream into SSE events, reads the usage chunk, drops it when the client did not ask."""

    def __init__(self, drop_usage_chunk: bool):
        self.drop_usage_chunk = drop_usage_chunk
        self.usage: Usage | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in `chunk` (with what was held back before), bytes unchanged."""
        self._buf += chunk
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            return b""
        ready, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
        if b'"usage"' not in ready:
            return ready
        events = ready[:-2].split(b"\n\n")
        kept = [ev for ev in events if not self._is_dropped(ev)]
        if len(kept) == len(events):
            return ready
        return b"".join(ev + b"\n\n" for ev in kept)

    def tail(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _is_dropped(self, event: bytes) -> bool:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return False
        if b'"usage":null' in event or b'"usage": null' in event:
            return False  # every chunk carries the field once include_usage is on; only one has a value
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return False
        usage = parse_usage(obj)
        if usage is None:
            return False
        self.usage = usage
        return self.drop_usage_chunk and not obj.get("choices")


class ClosingStream(StreamingResponse):
    """A streaming response whose `on_close` runs however it ends, even if its body never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], headers: dict):
        super().__init__(content, headers=headers, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def relay_events(
    up: Upstream, sse: SSEFilter, deadline: float, on_first: Callable[[], None], on_broken: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """The replica's stream, event by event; a failure after the first byte becomes one SSE error event."""
    sent_any = False
    try:
        async for chunk in _chunks(up, deadline):
            out = sse.feed(chunk)
            if out:
                if not sent_any:
                    sent_any = True
                    on_first()
                yield out
        tail = sse.tail()
        if tail:
            yield tail
    except (httpx.TransportError, TimeoutError) as e:
        timed_out = isinstance(e, TimeoutError | httpx.TimeoutException)
        kind = "timeout" if timed_out else "stream_broken"
        on_broken(kind)
        msg = "the request timed out at the gateway" if timed_out else "the replica failed while streaming"
        yield GatewayError(502, msg, "server_error", code=kind).sse_event()
    finally:
        await up.response.aclose()


async def _chunks(up: Upstream, deadline: float) -> AsyncIterator[bytes]:
    """The stream's chunks, the first one already read; each wait is bounded by the deadline (never a yield)."""
    if up.first_chunk:
        yield up.first_chunk
    it = up.rest
    while it is not None:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        yield chunk
