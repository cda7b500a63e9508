"""Cache-aware scale-down: TTFT of the traffic right after a replica is removed, the victim chosen by the gateway's
cache worth (what `inferd up` and the pod-deletion-cost annotation do) against a random victim; and the same in
the simulator (`--sim`), where many trials are cheap and every victim rule can be compared.

Each trial starts a fresh fleet: three `inferd serve` replicas of the default model behind a gateway with the
default scorers (prefix affinity), then sends a warm-up of shared-prefix traffic (system prompts of `--prefix-tokens`,
Zipf-popular, a unique question each), so each replica's cache holds the prefixes routed to it and serves hits at a
rate that follows their popularity. Then one replica is stopped: in a cache-aware trial the first of
`inferd.runtime.up.drain_order` over the gateway's `inferd_gateway_replica_cache_worth_tokens` (the fewest
tokens of recently asked prefixes that no other replica holds); in a random trial, one drawn at random
(seeded). The same traffic goes on, and the TTFT of the next `--after` requests (and the share of their prompt
tokens served from cache) is what a scale-down costs. Trials alternate cache-aware and random, each pair with
the same warm-up and traffic.

    python -m benchmarks.scale_down     # ~10 min on 2 cores; writes benchmarks/results/scale_down-<cpu kind>.json

With `--sim`: `inferd.autoscale.sim` with shared prefixes (`with_shared_prefixes`), prefix-affine routing and
LRU prefix caches, three replicas of the example CPU profile, one drained at half time; per victim rule (newest,
random, cache_hits, unique_recent) the mean and p95 TTFT of the two minutes after, over `--trials` workloads
(the same ones for every rule), for a few cache sizes and prefix counts. Seconds; writes
benchmarks/results/scale_down_sim.json (the simulator's numbers are not this machine's).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.autoscale.profile import load_profile
from inferd.autoscale.sim import VICTIMS, Simulator
from inferd.autoscale.workload import make_workload, with_shared_prefixes
from inferd.bench.client import send_all
from inferd.bench.datasets import BenchRequest
from inferd.config import DEFAULT_MODEL
from inferd.gateway.service import WORTH_INTERVAL_S
from inferd.measure.stats import percentile
from inferd.procs import gateway_config, start_gateway, start_serve, wait_http
from inferd.runtime.up import cache_worths, drain_order


def traffic(seed: int, prefixes: int, prefix_tokens: int, n: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    shared = [[rng.randrange(1000, 30000) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    weights = [1 / (k + 1) ** 1.2 for k in range(prefixes)]
    out = []
    for _ in range(n):
        prompt = shared[rng.choices(range(prefixes), weights)[0]] + [rng.randrange(1000, 30000) for _ in range(24)]
        out.append(BenchRequest(prompt, len(prompt), 8))
    return out


def trial(args, logs: Path, seed: int, victim_by: str) -> dict:
    flags = ["--num-blocks", str(args.num_blocks), "--max-model-len", "1024"]
    reps = [start_serve(args.model, logs, "m", *flags) for _ in range(3)]
    gateway = None
    try:
        for i, r in enumerate(reps):
            wait_http(r, "/health", timeout=900)  # the first start converts the GGUF
            r.started = i  # start order, for drain_order's tie-break (the newest first)
        cfg = gateway_config([r.url for r in reps])
        cfg["pools"][0]["tokenizer"] = "estimate"
        gateway = start_gateway(cfg, logs)
        time.sleep(1)
        requests = traffic(seed, args.prefixes, args.prefix_tokens, args.warm + args.after)
        warm = send_all(gateway.url, requests[: args.warm], concurrency=args.concurrency)
        assert all(o.success for o in warm), [o.error for o in warm if not o.success][:3]
        time.sleep(1)  # a scrape after the last request
        time.sleep(WORTH_INTERVAL_S)  # the gateway's cache worth covers the warm-up
        with httpx.Client() as client:
            worths = cache_worths(gateway.url, client)
        ranked = drain_order([SimpleNamespace(url=r.url, started=r.started) for r in reps], worths)
        drawn = random.Random(seed * 7919).choice(reps).url
        victim = ranked[0].url if victim_by == "cache_aware" else drawn
        victim_at = [r.url for r in reps].index(victim)
        reps[victim_at].stop()
        time.sleep(2)  # the gateway's health checks mark it down
        after = send_all(gateway.url, requests[args.warm :], concurrency=args.concurrency)
        ok = [o for o in after if o.success]
        ttfts = [o.chunk_times[0] - o.send_time for o in ok]
        prompt = sum(o.usage_prompt_tokens or 0 for o in ok)
        return {
            "seed": seed,
            "victim_by": victim_by,
            "victim_worth_rank": [s.url for s in ranked].index(victim),  # 0: the least cache worth
            "cache_worth_tokens": {str(i): worths.get(r.url, 0.0) for i, r in enumerate(reps)},
            "victim": str(victim_at),
            "failed": len(after) - len(ok),
            "ttft_mean_s": round(sum(ttfts) / len(ttfts), 3),
            "ttft_p50_s": round(percentile(ttfts, 50), 3),
            "ttft_p95_s": round(percentile(ttfts, 95), 3),
            "hit_rate_after": round(sum(o.usage_cached_tokens or 0 for o in ok) / prompt, 3),
        }
    finally:
        for proc in [gateway, *reps]:
            if proc is not None:
                proc.stop()


SIM_CASES = [  # (requests/s, shared prefixes, tokens each, cache tokens per replica)
    (1.5, 12, 1024, 8192),
    (1.0, 24, 1024, 16384),
    (2.0, 40, 1024, 16384),
    (1.5, 40, 512, 8192),
]


def simulated(trials: int) -> dict:
    """Each victim rule of the simulator over the same `trials` workloads per case: the TTFT of the requests
    arriving in the two minutes after the scale-down (mean over trials of their mean and p95)."""
    profile = load_profile("example-cpu-gemma3-270m")
    cases = []
    for rate, prefixes, tokens, cache in SIM_CASES:
        per: dict[str, dict[str, list[float]]] = {v: {"mean": [], "p95": []} for v in VICTIMS}
        for seed in range(trials):
            w = make_workload(f"poisson:rate={rate},duration=600", "uniform:16:64", "uniform:16:64", seed)
            w = with_shared_prefixes(w, prefixes, tokens, zipf=1.0, seed=seed)
            after = (w.arrivals >= 300) & (w.arrivals < 420)
            for victim in VICTIMS:
                sim = Simulator(profile, w, replicas=3, kv_cache_tokens=cache, routing="prefix", victim=victim,
                                scale_down_at=300.0, seed=seed)  # fmt: skip
                ttft = sim.run().ttft[after]
                per[victim]["mean"].append(float(ttft.mean()))
                per[victim]["p95"].append(percentile(ttft, 95))
        case = {"rate": rate, "prefixes": prefixes, "prefix_tokens": tokens, "cache_tokens": cache}
        for victim, got in per.items():
            case[victim] = {k: round(statistics.mean(v), 4) for k, v in got.items()}
            case[victim]["trials_at_or_below_random"] = sum(
                a <= b for a, b in zip(got["mean"], per["random"]["mean"], strict=True)
            )
        cases.append(case)
        print(case, flush=True)
    return {"profile": profile.name, "replicas": 3, "drained_at_s": 300, "measured_s": 120, "trials": trials,
            "cases": cases}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-blocks", type=int, default=192, help="KV blocks per replica")
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-tokens", type=int, default=384)
    p.add_argument("--warm", type=int, default=90, help="requests before the scale-down")
    p.add_argument("--after", type=int, default=60, help="requests after it, measured")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="trials per victim choice, alternated")
    p.add_argument("--sim", action="store_true", help="the simulator's comparison only (seconds)")
    p.add_argument("--trials", type=int, default=40, help="--sim: workloads per case")
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started = time.time()
    if args.sim:
        result = {"settings": vars(args), **simulated(args.trials)}
        print(record_run("scale_down", result, sys.argv, args.out or "scale_down_sim", started=started))
        return 0
    logs = Path(tempfile.mkdtemp(prefix="inferd-scale-down-"))
    trials = []
    for pair in range(args.pairs):
        for victim_by in ("cache_aware", "random"):
            trials.append(trial(args, logs, seed=pair + 1, victim_by=victim_by))
            print(trials[-1], flush=True)
    summary = {}
    for victim_by in ("cache_aware", "random"):
        ts = [t for t in trials if t["victim_by"] == victim_by]
        summary[victim_by] = {
            "ttft_mean_s": round(sum(t["ttft_mean_s"] for t in ts) / len(ts), 3),
            "ttft_p95_s_mean": round(sum(t["ttft_p95_s"] for t in ts) / len(ts), 3),
            "hit_rate_after": round(sum(t["hit_rate_after"] for t in ts) / len(ts), 3),
        }
    summary["random_ttft_vs_cache_aware"] = round(
        summary["random"]["ttft_mean_s"] / summary["cache_aware"]["ttft_mean_s"], 2
    )
    result = {"model": args.model, "settings": vars(args), "machine": machine(), "trials": trials, "summary": summary}
    print(record_run("scale_down", result, sys.argv, args.out, started=started))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
