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
requests that failed, and where the slowest interactive requests' time went (the engine's `usage.timing`: queue,
prefill, preemptions; the rest of the TTFT is the server's HTTP and tokenizer work). Percentiles from
`inferd.measure.stats`.

    python benchmarks/slo.py            # ~10 min on 2 cores; writes benchmarks/results/slo-<CPU kind>.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import record_run  # noqa: E402
from inferd.bench.client import RequestOutput, send_all  # noqa: E402
from inferd.bench.datasets import BenchRequest  # noqa: E402
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


def make_request(rng: random.Random, interactive: bool) -> BenchRequest:
    words = 24 if interactive else 320
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return BenchRequest(text, prompt_len=words, output_len=32 if interactive else 128)  # prompt_len: words


def scheduled(req: BenchRequest, interactive: bool, policy: str, slo_ms: float) -> BenchRequest:
    """The request as sent to a replica running `policy`: its class's priority or deadline, and the engine's
    timing breakdown in its usage."""
    extra = {"return_timing": True}
    if policy == "priority":
        extra["priority"] = 0 if interactive else 10
    if policy == "deadline":
        extra["ttft_deadline_ms"] = slo_ms if interactive else 60000
    return replace(req, extra_body=extra)


def capacity(url: str, requests: list[BenchRequest]) -> float:
    """Completed requests per second with the whole burst sent at once."""
    t = time.perf_counter()
    outs = send_all(url, requests)
    return sum(o.success for o in outs) / (time.perf_counter() - t)


def summarize(classes: list[bool], outs: list[RequestOutput], slo_ms: float) -> dict:
    """The run's figures from its outputs (`classes`: whether each request is interactive)."""
    ttft = lambda o: (o.chunk_times[0] - o.send_time) * 1000
    ok = [(c, o) for c, o in zip(classes, outs, strict=True) if o.success and o.chunk_times]
    inter = [ttft(o) for c, o in ok if c]
    batch = [ttft(o) for c, o in ok if not c]
    slowest = sorted((o for c, o in ok if c), key=ttft, reverse=True)[:3]
    span = max(o.end_time for _, o in ok) - min(o.send_time for o in outs)
    return {
        "requests": len(outs),
        "failed": len(outs) - len(ok),
        "interactive_ttft_p50_ms": percentile(inter, 50),
        "interactive_ttft_p99_ms": percentile(inter, 99),
        "interactive_within_slo": sum(t <= slo_ms for t in inter) / len(inter) if inter else None,
        "batch_ttft_p50_ms": percentile(batch, 50),
        "output_tokens_per_s": sum(o.usage_completion_tokens or 0 for _, o in ok) / span,
        # the engine's account of the slowest interactive requests: what of their TTFT was queue, prefill, preemption
        "slowest_interactive": [{"ttft_ms": round(ttft(o), 1), **_timing(o.usage_timing)} for o in slowest],
    }


def _timing(t: dict | None) -> dict:
    keys = ("queue_ms", "prefill_ms", "ttft_ms", "prefill_chunks", "preemptions")
    return {k: t[k] for k in keys if k in t} if t else {}


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
    burst = [make_request(rng, rng.random() < args.interactive_share) for _ in range(48)]
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
                classes, requests = [], []
                for _ in range(n):  # each request's class drawn just before its text
                    classes.append(wrng.random() < args.interactive_share)
                    requests.append(scheduled(make_request(wrng, classes[-1]), classes[-1], policy, args.slo_ms))
                offsets = arrival_offsets(n, rate, seed=100 + round_)
                before = metrics(proc.url).get("inferd:num_preemptions_total", 0.0)
                got = summarize(classes, send_all(proc.url, requests, at=list(offsets)), args.slo_ms)
                got["preemptions"] = metrics(proc.url).get("inferd:num_preemptions_total", 0.0) - before
                runs[policy].append(got)
                print(policy, got, flush=True)
            finally:
                proc.stop()

    def median(policy: str, key: str):
        values = [r[key] for r in runs[policy] if r[key] is not None]
        return statistics.median(values) if values else None

    keys = [k for k, v in next(iter(runs.values()))[0].items() if not isinstance(v, list)]  # the figures
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
