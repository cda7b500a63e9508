"""A fleet's KV caches under a multi-turn workload: routing (round-robin, keys sent, KV events) x KV tier (none, host).

Many chats, each with a system prompt of its own and a history that grows every turn (the user's new message, then
the model's answer as it came back: `return_token_ids`), so every turn's prompt is the previous turn's prompt and
answer plus a new message. Every chat sends turn 1, then every chat turn 2 (in a shuffled order), and so on, so a
chat comes back after the others were served: the working set (every chat's history) is several times one
replica's KV pool, and a chat's blocks survive only if its replica keeps them (a KV tier) and it comes back to that
replica (routing).

Two pairs of `inferd serve` replicas of the default model publish KV events: one pair with no tier, one with a
host-memory tier (`--kv-offload-memory`). In front of each pair, three gateways: round-robin, prefix affinity on
the keys the gateway sent, prefix affinity on the replicas' KV events. The six configurations take turns (each
phase with chats of its own, so a phase starts on caches holding none of its prefixes), `--rounds` times.

Per configuration: TTFT p50/p95 (streamed), the prompt tokens the replicas computed (prompt - cached), the
replicas' hit rate, and blocks loaded from their tiers (`inferd:kv_tier_hits_total`).

    python -m benchmarks.kv_fleet         # ~20 min on 2 cores; writes benchmarks/results/kv_fleet-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT_HELP, machine, record_run
from inferd.bench.client import send_all
from inferd.bench.datasets import BenchRequest
from inferd.config import DEFAULT_MODEL, engine_default
from inferd.measure.stats import percentile
from inferd.procs import gateway_config, metrics, start_gateway, start_serve, wait_http

BLOCK = engine_default("block_size")
ROUTINGS = {  # name -> gateway settings beyond the pool
    "round_robin": {"routing": {"picker": "round_robin"}, "prefix_index": {"kv_events": False}},
    "sent_keys": {"prefix_index": {"kv_events": False}},
    "kv_events": {"prefix_index": {"kv_events": True}},
}


def run_phase(url: str, seed: int, args) -> list[dict]:
    """`args.chats` chats of `args.turns` turns through the gateway at `url`: one row per request."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]  # noqa: E731
    histories = [words(args.system_tokens) for _ in range(args.chats)]
    rows = []
    for turn in range(args.turns):
        prompts = [h + words(args.user_tokens) for h in histories]
        order = list(range(args.chats))
        rng.shuffle(order)  # chats come back in any order (a fixed one would make round-robin sticky by chance)
        ids = {"return_token_ids": True}
        requests = [BenchRequest(prompts[i], len(prompts[i]), args.output_tokens, extra_body=ids) for i in order]
        outs = send_all(url, requests, concurrency=args.concurrency)
        for i, out in zip(order, outs, strict=True):
            if not out.success:
                raise RuntimeError(f"turn {turn} of chat {i} failed: {out.error}")
            histories[i] = prompts[i] + out.token_ids
            rows.append({
                "turn": turn,
                "ttft_s": out.chunk_times[0] - out.send_time,
                "prompt": out.usage_prompt_tokens,
                "cached": out.usage_cached_tokens or 0,
            })  # fmt: skip
    return rows


def summarize(rows: list[dict], tier_hits: float) -> dict:
    ttfts = [r["ttft_s"] for r in rows]
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    later = [r["ttft_s"] for r in rows if r["turn"] > 0]  # turns that have a history to find
    return {
        "requests": len(rows),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "ttft_p50_later_turns_s": round(percentile(later, 50), 3),
        "prompt_tokens": prompt,
        "prefill_tokens_computed": prompt - cached,
        "hit_rate": round(cached / prompt, 3),
        "tier_blocks_loaded": int(tier_hits),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-blocks", type=int, default=128, help="KV blocks per replica")
    p.add_argument("--kv-offload-memory", default="2GiB", help="the host tier of the tiered replicas")
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=192)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="phases per configuration, alternated")
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()
    started = time.time()
    logs = Path(tempfile.mkdtemp(prefix="inferd-kv-fleet-"))
    longest = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    flags = ["--num-blocks", str(args.num_blocks), "--max-model-len", str(longest + 64), "--enable-kv-cache-events"]
    flags += ["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    tiers = {"none": [], "host": ["--kv-offload-memory", args.kv_offload_memory]}
    replicas = {
        tier: [start_serve(args.model, logs, "m", *flags, *extra) for _ in range(2)] for tier, extra in tiers.items()
    }  # noqa: E501
    gateways = {}
    try:
        for pair in replicas.values():
            for r in pair:
                wait_http(r, "/health", timeout=900)  # the first start converts the GGUF
        for tier, pair in replicas.items():
            for routing, extra in ROUTINGS.items():
                cfg = gateway_config([r.url for r in pair], **extra)
                cfg["pools"][0]["tokenizer"] = "estimate"
                gateways[(routing, tier)] = start_gateway(cfg, logs)
        time.sleep(2)  # the event gateways subscribe after their first scrape
        rows: dict[tuple, list[dict]] = {k: [] for k in gateways}
        loaded: dict[tuple, float] = dict.fromkeys(gateways, 0.0)
        seed = 0
        for _ in range(args.rounds):
            for key, gw in gateways.items():
                seed += 1
                pair = replicas[key[1]]
                before = sum(metrics(r.url).get("inferd:kv_tier_hits_total", 0.0) for r in pair)
                got = run_phase(gw.url, seed, args)
                loaded[key] += sum(metrics(r.url).get("inferd:kv_tier_hits_total", 0.0) for r in pair) - before
                rows[key] += got
                print(key, summarize(got, 0), flush=True)
        results = {f"{routing}/{tier}": summarize(rows[(routing, tier)], loaded[(routing, tier)])
                   for routing, tier in gateways}  # fmt: skip
        base = results["round_robin/none"]
        for r in results.values():
            r["ttft_p50_vs_round_robin_no_tier"] = round(base["ttft_p50_s"] / r["ttft_p50_s"], 2)
            r["prefill_computed_vs_round_robin_no_tier"] = round(
                r["prefill_tokens_computed"] / base["prefill_tokens_computed"], 3
            )
        result = {
            "model": args.model,
            "settings": vars(args) | {"block_size": BLOCK},
            "working_set_blocks": args.chats * longest // BLOCK,
            "machine": machine(),
            "configurations": results,
        }
        print(record_run("kv_fleet", result, sys.argv, args.out, started=started))
        for name, r in results.items():
            print(f"{name:24s} {r}")
        return 0
    finally:
        for proc in [*gateways.values(), *(r for pair in replicas.values() for r in pair)]:
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
