"""Prefix routing's precision: does the replica the gateway picked hold the blocks the gateway thought it held?

Two `inferd serve` replicas of the default model (Gemma 3 270M) publish KV events; two gateways route to them
with the default scorers, one scoring prefix affinity on the keys it sent there (`prefix_index.kv_events:
false`), the other on what the replicas' events say their caches hold. The workload is shared prefixes (system
prompts of 6 blocks, popular ones more often: Zipf 1.1) with a unique question each, whose working set is
about 3x one replica's KV pool, so replicas evict all the time. Phases alternate between the gateways, each
with prefixes of its own (a phase starts on caches the other phase filled with prefixes it never sends).

Per request the gateway says how many of the prompt's full blocks it predicted cached on the replica it picked
(`x-inferd-prefix-blocks`, with `expose_replica_header`) and the replica says how many prompt tokens it served
from its cache (`usage.prompt_tokens_details.cached_tokens`):

- precision: blocks predicted and served / blocks predicted (target >= 95% with events);
- recall: blocks predicted and served / blocks served (hits the gateway did not see coming);
- the replicas' hit rate (cached / prompt tokens) and the mean latency of a request (max_tokens 1: prefill).

    python benchmarks/kv_routing.py               # ~5 min on 2 cores, writes benchmarks/results/kv_routing.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine, write_result  # noqa: E402
from benchmarks.procs import start_gateway, wait_http  # noqa: E402
from inferd.config import DEFAULT_MODEL, engine_default  # noqa: E402
from inferd.procs import start_serve  # noqa: E402

BLOCK = engine_default("block_size")


def zipf_choice(rng: random.Random, n: int, s: float) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def phase_prompts(seed: int, prefixes: int, prefix_blocks: int, requests: int) -> list[list[int]]:
    """`requests` prompts: one of `prefixes` shared prefixes (Zipf) then a unique 20-token question."""
    rng = random.Random(seed)
    shared = [[rng.randrange(1000, 30000) for _ in range(prefix_blocks * BLOCK)] for _ in range(prefixes)]
    return [shared[zipf_choice(rng, prefixes, 1.1)] + [rng.randrange(1000, 30000) for _ in range(20)]
            for _ in range(requests)]  # fmt: skip


def send(url: str, prompts: list[list[int]], concurrency: int) -> list[dict]:
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:

        def one(prompt: list[int]) -> dict:
            t = time.perf_counter()
            r = client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
            r.raise_for_status()
            usage = r.json()["usage"]
            predicted, full = map(int, r.headers["x-inferd-prefix-blocks"].split("/"))
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            return {"predicted": predicted, "full": full, "served": cached // BLOCK, "cached": cached,
                    "prompt": usage["prompt_tokens"], "seconds": time.perf_counter() - t}  # fmt: skip

        return list(pool.map(one, prompts))


def summarize(rows: list[dict]) -> dict:
    both = sum(min(r["predicted"], r["served"]) for r in rows)
    predicted, served = sum(r["predicted"] for r in rows), sum(r["served"] for r in rows)
    return {
        "requests": len(rows),
        "blocks_predicted": predicted,
        "blocks_served": served,
        "precision": both / predicted if predicted else None,
        "recall": both / served if served else None,
        "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
        "mean_latency_s": statistics.mean(r["seconds"] for r in rows),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-blocks", type=int, default=48, help="KV blocks per replica")
    p.add_argument("--prefixes", type=int, default=24)
    p.add_argument("--prefix-blocks", type=int, default=6)
    p.add_argument("--requests", type=int, default=150, help="per phase")
    p.add_argument("--rounds", type=int, default=2, help="phases per gateway, alternated")
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="inferd-kv-routing-"))
    flags = ["--num-blocks", str(args.num_blocks), "--max-model-len", "512", "--enable-kv-cache-events"]
    flags += ["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    reps = [start_serve(args.model, logs, "m", *flags) for _ in range(2)]
    gateways = {}
    try:
        for r in reps:
            wait_http(r, "/health", timeout=900)  # the first start converts the GGUF
        pool = {"name": "p", "replicas": [r.url for r in reps], "model": "m", "tokenizer": "estimate"}
        for name, events in (("sent_keys", False), ("kv_events", True)):
            cfg = {
                "pools": [pool],
                "models": [{"name": "m", "backends": [{"pool": "p"}]}],
                "prefix_index": {"kv_events": events},
                "scrape": {"interval_s": 0.2},
                "expose_replica_header": True,
            }
            gateways[name] = start_gateway(cfg, logs)
        time.sleep(2)  # the event gateway subscribes after its first scrape
        rows: dict[str, list[dict]] = {name: [] for name in gateways}
        per_phase: dict[str, list[dict]] = {name: [] for name in gateways}
        seed = 0
        for _ in range(args.rounds):
            for name, gw in gateways.items():
                seed += 1
                prompts = phase_prompts(seed, args.prefixes, args.prefix_blocks, args.requests)
                got = send(gw.url, prompts, args.concurrency)
                rows[name] += got
                per_phase[name].append(summarize(got))
                print(name, per_phase[name][-1], flush=True)
        result = {
            "model": args.model,
            "settings": vars(args) | {"block_size": BLOCK},
            "working_set_blocks": args.prefixes * args.prefix_blocks,
            "machine": machine(),
            "gateways": {name: summarize(rows[name]) | {"phases": per_phase[name]} for name in gateways},
        }
        print(write_result("kv_routing", result))
        return 0
    finally:
        for proc in [*gateways.values(), *reps]:
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
