"""Cache-aware scale-down: TTFT of the traffic right after a replica is removed, the victim chosen by the gateway's
cache hit rates (what `inferd up` and the pod-deletion-cost annotation do) against a random victim.

Each trial starts a fresh fleet: three `inferd serve` replicas of the default model behind a gateway with the
default scorers (prefix affinity), then sends a warm-up of shared-prefix traffic (system prompts of `--prefix-tokens`,
Zipf-popular, a unique question each), so each replica's cache holds the prefixes routed to it and serves hits at a
rate that follows their popularity. Then one replica is stopped: in a cache-aware trial the first of
`inferd.runtime.up.drain_order` over the gateway's `inferd_gateway_replica_cache_hit_rate` (the fewest recent
hits); in a random trial, one drawn at random (seeded). The same traffic goes on, and the TTFT of the next
`--after` requests (and the share of their prompt tokens served from cache) is what a scale-down costs. Trials
alternate cache-aware and random, each pair with the same warm-up and traffic.

    python -m benchmarks.scale_down     # ~10 min on 2 cores; writes benchmarks/results/scale_down-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.bench.client import send_all
from inferd.bench.datasets import BenchRequest
from inferd.config import DEFAULT_MODEL
from inferd.measure.stats import percentile
from inferd.procs import gateway_config, start_gateway, start_serve, wait_http
from inferd.runtime.up import cache_hit_rates, drain_order


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
        with httpx.Client() as client:
            rates = cache_hit_rates(gateway.url, client)
        ranked = drain_order([SimpleNamespace(url=r.url, started=r.started) for r in reps], rates)
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
            "victim_hit_rate_rank": [s.url for s in ranked].index(victim),  # 0: the fewest recent hits
            "hit_rates_blocks_per_s": {str(i): round(rates.get(r.url, 0.0), 3) for i, r in enumerate(reps)},
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
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started = time.time()
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
