"""Fair share at the gateway's wait queue: a tenant's flood against another tenant's TTFT, `in_flight` against `vtc`.

One `inferd serve` replica of the default model behind two gateways that differ only in `routing.queue.fairness`,
each with two tenants and the replica saturated at `--max-in-flight` requests (the rest wait at the gateway):

- flood: `--flood-requests` long requests (a document of `--flood-prompt` tokens, 32 out), `--flood-concurrency`
  at a time;
- interactive: `--interactive-requests` short ones (a question of 24 tokens, 32 out), 2 at a time, sent alongside.

Under `in_flight` a waiting request of the tenant with fewer requests in flight goes first; under `vtc` the
tenant served fewer tokens (virtual token counters). Reported per fairness: each tenant's TTFT p50/p95 and its
output tokens per second while both sent, and the interactive tenant's share of the completions in that window.
Phases alternate between the gateways, `--rounds` times; TTFTs are pooled over rounds.

    python -m benchmarks.fair_share     # ~6 min on 2 cores; writes benchmarks/results/fair_share-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.bench.client import RequestOutput, send_all
from inferd.bench.datasets import BenchRequest
from inferd.config import DEFAULT_MODEL
from inferd.measure.stats import percentile
from inferd.procs import gateway_config, start_gateway, start_serve, wait_http

KEYS = {"flood": "sk-flood", "interactive": "sk-interactive"}


def _requests(rng: random.Random, n: int, prompt_tokens: int) -> list[BenchRequest]:
    return [
        BenchRequest([rng.randrange(1000, 30000) for _ in range(prompt_tokens)], prompt_tokens, 32) for _ in range(n)
    ]


def phase(url: str, seed: int, args) -> dict[str, list[RequestOutput]]:
    rng = random.Random(seed)
    flood = _requests(rng, args.flood_requests, args.flood_prompt)
    interactive = _requests(rng, args.interactive_requests, 24)
    with ThreadPoolExecutor(2) as pool:
        f = pool.submit(send_all, url, flood, concurrency=args.flood_concurrency, api_key=KEYS["flood"])
        time.sleep(2)  # the flood fills the replica and the queue first
        i = pool.submit(send_all, url, interactive, concurrency=2, api_key=KEYS["interactive"])
        return {"flood": f.result(), "interactive": i.result()}


def _tokens(rows: list[RequestOutput]) -> int:
    return sum(o.usage_completion_tokens or 0 for o in rows)


def summarize(outs: dict[str, list[RequestOutput]], window: tuple[float, float]) -> dict:
    start, end = window
    out = {}
    done_in_window = {}
    for tenant, rows in outs.items():
        ok = [o for o in rows if o.success]
        ttfts = [o.chunk_times[0] - o.send_time for o in ok]
        inside = [o for o in ok if start <= o.end_time <= end]
        done_in_window[tenant] = len(inside)
        out[tenant] = {
            "failed": len(rows) - len(ok),
            "ttft_p50_s": round(percentile(ttfts, 50), 3),
            "ttft_p95_s": round(percentile(ttfts, 95), 3),
            "output_tok_per_s_while_both": round(
                sum(o.usage_completion_tokens or 0 for o in inside) / (end - start), 1
            ),
        }
    out["interactive_share_of_completions"] = round(
        done_in_window["interactive"] / max(sum(done_in_window.values()), 1), 3
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-in-flight", type=int, default=4, help="requests the gateway keeps on the replica")
    p.add_argument("--flood-requests", type=int, default=40)
    p.add_argument("--flood-prompt", type=int, default=256)
    p.add_argument("--flood-concurrency", type=int, default=16)
    p.add_argument("--interactive-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="inferd-fair-share-"))
    replica = start_serve(args.model, logs, "m", "--max-num-seqs", str(args.max_in_flight), "--max-model-len", "1024")
    gateways = {}
    try:
        wait_http(replica, "/health", timeout=900)
        tenants = [{"id": t, "api_key_sha256": [hashlib.sha256(k.encode()).hexdigest()]} for t, k in KEYS.items()]
        for fairness in ("in_flight", "vtc"):
            cfg = gateway_config([replica.url], tenants=tenants)
            cfg["pools"][0]["tokenizer"] = "estimate"
            cfg["routing"] = {"saturation": {"max_in_flight": args.max_in_flight},
                              "queue": {"fairness": fairness, "max_wait_s": 600}}  # fmt: skip
            cfg["request_timeout_s"] = 900
            gateways[fairness] = start_gateway(cfg, logs)
        pooled: dict[str, dict[str, list[RequestOutput]]] = {f: {"flood": [], "interactive": []} for f in gateways}
        phases: dict[str, list[dict]] = {f: [] for f in gateways}
        seed = 0
        for _ in range(args.rounds):
            for fairness, gw in gateways.items():
                seed += 1
                outs = phase(gw.url, seed, args)
                # both sent: from the interactive tenant's first request to the earlier of the two last answers
                start = min(o.send_time for o in outs["interactive"])
                end = min(max(o.end_time for o in outs[t]) for t in outs)
                phases[fairness].append(summarize(outs, (start, end)))
                print(fairness, phases[fairness][-1], flush=True)
                for t in outs:
                    pooled[fairness][t] += outs[t]
        results = {}
        for fairness, outs in pooled.items():
            results[fairness] = {"ttft_pooled": {}, "phases": phases[fairness]}
            for t, rows in outs.items():
                ttfts = [o.chunk_times[0] - o.send_time for o in rows if o.success]
                results[fairness]["ttft_pooled"][t] = {
                    "p50_s": round(percentile(ttfts, 50), 3), "p95_s": round(percentile(ttfts, 95), 3),
                }  # fmt: skip
        result = {"model": args.model, "settings": vars(args), "machine": machine(), "fairness": results}
        print(record_run("fair_share", result, sys.argv, args.out, started=started))
        print(results)
        return 0
    finally:
        for proc in [*gateways.values(), replica]:
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
