"""The simulator on cases with known answers, and the autoscaler inside it."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.autoscale.profile import Profile, example_profiles, load_profile
from inferd.autoscale.sim import SLO, Simulator, UtilisationSimulator, simulate
from inferd.autoscale.workload import Workload, make_workload, with_shared_prefixes
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


def test_a_token_budget_prefills_a_burst_in_chunks_as_the_scheduler_does():
    """A request decoding (1-token prompt, from t=0), then two 300-token prompts at 0.5 s, which join at the
    next step boundary (0.501). Step 0.1 s, 1000 prompt tokens/s. Without a budget both are prefilled in
    one step (0.1 + 0.6 s); with 512 tokens a step, the decode takes one, the first prompt 300 and the
    second 211 in step one (0.1 + 0.511), the second's last 89 in step two, which pays the decode step again."""
    w = Workload(np.array([0.0, 0.5, 0.5]), np.array([1, 300, 300]), np.array([100, 1, 1]))
    free = simulate(Profile("p", 1000.0, [1], [0.1], 8), w, replicas=1).ttft
    assert free[1:] == pytest.approx([0.701, 0.701])
    budget = simulate(Profile("p", 1000.0, [1], [0.1], 8, max_num_batched_tokens=512), w, replicas=1).ttft
    assert budget[1:] == pytest.approx([0.612, 0.612 + 0.1 + 0.089])


def test_a_token_budget_leaves_room_for_the_decodes_first():
    """A long request decoding, then a 400-token prompt with a budget of 256: one token of each step goes
    to the decode, so the prompt takes two steps (255 + 145 tokens) and the decode goes on meanwhile."""
    w = Workload(np.array([0.0, 0.05]), np.array([10, 400]), np.array([20, 1]))
    p = Profile("p", 1000.0, [1], [0.1], 8, max_num_batched_tokens=256)
    result = simulate(p, w, replicas=1)
    # the first is prefilled in 0.1 + 0.01 s; the second joins when that step ends (0.11)
    assert result.ttft[0] == pytest.approx(0.11)
    assert result.ttft[1] == pytest.approx(0.11 + (0.1 + 0.255) + (0.1 + 0.145) - 0.05)
    assert result.report["finished"] == 2


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


def test_the_utilisation_baseline_scales_on_busy_replicas_however_much_room_their_batches_have():
    targets = {"running": 0.5, "waiting": None, "kv_cache_usage": None}
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=3, targets=targets, interval_s=2, window_s=10)
    w = make_workload("poisson:rate=5,duration=120", "fixed:8", "fixed:20", 0)
    busy = UtilisationSimulator(profile(step=0.04, max_num_seqs=64), w, policy, 1).run()
    assert max(busy.timeline["replicas"]) == 3  # one replica stepping all the time reads as 100% busy
    trickle = make_workload("poisson:rate=0.05,duration=120", "fixed:8", "fixed:20", 0)  # ~4% of one replica
    assert max(UtilisationSimulator(profile(step=0.04), trickle, policy, 1).run().timeline["replicas"]) == 1


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


def test_the_plan_sizes_the_fleet_to_the_slos_and_prices_it():
    from inferd.autoscale.plan import PlanInputs, plan

    # one replica: 4 at a time, 10 tokens at 0.04 s a step -> saturates at 10 req/s
    prof = profile(step=0.04, max_num_seqs=4, prefill=1e6)
    inputs = PlanInputs(
        rate=25, slo=SLO(ttft_p95_s=0.2), price_per_hour=3.5, prompt_len="fixed:1", output_len="fixed:10", requests=400
    )
    p = plan(prof, inputs)
    assert p["per_replica"]["saturation_request_rate"] == pytest.approx(10, rel=0.03)
    assert 0 < p["per_replica"]["max_request_rate_at_slo"] < 10  # queueing eats into the SLO before saturation
    assert p["replicas"] >= 3 and p["fleet"]["ttft_p95_s"] <= 0.2
    # raw: $3.5/h for 10 req/s x 11 tokens; at the SLO: replicas x $3.5/h for 25 req/s x 11 tokens
    assert p["raw_cost"]["per_million_tokens"] == pytest.approx(3.5 / (10 * 11 * 3600) * 1e6, rel=0.03)
    want = p["replicas"] * 3.5 / (25 * 11 * 3600) * 1e6
    assert p["cost_at_slo"]["per_million_tokens"] == pytest.approx(want, rel=0.02)


