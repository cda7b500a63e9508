"""Autoscaled fleet vs a fleet sized for the peak, on a simulated 24-hour diurnal trace with bursts.

The simulator (`inferd.autoscale.sim`) runs the same workload twice with a replica profile: once with
a fixed fleet big enough for the trace's peak at the SLOs (sized by the planner's per-replica rate),
once with an autoscaling policy (`PoolAutoscaler`, the object `inferd up` runs) between 1 replica and
that peak size. It reports SLO attainment, TTFT, replica-hours and cost per million tokens for each;
JSON to benchmarks/results/autoscale.json and the plot to benchmarks/results/autoscale.png.

The price is an input (default $3.50 per replica-hour; set yours with --price-per-hour), and the default
profile (one L4 serving an 8B model) is a labelled example (`inferd/autoscale/profiles/`), not a
measurement: pass your own `inferd profile` output with --profile.

    python benchmarks/autoscale.py                 # 24 h, a few minutes
    python benchmarks/autoscale.py --hours 2       # a quick check
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from inferd.autoscale.plan import PlanInputs, max_rate_at_slo, saturation
from inferd.autoscale.plots import plot_runs
from inferd.autoscale.profile import load_profile
from inferd.autoscale.sim import SLO, simulate
from inferd.autoscale.workload import make_workload
from inferd.fleet.spec import AutoscalingPolicy

RESULTS = Path(__file__).parent / "results"
KEYS = (
    "requests",
    "slo_attainment",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "tpot_p95_s",
    "itl_p95_s",
    "request_goodput",
    "replica_hours",
    "mean_replicas",
    "max_replicas",
    "cold_starts",
    "cost",
    "cost_per_million_tokens",
    "cost_per_million_output_tokens",
    "goodput_cost_per_million_tokens",
)


def peak_rate(arrivals: np.ndarray, bin_s: float = 300.0) -> float:
    counts = np.bincount((arrivals // bin_s).astype(int))
    return float(counts.max()) / bin_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="example-l4-llama3-8b")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--mean-rate", type=float, default=3.0, help="requests/s averaged over the day")
    ap.add_argument("--peak-to-trough", type=float, default=5.0)
    ap.add_argument("--bursts", type=int, default=6, help="bursts of --burst-x the rate, 10 minutes each")
    ap.add_argument("--burst-x", type=float, default=2.5)
    ap.add_argument("--prompt-len", default="lognormal:512:0.8")
    ap.add_argument("--output-len", default="lognormal:160:0.8")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds, per request and as p95")
    ap.add_argument("--tpot-slo", type=float, default=0.2, help="seconds, per request")
    ap.add_argument("--price-per-hour", type=float, default=3.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "autoscale.json"))
    args = ap.parse_args()

    started = time.time()
    profile = load_profile(args.profile)
    duration = args.hours * 3600
    trace = (
        f"diurnal:mean={args.mean_rate},peak_to_trough={args.peak_to_trough},duration={duration},"
        f"bursts={args.bursts},burst_x={args.burst_x},burst_s=600,period=86400"
    )
    workload = make_workload(trace, args.prompt_len, args.output_len, args.seed)
    slo = SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, ttft_p95_s=args.ttft_slo)
    # what one replica carries within the TTFT SLO (TPOT is judged per request in the runs below)
    inputs = PlanInputs(1.0, SLO(ttft_p95_s=args.ttft_slo), args.price_per_hour, args.prompt_len, args.output_len)
    r_sat = saturation(profile, inputs)["request_throughput"]
    per_replica, _ = max_rate_at_slo(profile, inputs, r_sat)
    peak = peak_rate(workload.arrivals)
    n_peak = max(1, math.ceil(peak / per_replica))
    policy = AutoscalingPolicy(
        min_replicas=1,
        max_replicas=n_peak,
        targets={"request_rate": 0.8 * per_replica, "waiting": 4, "kv_cache_usage": None},
        interval_s=15,
        window_s=60,
        scale_up_stabilization_s=0,
        scale_down_stabilization_s=300,
        max_scale_up_step=4,
        max_scale_down_step=1,
        cooldown_s=120,
    )
    fixed = simulate(profile, workload, None, n_peak, slo, args.price_per_hour, timeline_s=60)
    auto = simulate(profile, workload, policy, 1, slo, args.price_per_hour)
    runs = {"fixed": {k: fixed.report.get(k) for k in KEYS}, "autoscaled": {k: auto.report.get(k) for k in KEYS}}
    out = {
        "what": "simulated 24-hour diurnal trace with bursts: a fleet sized for the peak vs the autoscaled fleet",
        "profile": {"name": profile.name, "description": profile.description, "source": profile.source},
        "workload": {
            "trace": trace,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "requests": len(workload),
            "peak_rate_5min": peak,
        },
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "price_per_hour": args.price_per_hour,
        "per_replica": {"saturation_request_rate": r_sat, "request_rate_at_ttft_slo": per_replica},
        "policy": policy.model_dump(),
        "runs": runs,
        "autoscaled_vs_fixed": {
            "replica_hours_ratio": auto.report["replica_hours"] / fixed.report["replica_hours"],
            "cost_per_million_tokens_ratio": auto.report["cost_per_million_tokens"]
            / fixed.report["cost_per_million_tokens"],
            "slo_attainment_delta": auto.report["slo_attainment"] - fixed.report["slo_attainment"],
        },
        "command": "python benchmarks/autoscale.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in [("profile", args.profile), ("hours", args.hours), ("mean_rate", args.mean_rate)]
        ),
        "wall_s": round(time.time() - started, 1),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    plot_runs(
        {f"fixed ({n_peak})": fixed.timeline, "autoscaled": auto.timeline}, path.with_suffix(".png"), args.ttft_slo
    )
    for name, r in runs.items():
        print(
            f"{name:>10}: SLO attainment {r['slo_attainment']:.3f}, TTFT p95 {r['ttft_p95_s']:.3f}s, "
            f"replica-hours {r['replica_hours']:.1f} (max {r['max_replicas']}), "
            f"${r['cost_per_million_tokens']:.4f}/M tokens, ${r['goodput_cost_per_million_tokens']:.4f}/M at SLO"
        )
    print(f"wrote {path} and {path.with_suffix('.png')} in {out['wall_s']}s")


if __name__ == "__main__":
    main()
