"""The simulator against a real `inferd up` run on this machine: TTFT p50/p95 and throughput (target: 20 %).

1. `inferd up` a fleet of one replica (fixed, no autoscaling) of --model;
2. `inferd profile` that replica through the gateway (prefill rate, decode step by batch size up to
   --max-num-seqs, per-request overhead including the gateway's hop);
3. `inferd bench` through the gateway: --num-prompts requests, Poisson at --rate (default: --load x the
   capacity the profile gives for this workload, 0.7 by default: above capacity the queue grows without
   bound, and TTFT then measures how long the run lasted more than the model's fidelity), fixed lengths;
4. `inferd simulate` the same arrival times (the bench's own schedule, same seed) and lengths with the
   measured profile; compare. Steps 3-4 --runs times (seeds seed, seed+1, ...): one run's TTFT p95 is
   its 10th-worst request of 200, and moves a lot with where the Poisson bursts fall; the JSON holds the
   medians and every run (benchmarks/results/autoscale_validation.json).

    python benchmarks/autoscale_validate.py --model gemma3-270m --num-prompts 200          # rate: 0.7 x capacity
    python benchmarks/autoscale_validate.py --model gemma3-270m --rate 1.5 --num-prompts 200
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find benchmarks.common
from benchmarks.common import write_json  # noqa: E402
from inferd.autoscale.measure import ProfileRun, StepRecorder, measure_profile
from inferd.autoscale.sim import simulate
from inferd.autoscale.workload import Workload
from inferd.bench.client import ClientConfig
from inferd.bench.datasets import RandomDataset
from inferd.bench.runner import BenchConfig, preflight, run_benchmark
from inferd.bench.tokenizers import resolve_tokenizer
from inferd.measure.arrivals import inter_arrival_times
from inferd.measure.stats import percentile
from inferd.procs import free_port

RESULTS = Path(__file__).parent / "results"
FLEET = """\
models:
  - name: m
    model: {model}
    engine: {engine}
    pools:
      - name: m-both
        replicas: 1
