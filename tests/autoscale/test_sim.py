"""The simulator on cases with known answers, and the autoscaler inside it."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.autoscale.profile import Profile, example_profiles, load_profile
from inferd.autoscale.sim import SLO, simulate
from inferd.autoscale.workload import Workload, make_workload
from inferd.fleet.spec import AutoscalingPolicy


def profile(step: float = 0.01, max_num_seqs: int = 1, prefill: float = 1e9, cold: float = 0.0, **kw) -> Profile:
    return Profile("t", prefill, [1], [step], max_num_seqs, cold, **kw)


def test_one_replica_without_batching_matches_the_m_g_1_queueing_formula():
    # Poisson arrivals at 7/s; service = 0.01 s x a geometric number of tokens with mean 10 (rho = 0.7)
    w = make_workload("poisson:rate=7,duration=4000", "fixed:1", "exponential:10", seed=1)
    r = simulate(profile(), w, replicas=1)
    lam, d, p = 7.0, 0.01, 0.1
    es, es2 = d / p, d * d * (2 - p) / p**2
    wq = lam * es2 / (2 * (1 - lam * es))  # Pollaczek-Khinchine mean wait
    assert r.report["ttft_mean_s"] == pytest.approx(wq + d, rel=0.08)  # waiting + the first step
    assert r.report["request_throughput"] == pytest.approx(7.0, rel=0.03)


def test_a_fixed_fleet_below_capacity_serves_every_request_at_once():
    # 2 replicas, a request every 0.25 s, each taking 0.21 s: none ever waits
    w = make_workload("constant:rate=4,duration=100", "fixed:100", "fixed:10")
    r = simulate(profile(step=0.02, prefill=10_000), w, replicas=2, slo=SLO(ttft_s=0.05), price_per_hour=3.5)
    rep = r.report
    assert rep["ttft_p50_s"] == pytest.approx(0.03) and rep["ttft_p95_s"] == pytest.approx(0.03)  # prefill + step
    assert rep["tpot_p95_s"] == pytest.approx(0.02) and rep["slo_attainment"] == 1.0
    assert rep["duration_s"] == pytest.approx(99.75 + 0.21)
    assert rep["replica_hours"] == pytest.approx(2 * rep["duration_s"] / 3600)
    tokens = 400 * 110
    assert rep["cost_per_million_tokens"] == pytest.approx(rep["replica_hours"] * 3.5 / tokens * 1e6)


def test_a_saturated_replica_serves_at_its_batch_capacity():
    # 4 at a time, 10 tokens at 0.04 s a step: 4 requests per 0.4 s = 10 req/s, whatever arrives
    w = make_workload("constant:rate=50,duration=60", "fixed:1", "fixed:10")
    r = simulate(profile(step=0.04, max_num_seqs=4), w, replicas=1)
    assert r.report["request_throughput"] == pytest.approx(10.0, rel=0.01)
    assert r.report["ttft_p95_s"] > 200  # the queue grew by 40 requests a second for a minute


def test_the_autoscaler_follows_a_step_in_load_and_comes_back_down():
    t = np.concatenate([np.arange(0, 60, 0.5), np.arange(60, 180, 0.05), np.arange(180, 300, 0.5)])
    w = Workload(t, np.full(len(t), 1), np.full(len(t), 10))
    policy = AutoscalingPolicy(
        min_replicas=1,
        max_replicas=6,
        targets={"waiting": 4, "running": 3, "kv_cache_usage": None},
        interval_s=2,
        window_s=10,
        scale_down_stabilization_s=20,
        cooldown_s=10,
    )
    r = simulate(profile(step=0.04, max_num_seqs=4, cold=5.0), w, policy=policy, replicas=1)
    tl = r.timeline
    during = [n for x, n in zip(tl["t"], tl["ready"], strict=True) if 120 <= x < 180]
    after = [n for x, n in zip(tl["t"], tl["replicas"], strict=True) if x >= 280]
    # 20 req/s keeps 8 running (0.4 s each): 3 replicas at 3 running each, more while the first queue drains
    assert min(during) >= 3 and max(tl["replicas"]) <= 6
    assert after and set(after) == {1}
    assert r.report["cold_starts"] >= 1 and r.report["finished"] == len(t)
    fixed = simulate(profile(step=0.04, max_num_seqs=4), w, replicas=1)
    assert r.report["ttft_p95_s"] < fixed.report["ttft_p95_s"] / 5  # scaling cut the queueing


def test_scale_to_zero_in_the_simulator_holds_the_first_request_for_a_cold_start():
    t = np.array([0.0, 1.0, 200.0])
    w = Workload(t, np.full(3, 1), np.full(3, 2))
    policy = AutoscalingPolicy(
        min_replicas=0,
        max_replicas=2,
        targets={"waiting": 1},
        interval_s=1,
        window_s=5,
        scale_down_stabilization_s=5,
        cooldown_s=0,
        scale_to_zero_after_s=30,
    )
    r = simulate(profile(step=0.01, cold=7.0), w, policy=policy, replicas=1)
    ttft = r.ttft
    assert ttft[0] == pytest.approx(0.01) and ttft[1] == pytest.approx(0.01)
    assert 7.0 <= ttft[2] <= 9.1  # the fleet went to zero; the next request waited for a cold start
    assert r.report["replica_hours"] * 3600 < 100  # not up for the whole idle gap


def test_example_profiles_load_and_say_they_are_examples():
    names = example_profiles()
    assert len(names) >= 3
    for name in names:
        p = load_profile(name)
        assert "EXAMPLE" in p.description and p.source
        assert p.step_s(1) <= p.step_s(p.max_num_seqs)
