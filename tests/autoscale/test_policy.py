"""The policy on synthetic signal series: what it decides, step by step, and why."""

from __future__ import annotations

from prometheus_client import generate_latest

from inferd.autoscale.policy import FleetAutoscaler, PoolAutoscaler, Signals, signal_desires
from inferd.fleet.spec import AutoscalingPolicy


def policy(**kw) -> AutoscalingPolicy:
    base = dict(
        min_replicas=1,
        max_replicas=5,
        targets={"waiting": 4, "kv_cache_usage": None},
        scale_up_stabilization_s=0,
        scale_down_stabilization_s=0,
        cooldown_s=0,
        max_scale_up_step=4,
        max_scale_down_step=1,
    )
    return AutoscalingPolicy.model_validate(base | kw)


def run(scaler: PoolAutoscaler, series: list[dict], start_ready: int = 1) -> list[int]:
    """Feed one signal a second, actuating each decision at once (replicas ready immediately)."""
    ready, out = start_ready, []
    for t, kw in enumerate(series):
        d = scaler.decide(Signals(at=float(t), ready=ready, **kw))
        ready = d.desired
        out.append(d.desired)
    return out


def test_each_signal_asks_for_ceil_of_signal_over_target_and_the_largest_wins():
    p = policy(targets={"waiting": 4, "kv_cache_usage": 0.5, "ttft_p95_s": 0.5, "token_rate": 100})
    s = Signals(at=0, ready=2, waiting=9, kv_cache_usage=1.2, ttft_p95_s=0.6, token_rate=100)
    assert signal_desires(p, s) == {"waiting": 3, "kv_cache_usage": 3, "ttft_p95_s": 3, "token_rate": 1}
    s.gateway_waiting = 4  # requests waiting at the gateway count as waiting
    assert signal_desires(p, s)["waiting"] == 4
    assert "ttft_p95_s" not in signal_desires(p, Signals(at=0, ready=0, ttft_p95_s=9.0))  # no replica: no latency


def test_scales_up_as_the_queue_grows_within_the_step_limit():
    scaler = PoolAutoscaler("p", policy(max_scale_up_step=1))
    got = run(scaler, [{"waiting": w} for w in (0, 4, 8, 16, 16, 16, 16)])
    assert got == [1, 1, 2, 3, 4, 4, 4]  # 16/4 = 4, reached one replica per decision


def test_a_spike_shorter_than_the_scale_up_window_moves_nothing():
    scaler = PoolAutoscaler("p", policy(scale_up_stabilization_s=3))
    got = run(scaler, [{"waiting": w} for w in (0, 20, 0, 0, 8, 8, 8, 8, 8)])
    assert got == [1, 1, 1, 1, 1, 1, 1, 2, 2]  # the spike at t=1 ignored; 8 held from t=4 acts at t=7


def test_scale_down_waits_for_its_window_and_the_cooldown_one_step_at_a_time():
    scaler = PoolAutoscaler("p", policy(scale_down_stabilization_s=4, cooldown_s=6))
    got = run(scaler, [{"waiting": 12}] + [{"waiting": 0}] * 12)
    # up at t=0; the window (until t=4) then the cooldown (until t=6) hold 3; one step down at t=6; the
    # cooldown counts from every change, so 2 -> 1 no sooner than t=12
    assert got == [3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 1]


def test_never_beyond_min_or_max():
    scaler = PoolAutoscaler("p", policy(min_replicas=2, max_replicas=3, max_scale_up_step=10))
    assert run(scaler, [{"waiting": 1000}, {"waiting": 0}, {"waiting": 0}], start_ready=2) == [3, 2, 2]
    below = PoolAutoscaler("p", policy(min_replicas=2))
    assert below.decide(Signals(at=0, ready=0)).desired == 2  # a crashed fleet is brought back to min


def test_a_loading_replica_is_never_capacity_nor_removed():
    p = policy(targets={"ttft_p95_s": 1.0, "waiting": None})
    scaler = PoolAutoscaler("p", p)
    # one ready replica at twice its TTFT target, one loading: 2 wanted, 2 there -> nothing added
    d = scaler.decide(Signals(at=0, ready=1, loading=1, ttft_p95_s=2.0))
    assert (d.current, d.desired) == (2, 2)
    # idle, with two replicas still loading: nothing is removed, neither they nor the ready one
    d = scaler.decide(Signals(at=1, ready=1, loading=2, ttft_p95_s=0.1))
    assert d.recommendation == 1 and d.desired == 3 and "loading" in d.reason
    assert scaler.decide(Signals(at=2, ready=3, ttft_p95_s=0.1)).desired == 2  # once they are ready


def test_zero_after_idle_and_back_on_the_first_request():
    p = policy(min_replicas=0, scale_to_zero_after_s=5, scale_down_stabilization_s=2)
    scaler = PoolAutoscaler("p", p)
    got = run(scaler, [{"running": 1}] + [{}] * 7)
    assert got == [1, 1, 1, 1, 1, 0, 0, 0]  # last activity at t=0, idle 5 s -> zero at t=5
    d = scaler.decide(Signals(at=8, ready=0, gateway_waiting=1))  # a request waits at the gateway
    assert d.desired == 1 and "zero" in d.reason
    assert scaler.decide(Signals(at=9, ready=0, loading=1, gateway_waiting=1)).desired == 1  # not twice


def test_the_desired_replicas_gauge_follows_each_decision():
    fleet = FleetAutoscaler({"a": policy(), "b": policy(max_replicas=2)})
    fleet.decide({"a": Signals(at=0, ready=1, waiting=12), "b": Signals(at=0, ready=1, waiting=40)})
    text = generate_latest(fleet.registry).decode()
    assert 'inferd_autoscaler_desired_replicas{pool="a"} 3.0' in text
    assert 'inferd_autoscaler_desired_replicas{pool="b"} 2.0' in text
