"""SLOs under overload: interactive requests' TTFT when a replica gets more than it can serve, per scheduling policy.

One `inferd serve` replica of the default model at a time, started with `--scheduling-policy fcfs`, `priority`
or `deadline` (policies alternated, `--rounds` rounds). First its capacity is measured: a burst of the mixed
workload with every request at once, completed requests per second. Then Poisson arrivals at `--overload`
times that rate for `--duration` seconds, two classes:

- interactive (`--interactive-share`, 20%): a short question, 32 output tokens; priority 0, TTFT deadline
  `--slo-ms` (its SLO);
- batch (the rest): a long document, 128 output tokens; priority 10, TTFT deadline 60 s.

fcfs serves them in arrival order; priority admits interactive first and preempts batch for it; deadline
orders by deadline. Reported per policy: the interactive class's TTFT p50/p99 and the share within the SLO,
the batch class's TTFT p50, total output tok/s (throughput lost to the SLO), the replica's preemptions and
requests that failed. Percentiles from `inferd.measure.stats`.

    python benchmarks/slo.py            # ~10 min on 2 cores; writes benchmarks/results/slo-<CPU kind>.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import record_run  # noqa: E402
from inferd.config import DEFAULT_MODEL  # noqa: E402
from inferd.measure.arrivals import arrival_offsets  # noqa: E402
from inferd.measure.stats import percentile  # noqa: E402
from inferd.procs import metrics, start_serve, wait_http  # noqa: E402

POLICIES = ("fcfs", "priority", "deadline")
WORDS = [
    "the",
    "of",
    "a",
    "cache",
    "block",
    "token",
    "prefill",
    "decode",
    "batch",
    "queue",
    "latency",
    "replica",
    "model",
    "serve",
    "request",
]


def make_request(rng: random.Random, interactive: bool, slo_ms: float) -> dict:
    words = 24 if interactive else 320
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"model": "m", "prompt": text, "max_tokens": 32 if interactive else 128, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    return body | {"_interactive": interactive, "_slo_ms": slo_ms}


def scheduled(body: dict, policy: str) -> dict:
    """The request as sent to a replica running `policy`: its class's priority or deadline."""
    out = {k: v for k, v in body.items() if not k.startswith("_")}
    if policy == "priority":
        out["priority"] = 0 if body["_interactive"] else 10
    elif policy == "deadline":
        out["ttft_deadline_ms"] = body["_slo_ms"] if body["_interactive"] else 60000
    return out


async def one(client: httpx.AsyncClient, url: str, body: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    t = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if first is None:
                        first = time.perf_counter() - t
                    tokens += 1
    except httpx.HTTPError:
        return {"ok": False}
    return {"ok": first is not None, "ttft": first, "end": time.perf_counter(), "tokens": tokens}


async def drive(url: str, bodies: list[dict], offsets: np.ndarray, policy: str) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one(client, url, scheduled(b, policy), float(o)) for b, o in zip(bodies, offsets, strict=True))
        )
    return list(results), start


def capacity(url: str, bodies: list[dict]) -> float:
    """Completed requests per second with the whole burst sent at once."""
    t = time.perf_counter()
    results, _ = asyncio.run(drive(url, bodies, np.zeros(len(bodies)), "fcfs"))
    return sum(r["ok"] for r in results) / (time.perf_counter() - t)


def summarize(bodies: list[dict], results: list[dict], start: float, slo_ms: float) -> dict:
    inter = [r["ttft"] * 1000 for b, r in zip(bodies, results, strict=True) if b["_interactive"] and r["ok"]]
    batch = [r["ttft"] * 1000 for b, r in zip(bodies, results, strict=True) if not b["_interactive"] and r["ok"]]
    done = [r for r in results if r["ok"]]
    span = max(r["end"] for r in done) - start
    return {
        "requests": len(results),
        "failed": len(results) - len(done),
        "interactive_ttft_p50_ms": percentile(inter, 50),
        "interactive_ttft_p99_ms": percentile(inter, 99),
        "interactive_within_slo": sum(t <= slo_ms for t in inter) / len(inter) if inter else None,
        "batch_ttft_p50_ms": percentile(batch, 50),
        "output_tokens_per_s": sum(r["tokens"] for r in done) / span,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--overload", type=float, default=1.5, help="arrival rate / measured capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--interactive-share", type=float, default=0.2)
    p.add_argument("--slo-ms", type=float, default=1000.0, help="the interactive class's TTFT SLO")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="inferd-slo-"))
    rng = random.Random(0)
    burst = [make_request(rng, rng.random() < args.interactive_share, args.slo_ms) for _ in range(48)]
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    cap = None
    for round_ in range(args.rounds):
        for policy in POLICIES:
            proc = start_serve(args.model, logs, "m", "--scheduling-policy", policy, "--max-num-seqs",
                               str(args.max_num_seqs), "--num-threads", "2")  # fmt: skip
            try:
                wait_http(proc, "/health", timeout=900)
                if cap is None:
                    cap = capacity(proc.url, burst)
                    print(f"capacity: {cap:.2f} requests/s", flush=True)
                rate = args.overload * cap
                n = int(rate * args.duration)
                wrng = random.Random(100 + round_)
                bodies = [make_request(wrng, wrng.random() < args.interactive_share, args.slo_ms) for _ in range(n)]
                offsets = arrival_offsets(n, rate, seed=100 + round_)
                before = metrics(proc.url).get("inferd:num_preemptions_total", 0.0)
                results, start = asyncio.run(drive(proc.url, bodies, offsets, policy))
                got = summarize(bodies, results, start, args.slo_ms)
                got["preemptions"] = metrics(proc.url).get("inferd:num_preemptions_total", 0.0) - before
                runs[policy].append(got)
                print(policy, got, flush=True)
            finally:
                proc.stop()

    def median(policy: str, key: str):
        values = [r[key] for r in runs[policy] if r[key] is not None]
        return statistics.median(values) if values else None

    keys = list(next(iter(runs.values()))[0])
    result = {
        "benchmark": "slo",
        "model": args.model,
        "settings": vars(args),
        "capacity_requests_per_s": cap,
        "policies": {p: {"median": {k: median(p, k) for k in keys}, "runs": runs[p]} for p in POLICIES},
    }
    fcfs = result["policies"]["fcfs"]["median"]["output_tokens_per_s"]
    for p in POLICIES:
        m = result["policies"][p]["median"]
        m["throughput_vs_fcfs"] = m["output_tokens_per_s"] / fcfs if fcfs else None
    print(record_run("slo", result, sys.argv, args.out, started=started))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
