"""Tenant budgets: reserve at admission, settle to the real usage when the response ends.

A budget is a vector of dimensions per window: requests, input tokens, output tokens, total tokens and
a weighted cost. At admission the gateway reserves [1, prompt tokens, max_tokens, sum, cost] in one
atomic step: all dimensions fit and are added, or nothing is added and the request is refused (429)
naming the dimension and when the window resets. A window opens at a tenant's first request after the
previous one closed and lasts `window_s`, so "remaining" and "reset" are exact, not estimates. When the
response ends, the reservation is corrected to the real usage (a refund if the model stopped early).
A concurrency counter is taken and given back the same way.

Two stores with one behaviour: in process memory for a single gateway, and Redis, where each
reservation and each settlement is one Lua script, so any number of gateway processes share a budget.
When Redis does not answer within its timeout, a request is refused with 503 `budget_store_unavailable`:
no request is admitted unchecked.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from inferd.gateway.config import Limits
from inferd.gateway.errors import budget_store_unavailable
from inferd.gateway.store import StoreGuard, StoreUnavailable

DIMENSIONS = ("requests", "input-tokens", "output-tokens", "tokens", "cost")
CONCURRENCY = len(DIMENSIONS)  # index of the concurrency "dimension" in a refusal


def limit_vector(limits: Limits) -> list[float]:
    """Limits in DIMENSIONS order; -1 is unlimited."""
    t = limits.tokens
    vals = [limits.requests, t.input, t.output, t.total, t.cost]
    return [-1.0 if v is None else float(v) for v in vals]


def amount_vector(limits: Limits, input_tokens: int, output_tokens: int, cached_input: int = 0) -> list[float]:
    w = limits.cost
    cost = w.input * (input_tokens - cached_input) + w.cached_input * cached_input + w.output * output_tokens
    return [1.0, float(input_tokens), float(output_tokens), float(input_tokens + output_tokens), cost]


@dataclass
class Decision:
    allowed: bool
    failed: int | None  # index into DIMENSIONS (or CONCURRENCY) when refused
    limits: list[float]
    used: list[float]  # in the window, after this reservation if allowed
    reset_s: float  # until the window closes
    window_start: float  # identifies the window the reservation went into

    def remaining(self) -> list[float]:
        return [max(0.0, lim - u) if lim >= 0 else -1.0 for lim, u in zip(self.limits, self.used, strict=True)]


@dataclass
class _Window:
    start: float
    used: list[float] = field(default_factory=lambda: [0.0] * len(DIMENSIONS))


class MemoryBudgetStore:
    """One process's budgets. Each call runs without an await, so it is atomic on the event loop."""

    def __init__(self):
        self._windows: dict[str, _Window] = {}
        self._concurrent: dict[str, int] = {}

    async def reserve(
        self, tenant: str, limits: list[float], amounts: list[float], window_s: float, max_concurrent: int | None
    ) -> Decision:
        now = time.time()
        w = self._windows.get(tenant)
        if w is None or now >= w.start + window_s:
            w = self._windows[tenant] = _Window(now)
        reset = w.start + window_s - now
        failed = next(
            (i for i, (lim, u, a) in enumerate(zip(limits, w.used, amounts, strict=True)) if 0 <= lim < u + a), None
        )
        if failed is None and max_concurrent is not None and self._concurrent.get(tenant, 0) >= max_concurrent:
            failed = CONCURRENCY
        if failed is None:
            w.used = [u + a for u, a in zip(w.used, amounts, strict=True)]
            self._concurrent[tenant] = self._concurrent.get(tenant, 0) + 1
        return Decision(failed is None, failed, limits, list(w.used), reset, w.start)

    async def settle(self, tenant: str, window_start: float, deltas: list[float]) -> None:
        w = self._windows.get(tenant)
        if w is not None and w.start == window_start:
            w.used = [max(0.0, u + d) for u, d in zip(w.used, deltas, strict=True)]
        self._concurrent[tenant] = max(0, self._concurrent.get(tenant, 0) - 1)


# KEYS: window hash, concurrency counter. ARGV: window_ms, max_concurrent (-1: none), n, limits.., amounts..,
# deadline (Redis's clock, ms; -1: none). The window's start and the clock are Redis's own (TIME), so gateways
# with skewed clocks agree. A call that reaches Redis after its deadline (Redis was frozen, the gateway has
# already answered 503) reserves nothing: a late reservation would charge the tenant and hold a concurrency
# slot that no settlement ever gives back.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = tonumber(ARGV[1])
local maxc = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local deadline = tonumber(ARGV[4 + 2 * n])
if deadline >= 0 and now > deadline then return {-1, '0', '0'} end
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '-1')
if start < 0 or now >= start + win then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'start', now)
  redis.call('PEXPIRE', KEYS[1], win)
  start = now
