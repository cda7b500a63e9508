"""The scaling decision for one pool, as one pure object: a snapshot of signals in, desired replicas out.

It computes what Kubernetes' HPA (and so KEDA) computes, with the LLM signals that say whether a
replica meets its latency targets:

- per target signal, replicas = ceil(signal / target): totals (waiting, running, KV cache usage summed
  over replicas, request and token rates) against a per-replica target; latencies (TTFT/ITL p95, the
  predicted TTFT) as ready replicas x value / target. The largest wins; none set gives 0.
- clamped to [min_replicas, max_replicas] (with min 0 and `scale_to_zero_after_s`: at least 1 until no
  request came for that long, then 0; the first request brings one back at once);
- scale-up takes the lowest recommendation of the scale-up stabilisation window, scale-down the highest
  of the scale-down window, so one spike or one quiet poll moves nothing;
- at most `max_scale_up_step` added and `max_scale_down_step` removed per decision, and no removal
  within `cooldown_s` of the last change;
- replicas still loading their model are part of the current count (never added twice) but never
  capacity: latency signals scale by the ready replicas only, and nothing is scaled down while one is
  loading (it was started for a reason; removing a ready one instead would leave less capacity than
  either decision wanted), so a replica that is starting is never scaled away.

Time comes in with the signals (`Signals.at`), so the simulator drives the same object with simulated
time and the tests with synthetic series. `inferd up`, the simulator and `inferd autoscale` (the
`inferd_autoscaler_desired_replicas{pool}` gauge for KEDA or Ray Serve) all call `decide`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge

from inferd.fleet.spec import AutoscalingPolicy

DESIRED_GAUGE = "inferd_autoscaler_desired_replicas"

# target name -> how it is turned into replicas: a fleet total against a per-replica target, or a
# fleet-wide latency whose ratio to its target scales the ready replicas
TOTAL_SIGNALS = ("waiting", "running", "kv_cache_usage", "request_rate", "token_rate")
RATIO_SIGNALS = ("ttft_p95_s", "itl_p95_s", "predicted_ttft_s")


@dataclass
class Signals:
    """One pool's state at `at` (seconds, any clock). Totals are summed over the pool's ready replicas."""

    at: float
    ready: int
    loading: int = 0
    waiting: float = 0.0  # requests queued in the replicas
    gateway_waiting: float = 0.0  # requests for this pool waiting at the gateway (no replica, or all full)
    running: float = 0.0
    kv_cache_usage: float = 0.0  # sum of the replicas' usage fractions
    ttft_p95_s: float | None = None  # None: no request finished its first token in the window
    itl_p95_s: float | None = None
    predicted_ttft_s: float | None = None
    request_rate: float = 0.0  # requests/s finished over the window
    token_rate: float = 0.0  # (prompt + generated) tokens/s over the window

    @property
    def current(self) -> int:
        return self.ready + self.loading

    @property
    def active(self) -> bool:
        """Any request queued, running or finished within the window."""
        return self.waiting + self.gateway_waiting + self.running + self.request_rate > 0

    def value(self, name: str) -> float | None:
        if name == "waiting":
            return self.waiting + self.gateway_waiting
        return getattr(self, name)


@dataclass
class Decision:
    at: float
    current: int
    desired: int
    recommendation: int  # before the windows, steps and cooldown
    per_signal: dict[str, int]
    reason: str


def signal_desires(policy: AutoscalingPolicy, s: Signals) -> dict[str, int]:
    """Replicas each set target asks for (ceil(total / target), or ceil(ready x value / target))."""
    out: dict[str, int] = {}
    for name, target in policy.targets.model_dump().items():
        value = s.value(name)
        if target is None or value is None:
            continue
        if name in RATIO_SIGNALS:
            if s.ready == 0:
                continue  # no replica serves: a latency says nothing about how many are needed
            value = s.ready * value
        out[name] = max(0, math.ceil(value / target - 1e-9))
    return out


@dataclass
class PoolAutoscaler:
    """The policy of one pool with the little history it needs (recent recommendations, last change)."""

    pool: str
    policy: AutoscalingPolicy
    gauge: Gauge | None = None
    _history: deque[tuple[float, int]] = field(default_factory=deque)
    _last_change: float = float("-inf")
    _last_active: float | None = None

    def decide(self, s: Signals) -> Decision:
        p, now, current = self.policy, s.at, s.current
        if s.active or self._last_active is None:
            self._last_active = now  # the start counts as activity: an idle fleet waits before going to 0
        per_signal = signal_desires(p, s)
        raw = max(per_signal.values(), default=0)
        rec = min(max(raw, self._floor(now)), p.max_replicas)
        self._remember(now, rec)
        desired, reason = self._stabilise(now, current, rec, s)
        desired = max(desired, s.loading, 0)
        if desired != current:
            self._last_change = now
        if self.gauge is not None:
            self.gauge.labels(self.pool).set(desired)
        return Decision(now, current, desired, rec, per_signal, reason)

    def _floor(self, now: float) -> int:
        p = self.policy
        if p.min_replicas > 0 or p.scale_to_zero_after_s is None:
            return p.min_replicas
        return 1 if now - self._last_active < p.scale_to_zero_after_s else 0

    def _remember(self, now: float, rec: int) -> None:
        self._history.append((now, rec))
        keep = max(self.policy.scale_up_stabilization_s, self.policy.scale_down_stabilization_s)
        while self._history and self._history[0][0] < now - keep:
            self._history.popleft()

    def _window(self, now: float, seconds: float) -> list[int]:
        return [r for t, r in self._history if t >= now - seconds]

    def _stabilise(self, now: float, current: int, rec: int, s: Signals) -> tuple[int, str]:
        p = self.policy
        if current == 0 and s.active and rec > 0:
            return min(rec, p.max_scale_up_step), "woken from zero by a request"
        if current < p.min_replicas:
            return p.min_replicas, "below min_replicas"
        if current > p.max_replicas:
            return p.max_replicas, "above max_replicas"
        if rec > current:
            up = min(self._window(now, p.scale_up_stabilization_s))
            if up <= current:
                return current, "scale-up held by the stabilisation window"
            return min(up, current + p.max_scale_up_step), "scale up"
        if rec < current:
            if rec == 0 and self._floor(now) == 0 and p.scale_to_zero_after_s is not None:
                return 0, f"idle for {p.scale_to_zero_after_s:g}s: scale to zero"
            if s.loading:
                return current, "scale-down held: a replica is still loading"
            down = max(self._window(now, p.scale_down_stabilization_s))
            if down >= current:
                return current, "scale-down held by the stabilisation window"
            if now - self._last_change < p.cooldown_s:
                return current, "scale-down held by the cooldown"
            return max(down, current - p.max_scale_down_step), "scale down"
        return current, "steady"


def desired_gauge(registry: CollectorRegistry) -> Gauge:
    return Gauge(DESIRED_GAUGE, "Replicas the autoscaling policy wants for the pool.", ["pool"], registry=registry)


class FleetAutoscaler:
    """One `PoolAutoscaler` per autoscaled pool, sharing one registry with the desired-replicas gauge."""

    def __init__(self, policies: dict[str, AutoscalingPolicy], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.gauge = desired_gauge(self.registry)
        self.pools = {name: PoolAutoscaler(name, p, self.gauge) for name, p in policies.items()}

    def decide(self, signals: dict[str, Signals]) -> dict[str, Decision]:
        return {name: self.pools[name].decide(s) for name, s in signals.items() if name in self.pools}
