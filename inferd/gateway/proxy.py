"""Sending one request to one replica, and relaying its answer: whole JSON bodies, or SSE event by event.

An attempt ends in one of three ways: `Retry` (the replica could not be reached, dropped the
connection, or answered 503, all before the client saw a byte: another replica may serve it), an
answer from the replica (any status, relayed as it is), or a gateway error (the request timed out).
For a stream the gateway waits for the replica's first chunk before it answers the client, so a
replica that dies before streaming is still a retry; once a byte went out, a failure ends the stream
with one SSE error event and no `[DONE]`, unless the route resumes streams (inferd/gateway/resume.py):
then the relay asks for a continuation from another replica and goes on with its events.

Events are relayed with their bytes untouched, as soon as they are complete. The only change: when
the gateway forced `stream_options.include_usage` on (to settle budgets on the real usage) and the
client did not ask for it, the usage-only chunk is read and dropped, and the `"usage": null` field
that the upstream then adds to every other chunk is cut out of its bytes, so the client gets what
the upstream sends without include_usage.

The upstream client is aiohttp, not httpx: on this path (one request in, one out, per client request)
httpx with its pure-Python HTTP/1.1 parser cost about 1 ms of CPU per request, aiohttp about 0.2 ms,
which decides whether the gateway adds under 2 ms. `Upstream` hides the client from the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from inferd.gateway.errors import GatewayError, timed_out

logger = logging.getLogger(__name__)

# headers of the replica's answer that the client gets (never a hop-by-hop one, nor the length or
# encoding of a body that may be relayed in other chunks, nor a second Date or Server)
PASSED_HEADERS = ("content-type", "x-request-id", "retry-after")


def passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of an upstream's answer that the client gets (`headers`: aiohttp's or httpx's)."""
    return {k: headers[k] for k in PASSED_HEADERS if k in headers}


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
    """An open response from a replica: headers read, and the whole body or the stream's first chunk."""

    response: aiohttp.ClientResponse
    body: bytes | None  # the whole body (not a 200 stream)
    first_chunk: bytes | None
    headers_at: float
    rest: AsyncIterator[bytes] | None = None  # the stream after the first chunk

    @property
    def status(self) -> int:
        return self.response.status

    def headers(self) -> dict[str, str]:
        """The replica's headers that the client gets."""
        return passed_headers(self.response.headers)

    def close(self) -> None:
        """Give the connection back (to the pool if its body was read to the end, else closed)."""
        self.response.release()


