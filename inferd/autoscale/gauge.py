"""`inferd autoscaler`: the policy as a service, for fleets that something else actuates (KEDA, Ray Serve).

It reads each autoscaled pool's signals from Prometheus (the replicas' series carry a `pool` label),
counts a pool's replicas from Prometheus' own `up` series (`up == 1`: ready; `up == 0`: listed but not
answering yet, which is how a replica still loading its model looks), runs the pool's `PoolAutoscaler`
every `interval_s`, and serves `inferd_autoscaler_desired_replicas{pool}` on its `/metrics`. A KEDA
ScaledObject then scales on that gauge with a target of 1 per replica, or a Ray Serve custom policy
returns it, and the decision is the one `inferd up` and the simulator make.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from inferd.autoscale.policy import Decision, FleetAutoscaler
from inferd.autoscale.signals import PrometheusError, PrometheusSource
from inferd.fleet.spec import FleetSpec

logger = logging.getLogger(__name__)


@dataclass
class PoolState:
    next_at: float = 0.0
    last: Decision | None = None


class AutoscalerService:
    def __init__(self, spec: FleetSpec, source: PrometheusSource):
        self.policies = {p.name: p.autoscaling for _, p in spec.pools() if p.autoscaling is not None}
        self.fleet = FleetAutoscaler(self.policies)
        self.source = source
        self.state = {name: PoolState() for name in self.policies}

    def count(self, pool: str, up: int) -> int:
        return int(self.source.query(f'count(up{{pool="{pool}"}} == {up})') or 0)

    def gateway_queue(self) -> float:
        return self.source.query("sum(inferd_gateway_queue_size)") or 0.0

    def round(self, now: float) -> dict[str, Decision]:
        """Decide for every pool whose interval has come; the decisions made."""
        out = {}
        due = [p for p, st in self.state.items() if now >= st.next_at]
        if not due:
            return out
        queued = self.gateway_queue() if len(self.policies) == 1 else 0.0
        for pool in due:
            st = self.state[pool]
            st.next_at = now + self.policies[pool].interval_s
            try:
                m = self.source.read(pool, [], now)
                s = m.signals(now, self.count(pool, 1), self.count(pool, 0), queued)
            except PrometheusError as e:
                logger.warning("pool %s: no decision this round: %s", pool, e)
                continue
            st.last = out[pool] = self.fleet.pools[pool].decide(s)
        return out

    def run(self, stop: threading.Event, clock=None) -> None:
        import time

        clock = clock or time.monotonic
        while not stop.is_set():
            for pool, d in self.round(clock()).items():
                if d.desired != d.current:
                    logger.info("pool %s: %d -> %d (%s) %s", pool, d.current, d.desired, d.reason, d.per_signal)
            stop.wait(0.5)