def test_simulate_and_plan_from_the_command_line(tmp_path, capsys):
    import json

    from inferd.cli import main

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "models:\n  - name: m\n    model: gemma3-270m\n    pools:\n      - name: p\n        replicas: 1\n"
        "        autoscaling: {min_replicas: 1, max_replicas: 3, targets: {waiting: 2}, interval_s: 5}\n"
    )
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.5},{64},{8}\n" for i in range(60)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["simulate", "--profile", "example-cpu-gemma3-270m", "--trace", str(trace), "--policy", str(fleet)]
    argv += ["--slo", "ttft_p95:2s", "--price-per-hour", "1", "--output-json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())["report"]
    assert report["requests"] == 60 and report["finished"] == 60 and report["cost_per_million_tokens"] > 0
    assert png.stat().st_size > 10_000
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "--profile",
                "example-cpu-gemma3-270m",
                "--rate",
                "2",
                "--slo",
                "ttft_p95:2s",
                "--price-per-hour",
                "1",
                "--prompt-len",
                "fixed:64",
                "--output-len",
                "fixed:16",
            ]
        )
        == 0
    )
    assert "replicas" in capsys.readouterr().out
    assert main(["plan", "--profile", "example-cpu-gemma3-270m", "--rate", "2", "--price-per-hour", "1"]) == 2


def test_the_disaggregated_plan_sizes_prefill_and_decode_pools_apart():
    from inferd.autoscale.plan import PlanInputs, plan_disaggregated

    # prefill 1000 tok/s of 100-token prompts: 10 req/s a prefill replica; decode 4 x 10 tokens at 0.04 s: 10 req/s
    prof = profile(step=0.04, max_num_seqs=4, prefill=1000)
    inputs = PlanInputs(
        rate=15,
        slo=SLO(ttft_p95_s=1.0, itl_p95_s=0.05),
        price_per_hour=1.0,
        prompt_len="fixed:100",
        output_len="fixed:10",
        requests=300,
    )
    d = plan_disaggregated(prof, inputs)
    assert d["pools"]["prefill"]["saturation_request_rate"] == pytest.approx(10, rel=0.05)
    assert d["pools"]["decode"]["saturation_request_rate"] == pytest.approx(10, rel=0.05)
    assert d["pools"]["prefill"]["replicas"] >= 2 and d["pools"]["decode"]["replicas"] >= 2
    assert d["replicas"] == d["pools"]["prefill"]["replicas"] + d["pools"]["decode"]["replicas"]


def test_generated_workloads_have_the_asked_rates_and_traces_read_their_own_lengths(tmp_path):
    import json

    from inferd.errors import ConfigError

    day = make_workload("diurnal:mean=2,peak_to_trough=4,duration=86400", "fixed:8", "exponential:20", seed=3)
    assert len(day) / 86400 == pytest.approx(2, rel=0.02)
    night = np.sum(day.arrivals < 3600) / 3600
    noon = np.sum((day.arrivals >= 43200 - 1800) & (day.arrivals < 43200 + 1800)) / 3600
    assert noon / night == pytest.approx(4, rel=0.15)  # trough at midnight, peak at noon
    bursty = make_workload("gamma:rate=5,burstiness=0.2,duration=2000", "fixed:1", "fixed:1", seed=1)
    gaps = np.diff(bursty.arrivals)
    assert len(bursty) / 2000 == pytest.approx(5, rel=0.1) and gaps.std() / gaps.mean() > 1.8  # CV = 1/sqrt(0.2)
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": f"2024-05-01T10:00:0{i}", "ContextTokens": 10 * (i + 1), "GeneratedTokens": 3} for i in range(3)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    w = make_workload(str(trace), "fixed:1", "fixed:1")
    assert list(w.arrivals) == [0, 1, 2] and list(w.prompt_tokens) == [10, 20, 30] and list(w.output_tokens) == [3] * 3
    with pytest.raises(ConfigError):
        make_workload("sine:rate=1", "fixed:1", "fixed:1")
    with pytest.raises(ConfigError):
        make_workload("poisson:rate=1,duration=5", "zipf:2", "fixed:1")


