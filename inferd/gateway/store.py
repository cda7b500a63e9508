"""The Redis client behind the gateway's shared stores, and how a call to it fails when Redis is down.

The budget store and the prefix index may live in Redis, so several gateway processes share them. A Redis
that is gone or frozen must neither hang requests nor flood the log: the client is made with the config's
`redis_timeout_s` as its connect and socket timeout and without redis-py's own retries, every call through
a `StoreGuard` is bounded by that timeout as a whole, and the guard logs one line when its store becomes
unreachable and one when it answers again, not a traceback per request. What a failed call means is the
caller's: a budget cannot be checked (503 `budget_store_unavailable`), a prefix index is only a hint
(the request is routed without it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StoreUnavailable(Exception):
    """A call to the store failed or timed out; the message names the store's address."""


def redis_client(url: str, timeout_s: float):
    """An asyncio Redis client whose every connect and read gives up after `timeout_s`, and never retries."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


def redis_address(client) -> str:
    """The client's server as a URL without credentials: redis://host:port/db."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


class StoreGuard:
    """Runs calls to one store (`what`: "budget store") on one Redis client, bounded by the client's socket
    timeout; a failure is StoreUnavailable. While the store is down, `resting()` is true for one timeout
    after each failure, for callers that would rather skip the store than wait on it."""

    def __init__(self, what: str, client):
        from redis.exceptions import RedisError

        self.what = what
        self.address = redis_address(client)
        self.timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout")
        self.down = False
        self._failed_at = float("-inf")
        self._errors = (RedisError, OSError, TimeoutError)

    def resting(self) -> bool:
        return self.down and time.monotonic() < self._failed_at + (self.timeout_s or 0.0)

    async def run(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await call()
        except self._errors as e:
            why = str(e) or f"no answer within {self.timeout_s:g}s"
            self._failed_at = time.monotonic()
            if not self.down:
                self.down = True
                logger.error("%s %s unreachable: %s", self.what, self.address, why)
            raise StoreUnavailable(f"Redis at {self.address} did not answer: {why}") from None
        if self.down:
            self.down = False
            logger.warning("%s %s reachable again", self.what, self.address)
        return out