"""


def wait_replica(state: Path, gateway: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    listing = state / "m-both.replicas"
    while time.monotonic() < deadline:
        urls = listing.read_text().split() if listing.exists() else []
        if urls:
            try:
                if httpx.get(gateway + "/health", timeout=2).status_code == 200:
                    return urls[0]
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise RuntimeError("the replica did not become ready")


def step_summary(steps: list[dict], profile) -> dict:
    """The replica's steps during the bench against the profile's model of a step (decode step by batch
    size + prompt tokens / prefill rate), mixed steps apart; and the gaps between steps (the server's
    own time per step, outside the engine)."""
    st = steps
    if len(st) < 10:
        return {"steps": len(st)}
    dur = np.array([s["dur"] for s in st])
    p = np.array([s["p"] for s in st], dtype=float)
    d = np.array([s["d"] for s in st], dtype=float)
    (a, b, c), *_ = np.linalg.lstsq(np.stack([np.ones_like(p), d, p], 1), dur, rcond=None)
    start = np.array([s["ts"] for s in st]) - dur
    gaps = start[1:] - np.array([s["ts"] for s in st])[:-1]
    busy = gaps[gaps < 0.5]  # a step that followed another (longer gaps: the replica was idle)
    n = np.array([s["n"] for s in st], dtype=float)
    model = np.array([profile.step_s(max(1, int(k))) for k in d + n]) + p / profile.prefill_tokens_per_s
    mixed = p > 0
    return {
        "steps": len(st),
        "fit_s": {"base": a, "per_decode": b, "per_prefill_token": c},
        "fit_prefill_tokens_per_s": 1 / c if c > 0 else None,
        "decode_only_step_s_median": float(np.median(dur[~mixed])) if (~mixed).any() else None,
        "mixed_step_s_median": float(np.median(dur[mixed])) if mixed.any() else None,
        "mixed_prefill_tokens_median": float(np.median(p[mixed])) if mixed.any() else None,
        "gap_between_steps_s_median": float(np.median(busy)) if busy.size else None,
        "profile_over_real_decode_only": float(model[~mixed].sum() / dur[~mixed].sum()) if (~mixed).any() else None,
        "profile_over_real_mixed": float(model[mixed].sum() / dur[mixed].sum()) if mixed.any() else None,
    }


def per_request(real, planned: np.ndarray, sim_ttft: np.ndarray) -> dict:
    """Each request in arrival order: planned and actual send time, real and simulated TTFT."""
    from inferd.bench.results import detailed_lists

    lists = detailed_lists(real.outputs, real.timings, real.start)
    order = np.argsort(lists["start_times"], kind="stable")
    return {
        "planned_s": [float(x) for x in planned],
        "sent_s": [float(lists["start_times"][i]) for i in order],
        "ttft_real_s": [float(lists["ttfts"][i]) for i in order],
        "ttft_sim_s": [float(x) for x in sim_ttft],
    }


def request_summary(r: dict) -> dict:
    """Where real and simulated TTFTs part: how late the client sent, and the TTFT gap by quantile."""
    lag = np.array(r["sent_s"]) - np.array(r["planned_s"])
    real, sim = np.array(r["ttft_real_s"]), np.array(r["ttft_sim_s"])
    worst = np.argsort(real - sim)[-5:][::-1]
    return {
        "send_lag_s": {"p50": percentile(lag, 50), "p95": percentile(lag, 95), "max": float(lag.max())},
        "ttft_real_minus_sim_s": {q: percentile(real - sim, int(q[1:])) for q in ("p5", "p50", "p95")},
        "worst": [{"i": int(i), "real": float(real[i]), "sim": float(sim[i])} for i in worst],
    }


def refit_profile(profile, steps: list[dict]):
    """The profile with its decode steps (median of the decode-only steps at each batch size measured) and
    its prefill rate (`fit_prefill_rate`) taken from `steps` instead; what `steps` cannot tell stays."""
    import dataclasses

    from inferd.autoscale.measure import decode_step_s, fit_prefill_rate

    pairs = zip(profile.decode_batch, profile.decode_step_s, strict=True)
    decode = [decode_step_s(steps, b) or old for b, old in pairs]
    refit = dataclasses.replace(profile, decode_step_s=decode)
    rate = fit_prefill_rate(steps, refit.step_s)
    return dataclasses.replace(refit, prefill_tokens_per_s=rate) if rate else refit


def rel(sim: float, real: float) -> float:
    return abs(sim - real) / real if real else float("inf")


def saturated_throughput(profile, args) -> float:
    """Requests/s one replica finishes with every request queued at once: the capacity for this workload."""
    n = 4 * args.max_num_seqs
    burst = Workload(np.zeros(n), np.full(n, args.input_len), np.full(n, args.output_len))
    return simulate(profile, burst, replicas=1).report["request_throughput"]


def headline(result: dict) -> str:
    """The result in one sentence, out of sample first: the profile measured before the runs is what a user
    planning with `inferd profile` has, while the profile refitted from a run's own steps has seen the run it
    predicts (the simulator's model apart from the machine's drift). README and docs/autoscaling.md quote it."""

    def off(part: str, key: str) -> str:
        return f"{result[part][key]['relative_error']:.0%}"

    return (
        f"out of sample (simulated from the profile measured before the runs): TTFT p50 "
        f"{off('compare', 'ttft_p50_s')} and p95 {off('compare', 'ttft_p95_s')} off, throughput "
        f"{off('compare', 'request_throughput')} off; in sample (the profile refitted from each run's own steps): "
        f"TTFT p50 {off('compare_refit', 'ttft_p50_s')} and p95 {off('compare_refit', 'ttft_p95_s')} off"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: --load x the capacity)")
    ap.add_argument("--load", type=float, default=0.7, help="offered load as a share of the simulated capacity")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3, help="bench runs (seeds seed, seed+1, ...) against one profile")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default="{}", help='more engine settings, JSON, e.g. {"attention_backend": "torch"}')
    ap.add_argument("--out", default=str(RESULTS / "autoscale_validation.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="inferd-validate-"))
    config = work / "fleet.yaml"
    engine = {"max_num_seqs": args.max_num_seqs, "num_threads": args.threads} | json.loads(args.engine)
    config.write_text(FLEET.format(model=args.model, engine=json.dumps(engine)))
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "up", "--config", str(config), "--port", str(port)]
    argv += ["--state-dir", str(work / "state"), "--status-every", "30"]
    up = subprocess.Popen(argv, stdout=(work / "up.log").open("wb"), stderr=subprocess.STDOUT)
    gateway = f"http://127.0.0.1:{port}"
    runs = []
    try:
        replica = wait_replica(work / "state", gateway)
        batches = tuple(b for b in (1, 2, 4, 8, 16, 32) if b <= args.max_num_seqs)
        lens = (max(16, args.input_len // 4), args.input_len, args.input_len * 2)
        # measured through the gateway, as the bench runs: its hop is part of every request's overhead
        run = ProfileRun(gateway, "m", lens, batches, 32, 6, args.max_num_seqs, 0.0, "validate", tokenizer_url=replica)
        profile = measure_profile(run)  # its prompts come from other seeds than the bench's
        capacity = saturated_throughput(profile, args)
        rate = args.rate if args.rate is not None else args.load * capacity
        for i in range(args.runs):
            runs.append(one_run(args, args.seed + i, rate, profile, gateway, replica, work))
            print(json.dumps({k: round(v["relative_error"], 3) for k, v in runs[-1]["compare"].items()}), flush=True)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    compare = {}
    for k in runs[0]["compare"]:
        sims, reals = [r["compare"][k]["sim"] for r in runs], [r["compare"][k]["real"] for r in runs]
        errors = [r["compare"][k]["relative_error"] for r in runs]
        compare[k] = {"sim": float(np.median(sims)), "real": float(np.median(reals))}
        compare[k]["relative_error"] = float(np.median(errors))
    refit = {}
    for k in runs[0]["compare_refit"]:
        sims, reals = [r["compare_refit"][k]["sim"] for r in runs], [r["compare_refit"][k]["real"] for r in runs]
        refit[k] = {"sim": float(np.median(sims)), "real": float(np.median(reals))}
        refit[k]["relative_error"] = float(np.median([r["compare_refit"][k]["relative_error"] for r in runs]))
    out = {
        "what": "inferd simulate vs a real inferd up run (one replica) on the same arrivals and lengths",
        "args": vars(args),
        "rate": rate,
        "simulated_capacity_rps": capacity,
        "offered_load": rate / capacity,
        "profile": json.loads(profile.to_json()),
        "compare": compare,  # medians over the runs; each run's below
        "within_20_percent": all(v["relative_error"] <= 0.2 for v in compare.values()),
        "compare_refit": refit,  # the same, simulated with each run's profile refitted from its own steps
        "runs": runs,
    }
    out["headline"] = headline(out)
    path = write_json(Path(args.out), out)
    print(f"medians of {len(runs)} runs, {out['headline']}")
    print(f"medians of {len(runs)} runs:")
    for k, v in out["compare"].items():
        print(f"{k:>20}: sim {v['sim']:.4f}  real {v['real']:.4f}  ({v['relative_error']:.0%} off)")
    print("simulated with the profile refitted from each run's own steps:")
    for k, v in out["compare_refit"].items():
        print(f"{k:>20}: sim {v['sim']:.4f}  real {v['real']:.4f}  ({v['relative_error']:.0%} off)")
    print(f"wrote {path} (every step and request: {work})")


def one_run(args, seed: int, rate: float, profile, gateway: str, replica: str, work: Path) -> dict:
    """One bench run at `rate` with `seed` (its Poisson schedule and its prompts), and its simulation."""
    server = preflight(gateway, None)
    tok = resolve_tokenizer("auto", replica, "m", None, None)  # the gateway has no /tokenize
    client = ClientConfig(base_url=gateway, model="m", ignore_eos=True)
    cfg = BenchConfig(client=client, num_prompts=args.num_prompts, request_rate=rate, seed=seed)
    recorder = StepRecorder(replica + "/dashboard/events")
    real = run_benchmark(cfg, RandomDataset(tok, args.input_len, args.output_len, seed=seed), tok, server)[0]
    steps = recorder.stop()
    # the bench's own schedule for its first level (seed + 0), the same lengths
    t = np.cumsum(inter_arrival_times(args.num_prompts, rate, 1.0, np.random.default_rng(seed)))
    n = args.num_prompts
    simulated = simulate(profile, Workload(t, np.full(n, args.input_len), np.full(n, args.output_len)), replicas=1)
    sim, s = simulated.report, real.summary
    compare = {
        "ttft_p50_s": (sim["ttft_p50_s"], s["median_ttft_ms"] / 1000),
        "ttft_p95_s": (sim["ttft_p95_s"], s["p95_ttft_ms"] / 1000),
        "request_throughput": (sim["request_throughput"], s["request_throughput"]),
        "output_throughput": (sim["output_token_throughput"], s["output_throughput"]),
    }
    # the same simulation with the profile refitted from this run's own steps: the simulator's model apart
    # from how far the machine's speed moved between the profile and the run (a shared VM's does)
    refit = refit_profile(profile, steps)
    resim = simulate(refit, Workload(t, np.full(n, args.input_len), np.full(n, args.output_len)), replicas=1).report
    refit_compare = {
        "ttft_p50_s": (resim["ttft_p50_s"], s["median_ttft_ms"] / 1000),
        "ttft_p95_s": (resim["ttft_p95_s"], s["p95_ttft_ms"] / 1000),
        "request_throughput": (resim["request_throughput"], s["request_throughput"]),
    }
    requests = per_request(real, t, simulated.ttft)
    (work / f"steps-{seed}.json").write_text(json.dumps(steps))
    (work / f"requests-{seed}.json").write_text(json.dumps(requests))
    return {
        "seed": seed,
        "compare": {k: {"sim": a, "real": b, "relative_error": rel(a, b)} for k, (a, b) in compare.items()},
        "refit_profile": {"prefill_tokens_per_s": refit.prefill_tokens_per_s, "decode_step_s": refit.decode_step_s},
        "compare_refit": {k: {"sim": a, "real": b, "relative_error": rel(a, b)} for k, (a, b) in refit_compare.items()},
        "replica_steps": step_summary(steps, profile),
        "requests": request_summary(requests),
    }


if __name__ == "__main__":
    main()