# -- shared prefixes, and which replica a scale-down drains ----------------------------------------------
def test_a_cached_prefix_is_prefilled_once_per_replica_and_evicted_least_recent_first():
    """One replica, prompts of a 400-token prefix + 100 of their own at 1000 tokens/s, one at a time: the first
    of each prefix computes 500 tokens (0.5 s + the step), the next of the same prefix only its own 100. A cache
    of 800 tokens holds two prefixes: a third evicts the least recently used."""
    arrivals = np.arange(6) * 10.0
    ids = np.array([0, 0, 1, 0, 2, 1])  # 2 evicts 1 (0 was used after it), so 1 is computed again
    w = Workload(arrivals, np.full(6, 500), np.full(6, 1), ids, np.full(6, 400))
    sim = Simulator(Profile("p", 1000.0, [1], [0.1], 4), w, replicas=1, kv_cache_tokens=800)
    r = sim.run()
    assert r.ttft == pytest.approx([0.6, 0.2, 0.6, 0.2, 0.6, 0.6])
    assert r.report["cached_prompt_tokens"] == 800
    assert list(sim.replicas[0].cache) == [2, 1]  # least recent first
    assert simulate(Profile("p", 1000.0, [1], [0.1], 4), w, replicas=1).ttft == pytest.approx([0.6] * 6)


def _scale_down(victim: str, seed: int) -> tuple[float, list[int]]:
    w = make_workload("poisson:rate=1.5,duration=600", "uniform:16:64", "uniform:16:64", seed)
    w = with_shared_prefixes(w, prefixes=12, tokens=1024, zipf=1.0, seed=seed)
    sim = Simulator(load_profile("example-cpu-gemma3-270m"), w, replicas=3, kv_cache_tokens=8192,
                    routing="prefix", victim=victim, scale_down_at=300.0, seed=seed)  # fmt: skip
    r = sim.run()
    after = (w.arrivals >= 300) & (w.arrivals < 420)
    return float(np.mean(r.ttft[after])), [rep.id for rep in sim.replicas if rep.draining]


def test_a_scale_down_drains_the_replica_whose_cache_the_traffic_misses_least():
    """Three replicas behind prefix-affine routing, twelve Zipf-popular 1024-token prefixes and caches of 8
    prefixes each; one replica is drained at 300 s. Over the same ten workloads, draining the replica holding
    the fewest tokens of recently used prefixes no one else holds costs the next two minutes' TTFT less than
    draining the newest (an arbitrary choice) or the one with the fewest recent cache hits."""
    ttft = {v: [_scale_down(v, seed)[0] for seed in range(10)] for v in ("newest", "cache_hits", "unique_recent")}
    assert all(len(_scale_down(v, 0)[1]) == 1 for v in ttft)
    assert np.mean(ttft["unique_recent"]) < np.mean(ttft["cache_hits"]) < np.mean(ttft["newest"])
    assert sum(u <= n for u, n in zip(ttft["unique_recent"], ttft["newest"], strict=True)) >= 8


def test_shared_prefixes_and_the_scale_down_victim_from_the_command_line(tmp_path, capsys):
    import json

    from inferd.cli import main

    out = tmp_path / "r.json"
    argv = ["simulate", "--profile", "example-cpu-gemma3-270m", "--trace", "poisson:rate=1.5,duration=120"]
    argv += ["--replicas", "3", "--shared-prefixes", "6:512", "--kv-cache-tokens", "4096", "--routing", "prefix"]
    argv += ["--victim", "unique_recent", "--scale-down-at", "60", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())["report"]
    assert report["finished"] == report["requests"] and report["cached_prompt_tokens"] > 0
    assert main([*argv[:-2], "--shared-prefixes", "six"]) == 2
    assert main([*argv[:-6], "--victim", "oldest"]) == 2
    assert "victim must be one of" in capsys.readouterr().err