end
local used = {}
local failed = 0
for i = 1, n do
  local lim = tonumber(ARGV[3 + i])
  local amt = tonumber(ARGV[3 + n + i])
  used[i] = tonumber(redis.call('HGET', KEYS[1], 'd' .. i) or '0')
  if failed == 0 and lim >= 0 and used[i] + amt > lim then failed = i end
end
if failed == 0 and maxc >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= maxc then failed = n + 1 end
if failed == 0 then
  for i = 1, n do
    used[i] = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'd' .. i, ARGV[3 + n + i]))
  end
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], 3600000)
end
local out = {failed, tostring(start), tostring(start + win - now)}
for i = 1, n do out[3 + i] = tostring(used[i]) end
return out
"""

# KEYS: window hash, concurrency counter. ARGV: window start, n, deltas..
_SETTLE = """
if redis.call('HGET', KEYS[1], 'start') == ARGV[1] then
  local n = tonumber(ARGV[2])
  for i = 1, n do
    local v = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'd' .. i, ARGV[2 + i]))
    if v < 0 then redis.call('HSET', KEYS[1], 'd' .. i, 0) end
  end
end
if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
return 1
"""


class RedisBudgetStore:
    """Every call is bounded by the client's timeout; one that fails is 503 `budget_store_unavailable`
    naming Redis and its address (store.py logs the outage once, not per request)."""

    def __init__(self, redis, prefix: str):
        self.redis = redis
        self.prefix = prefix
        self.guard = StoreGuard("budget store", redis)
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._clock_offset_ms: float | None = None  # Redis's clock minus ours, from the last reservation

    async def _run(self, call):
        try:
            return await self.guard.run(call)
        except StoreUnavailable as e:
            raise budget_store_unavailable(str(e)) from None

    def _keys(self, tenant: str) -> list[str]:
        # one hash tag per tenant, so a Redis Cluster keeps both keys on one shard
        return [f"{self.prefix}:budget:{{{tenant}}}:window", f"{self.prefix}:budget:{{{tenant}}}:concurrent"]

    async def reserve(
        self, tenant: str, limits: list[float], amounts: list[float], window_s: float, max_concurrent: int | None
    ) -> Decision:
        window_ms = int(window_s * 1000)
        sent_ms = time.time() * 1000
        timeout_ms = (self.guard.timeout_s or 0.0) * 1000
        # the deadline in Redis's clock, known from the previous answer (to within a round trip); none before it
        deadline = (
            -1 if self._clock_offset_ms is None or not timeout_ms else int(sent_ms + timeout_ms + self._clock_offset_ms)
        )
        args = [window_ms, -1 if max_concurrent is None else max_concurrent, len(limits), *limits, *amounts, deadline]
        failed, start, reset_ms, *used = await self._run(lambda: self._reserve(keys=self._keys(tenant), args=args))
        failed = int(failed)
        if failed < 0:  # past its deadline in Redis: the guard's timeout fires first, so this is only a race
            raise budget_store_unavailable(f"Redis at {self.guard.address} answered after the deadline")
        redis_now = float(start) + window_ms - float(reset_ms)
        self._clock_offset_ms = redis_now - (sent_ms + time.time() * 1000) / 2
        return Decision(
            allowed=failed == 0,
            failed=None if failed == 0 else failed - 1,
            limits=limits,
            used=[float(u) for u in used],
            reset_s=float(reset_ms) / 1000,
            window_start=float(start),
        )

    async def settle(self, tenant: str, window_start: float, deltas: list[float]) -> None:
        start = str(int(window_start))
        await self._run(lambda: self._settle(keys=self._keys(tenant), args=[start, len(deltas), *deltas]))

    async def window(self, tenant: str) -> dict[str, float]:
        """The tenant's window as stored: `start` (Redis's clock, ms) and `d1`.. per dimension; {} if none."""
        raw = await self._run(lambda: self.redis.hgetall(self._keys(tenant)[0]))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}


def _duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 250ms."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60}s"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def rate_limit_headers(d: Decision) -> dict[str, str]:
    """x-ratelimit-limit-*/remaining-*/reset-* for every limited dimension, as OpenAI names them."""
    headers = {}
    for name, lim, rem in zip(DIMENSIONS, d.limits, d.remaining(), strict=True):
        if lim < 0:
            continue
        headers[f"x-ratelimit-limit-{name}"] = _number(lim)
        headers[f"x-ratelimit-remaining-{name}"] = _number(rem)
        headers[f"x-ratelimit-reset-{name}"] = _duration(d.reset_s)
    return headers