def new_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """The request path's client: unlimited connections, kept alive for less than uvicorn's 5 s (an idle
    connection the replica just closed would otherwise fail a request), bodies never decompressed twice."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",))


KEEPALIVE_S = 4.0
# asked upstream: the bytes relayed are the bytes the replica wrote
_SENT_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


async def open_upstream(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    auth: str | None,
    stream: bool,
    deadline: float,
    trace: dict[str, str] | None = None,
) -> Upstream:
    """Send the request (`auth`: the replica's Authorization header; `trace`: its W3C trace context headers);
    raise Retry, or GatewayError 504 at the deadline."""
    headers = _SENT_HEADERS if auth is None else {**_SENT_HEADERS, "Authorization": auth}
    if trace:
        headers = {**headers, **trace}
    resp = None
    try:
        async with asyncio.timeout_at(deadline):
            resp = await session.post(url, data=payload, headers=headers)
            headers_at = time.monotonic()
            if resp.status == 503:
                resp.release()
                raise Retry("overloaded", replica_failed=False)
            if stream and resp.status == 200:
                rest = resp.content.iter_any().__aiter__()
                return Upstream(resp, None, await _first_chunk(rest), headers_at, rest)
            return Upstream(resp, await resp.read(), None, headers_at)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
        raise Retry(f"connect: {type(e).__name__}", replica_failed=True) from None
    except TimeoutError:  # the deadline (aiohttp's own read timeouts are off)
        _close(resp)
        raise timed_out() from None
    except aiohttp.ClientError as e:  # disconnected, reset, a broken body or a malformed answer
        _close(resp)
        raise Retry(f"dropped: {type(e).__name__}", replica_failed=True) from None


async def _first_chunk(it: AsyncIterator[bytes]) -> bytes:
    async for chunk in it:
        if chunk:
            return chunk
    return b""


def _close(resp: aiohttp.ClientResponse | None) -> None:
    if resp is not None:
        resp.close()


# `"usage": null` with the comma that joins it to its neighbour (after it, or before it when it is last)
_LAST_NULL_USAGE = b',"usage":null}'
_NULL_USAGE = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*})|"usage"\s*:\s*null\s*,\s*')


class SSEFilter:
    """Splits a byte stream into SSE events and reads the usage chunk. When the gateway turned
    `include_usage` on and the client did not ask (`forced_usage`), it takes back what that added: the
    usage-only chunk, and the `"usage": null` field that OpenAI-style servers then put in every chunk."""

    def __init__(self, forced_usage: bool, each: Callable[[bytes], bytes | None] | None = None):
        """`each`: applied to every event first (None drops it): a resumable stream's reader (`StreamState`)."""
        self.forced_usage = forced_usage
        self.usage: Usage | None = None
        self.each = each
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in `chunk` (with what was held back before), bytes otherwise unchanged."""
        self._buf += chunk
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            return b""
        ready, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
        if b'"usage"' not in ready and self.each is None:
            return ready
        events = ready[:-2].split(b"\n\n")
        if self.each is not None:
            events = [out for ev in events if (out := self.each(ev)) is not None]
        kept = [out for ev in events if (out := self._event(ev)) is not None]
        return b"".join(ev + b"\n\n" for ev in kept)

    def tail(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def drop_partial(self) -> None:
        """Forget the incomplete event of a stream that broke (another stream's events follow)."""
        self._buf = b""

    def _event(self, event: bytes) -> bytes | None:
        """The event as the client gets it; None to drop it."""
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        if b'"usage":null' in event or b'"usage": null' in event:
            # only one chunk has a usage value; the field is null in all others
            if not self.forced_usage:
                return event
            if event.endswith(_LAST_NULL_USAGE):  # where inferd, vLLM and OpenAI write it: a fast path
                return event[: -len(_LAST_NULL_USAGE)] + b"}"
            return _NULL_USAGE.sub(b"", event, count=1)
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        usage = parse_usage(obj)
        if usage is None:
            return event
        self.usage = usage
        return None if self.forced_usage and not obj.get("choices") else event


class ClosingStream(StreamingResponse):
    """An SSE response whose `on_close` runs however it ends, even if its body never started; unbuffered
    and uncached, as the server's own streams are."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], headers: dict):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        super().__init__(content, headers=headers, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def relay_events(
    up: Upstream,
    sse: SSEFilter,
    deadline: float,
    on_first: Callable[[], None],
    on_broken: Callable[[str], None],
    resume: Callable[[], Awaitable[Upstream | None]] | None = None,
) -> AsyncIterator[bytes]:
    """The replica's stream, event by event; a failure after the first byte becomes one SSE error event, or,
    with `resume`, the stream of the replica that continues it (None: it could not be continued)."""

    async def next_stream() -> AsyncIterator[bytes] | None:
        nxt = await resume()
        return None if nxt is None else _chunks(nxt, deadline)

    return relay_sse(
        _chunks(up, deadline),
        sse,
        on_first,
        on_broken,
        (aiohttp.ClientError,),
        close=up.close,
        resume=next_stream if resume is not None else None,
    )


async def relay_sse(
    chunks: AsyncIterator[bytes],
    sse: SSEFilter,
    on_first: Callable[[], None],
    on_broken: Callable[[str], None],
    failures: tuple[type[BaseException], ...],
    source: str = "the replica",
    close: Callable[[], None] | None = None,
    resume: Callable[[], Awaitable[AsyncIterator[bytes] | None]] | None = None,
) -> AsyncIterator[bytes]:
    """An upstream's stream relayed as whole SSE events, whatever its client (`failures`: the exceptions
    that mean it broke). A break, or the deadline (`TimeoutError`), ends the stream with one SSE error
    event and no `[DONE]`: the client must not take a cut stream for a complete one. `on_first` runs
    before the first event goes out, `on_broken(kind)` on a break, `close` however it ends. `resume`, on a
    break (not the deadline), gives the chunks of a stream that continues this one (None: none could)."""
    sent_any = False
    try:
        while True:
            try:
                async for chunk in chunks:
                    out = sse.feed(chunk)
                    if out:
                        if not sent_any:
                            sent_any = True
                            on_first()
                        yield out
                tail = sse.tail()
                if tail:
                    yield tail
                return
            except (*failures, TimeoutError) as e:
                timed_out = isinstance(e, TimeoutError)
                kind = "timeout" if timed_out else "stream_broken"
                on_broken(kind)
                if resume is not None and not timed_out:
                    sse.drop_partial()
                    try:
                        nxt = await resume()
                    except TimeoutError:
                        nxt, timed_out, kind = None, True, "timeout"
                    if nxt is not None:
                        chunks = nxt
                        continue
                msg = "the request timed out at the gateway" if timed_out else f"{source} failed while streaming"
                yield GatewayError(502, msg, "server_error", code=kind).sse_event()
                return
    finally:
        if close is not None:
            close()


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
