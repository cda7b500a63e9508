"""The gateway's wait queue, for when every healthy replica of a pool is saturated.

Waiting requests are woken whenever capacity may have freed (a request ended, a load scrape came in),
all at once but in admission order: highest tenant priority first, then a fair share among tenants of the
same priority, then arrival order. The fair share (`routing.queue.fairness`) is either the tenant with the
fewest requests in flight at the gateway (`in_flight`), or the one that has received the least service
(`vtc`, the virtual token counter of Sheng et al., OSDI '24, as llm-d's flow control has it): each tenant's
counter grows by the tokens it is served (input + output, divided by the tenant's `weight`; the
expected tokens when a request is sent, corrected to the real usage when it ends), and a tenant that starts
waiting after being idle has its counter lifted to the least counter among the tenants with work, so
idling banks no credit. One tenant's flood then waits behind the others' requests, whatever their count.
Picking runs without an await, so the first woken takes the first free slot; the others find none and wait
again, keeping their place. A request waits at most `routing.queue.max_wait_s` in all (then 503
`queue_timeout` with Retry-After), however often it was woken.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field

from inferd.gateway.errors import GatewayError, timed_out


@dataclass(order=True)
class _Waiter:
    sort_key: tuple
    future: asyncio.Future = field(compare=False)
    tenant: str = field(compare=False)


class AdmissionQueue:
    def __init__(self, max_size: int, max_wait_s: float, fairness: str = "in_flight"):
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.fairness = fairness
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self.in_flight: Counter[str] = Counter()  # per tenant, admitted and not finished
        self.served: dict[str, float] = {}  # per tenant, the virtual token counter (`vtc`)

    def charge(self, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """Count service for `tenant` (negative: a correction of an expected charge)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens / weight

    def _lift(self, tenant: str) -> None:
        """A tenant that had no work waiting or in flight starts at the least counter of those that have."""
        busy = {w.tenant for w in self._waiters} | {t for t, n in self.in_flight.items() if n > 0}
        if tenant in busy:
            return
        others = [self.served.get(t, 0.0) for t in busy]
        if others:
            self.served[tenant] = max(self.served.get(tenant, 0.0), min(others))

    def _share(self, tenant: str) -> float:
        return self.served.get(tenant, 0.0) if self.fairness == "vtc" else self.in_flight[tenant]

    def __len__(self) -> int:
        return len(self._waiters)

    def full(self) -> bool:
        return len(self._waiters) >= self.max_size

    async def wait(self, tenant: str, priority: int, seq: int | None, queued_at: float, deadline: float) -> int:
        """Wait to be woken; returns the waiter's place to keep on re-waiting. Past `max_wait_s` since
        `queued_at` (the request's first wait, monotonic seconds) it raises 503 `queue_timeout`, past the
        request's deadline 504 `timeout`, whichever comes first."""
        if seq is None:
            if self.full():
                raise _overloaded("the gateway's queue is full")
            seq = next(self._seq)
            if self.fairness == "vtc":
                self._lift(tenant)
        loop = asyncio.get_running_loop()
        w = _Waiter((-priority, seq), loop.create_future(), tenant)
        self._waiters.append(w)
        give_up = queued_at + self.max_wait_s
        try:
            async with asyncio.timeout_at(min(give_up, deadline)):
                await w.future
        except TimeoutError:
            if give_up > deadline:
                raise timed_out() from None
            raise GatewayError(
                503,
                f"every replica stayed saturated while the request waited {self.max_wait_s:g}s at the gateway"
                " (routing.queue.max_wait_s)",
                "server_error",
                code="queue_timeout",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            if w in self._waiters:
                self._waiters.remove(w)
        return seq

    def wake_all(self) -> None:
        """Wake every waiter, in admission order (priority, fair share, arrival)."""
        if not self._waiters:
            return
        order = sorted(self._waiters, key=lambda w: (w.sort_key[0], self._share(w.tenant), w.sort_key[1]))
        self._waiters.clear()
        for w in order:
            if not w.future.done():
                w.future.set_result(None)


def _overloaded(why: str) -> GatewayError:
    return GatewayError(503, why, "server_error", code="overloaded", headers={"Retry-After": "1"})
