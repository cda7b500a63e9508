"""The platform labs (disaggregated prefill/decode, NVIDIA Dynamo, inference-aware autoscaling), beyond what
tests/labs/test_labs.py checks for every lab: their invariants on the numbers of the session's `lab all
--quick` run, the simulator's utilisation signal the autoscaling lab compares against, and that the labs
which start processes leave none behind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferd.autoscale.profile import Profile
from inferd.autoscale.signals import Measured
from inferd.autoscale.sim import Simulator
from inferd.autoscale.workload import make_workload
from inferd.fleet.spec import AutoscalingPolicy
from inferd.labs.runner import LabResult
from tests.labs.conftest import inferd_children

pytestmark = pytest.mark.timeout(900)


def _result(lab_run, name: str) -> LabResult:
    return LabResult.from_dict(json.loads((lab_run["out"] / f"{name}.json").read_text()))


class _Recording(Simulator):
    """Records the utilisation signal at every decision (and scales on nothing else)."""

    seen: list

    def measure(self) -> Measured:
        self.seen = getattr(self, "seen", [])
        self.seen.append((self.utilization(), len(self._serving())))
        return Measured(running=0.0)


def _utilisations(rate: float, output: str) -> list[tuple[float, int]]:
    profile = Profile("t", 1e6, [1, 8], [0.01, 0.02], 8, cold_start_s=0.0)
    policy = AutoscalingPolicy(min_replicas=2, max_replicas=2, targets={"running": 1.0}, interval_s=5, window_s=10)
    sim = _Recording(profile, make_workload(f"poisson:rate={rate},duration=300", "fixed:8", output, 0), policy, 2)
    sim.run()
    return sim.seen[3:-3]  # past the first window, before the queue drains


def test_utilisation_is_each_replicas_busy_share_and_saturates_at_one():
    # saturated: far more work than two replicas do, so both step all the time
    busy = _utilisations(rate=200.0, output="fixed:50")
    assert all(ready == 2 for _, ready in busy)
    assert np.median([u for u, _ in busy]) == pytest.approx(2.0, abs=0.02)
    assert all(0.0 <= u <= 2.0 + 1e-9 for u, _ in busy)
    # a trickle: one 5-step request (0.05 s) every 2 s on average, about 2.5% of one replica
    light = [u for u, _ in _utilisations(rate=0.5, output="fixed:5")]
    assert 0.0 < np.mean(light) < 0.06


def test_autoscaling_lab_compares_the_two_policies_on_one_trace(lab_run):
    r = _result(lab_run, "inference-aware-autoscaling")
    n = r.numbers
    assert n["unfinished"] == 0 and n["requests"] > 1000
    assert set(r.series) == {"util", "queue"}
    assert r.series["util"]["arrival_rate"] == r.series["queue"]["arrival_rate"]  # the same trace
    for name in ("util", "queue"):
        assert 1 <= n[f"{name}_mean_replicas"] <= n[f"{name}_max_replicas"] <= n["max_allowed"]
        assert n[f"{name}_usd_per_m"] > 0 and 0 <= n[f"{name}_slo_pct"] <= 100
    assert "example-cpu-gemma3-270m" in r.text and "compressed" in r.text  # --quick says what it simulated
    assert f"${n['queue_usd_per_m']:.2f}" in r.text


def test_disaggregated_lab_reports_the_handoff_and_both_setups(lab_run):
    n = _result(lab_run, "disaggregated-prefill-decode").numbers
    for setup in ("colo", "dis"):
        assert n[f"{setup}_shorts"] > 5 and n[f"{setup}_longs"] >= 2  # a failed request fails the lab
        assert 0 < n[f"{setup}_itl_p50_ms"] <= n[f"{setup}_itl_p99_ms"] <= n[f"{setup}_itl_max_ms"]
    assert n["remote_prefills"] >= n["dis_longs"] and n["kv_blocks"] > 0  # the long prompts were handed over
    assert n["bytes_per_block"] == n["expected_bytes_per_block"] and n["leases_left"] == 0


def test_dynamo_lab_routes_over_two_disaggregated_workers(lab_run):
    n = _result(lab_run, "nvidia-dynamo").numbers
    assert n["rr_requests"] == n["pa_requests"] == n["prefixes"] * n["users"]
    assert n["rr_remote"] + n["rr_local"] == n["rr_requests"] and n["pa_remote"] + n["pa_local"] == n["pa_requests"]
    assert n["rr_remote"] + n["pa_remote"] > 0 and n["rr_kb_per_req"] > 0 and n["leases_left"] == 0
    assert 50 <= n["rr_busiest_pct"] <= 100 and 50 <= n["pa_busiest_pct"] <= 100


def test_the_process_labs_leave_no_process_behind(lab_run):
    # other tests' session fixtures (the gateway tests' replicas) may be children of this process too
    assert set(inferd_children()) - lab_run["children_before"] == set()


def test_a_failing_lab_still_stops_its_processes(tmp_path, monkeypatch):
    """The disaggregated lab dies in the middle of its run: every process it started is gone afterwards."""
    from inferd.labs import disaggregated
    from inferd.labs.context import LabContext
    from inferd.models.tiny import tiny_model

    def boom(*args, **kwargs):
        raise RuntimeError("the client broke")

    monkeypatch.setattr(disaggregated, "_workload", boom)
    before = set(inferd_children())
    ctx = LabContext(quick=True, model=str(tiny_model()), out=tmp_path, workdir=tmp_path / "work")
    with pytest.raises(RuntimeError, match="the client broke"):
        disaggregated.measure(ctx)
    assert set(inferd_children()) - before == set()
    ctx.close()


@pytest.mark.parametrize("name", ["disaggregated-prefill-decode", "nvidia-dynamo", "inference-aware-autoscaling"])
def test_every_sentence_either_way_shows_its_numbers_and_is_true(lab_run, name):
    """Each claim's other branch (a machine where the numbers come out the other way) is well formed too:
    the numbers shaken at random, every explanation still passes the checker, except for the invariants the
    shaken numbers break, which it reports."""
    import random

    from inferd.labs import find_lab
    from inferd.labs.base import Measurement
    from inferd.labs.runner import check_result

    lab, result = find_lab(name), _result(lab_run, name)
    rng = random.Random(0)
    seen: set[tuple[str, str]] = set()
    for _ in range(60):
        numbers = {
            k: v * rng.choice([0.1, 0.5, 1.0, 2.0, 10.0]) + rng.choice([0.0, 0.0, 1.0])
            for k, v in result.numbers.items()
        }
        numbers["cores"] = rng.choice([1, 2, 4])
        explanation = lab.explain(Measurement(numbers=numbers, series=result.series, settings=result.settings))
        shaken = LabResult.from_dict({**result.to_dict(), "numbers": numbers, "claims": [], "text": ""})
        shaken.claims, shaken.text = explanation.claims, explanation.text("t")
        # shaken numbers may break an invariant (a leaked lease, an unfinished request): that claim is then
        # false and reported as broken, never told as if it held; every other sentence passes the checker
        broken = {c.text for c in shaken.claims if c.broken(numbers)}
        problems = check_result(shaken)
        assert all("invariant broken" in p and any(text in p for text in broken) for p in problems), problems
        assert len(problems) == len(broken)
        seen |= {(c.left, c.op) for c in explanation.claims}
    assert len(seen) > len(result.claims)  # both branches of several claims were told
