"""KV tiers: is copying a prefix back from host memory or disk faster than recomputing it, per block size?

For each block size, one engine with a host-memory tier and one with a disk tier only (a memory-mapped file; the
page cache is warm, as it is for a tier written moments ago), both with the default model in its default mode and a
pool that holds two prompts. Each round, alternated: a prompt never seen (recomputed: cold), a prompt just served
(a hit in the pool), and a prompt pushed out of the pool by two others (a hit in the tier). The time is one
request's prefill and first token (`max_tokens=1`), so it is the TTFT an idle server gives; medians over rounds.
The tiers' own counters give the copy time per block, checksum included.

    .venv/bin/python -m benchmarks.kv_tier     # appends to results/kv_tier-<cpu kind>.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT_HELP, machine, record_run
from inferd import LLM, SamplingParams
from inferd.config import DEFAULT_MODEL

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 200_000) for _ in range(length)] for _ in range(n)]


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    out = llm.generate([prompt], FIRST_TOKEN)[0]
    return time.perf_counter() - t, out.metrics.num_cached_tokens


def measure(model: str, block_size: int, prompt_len: int, rounds: int, tier: str, workdir: Path) -> dict:
    pool_blocks = 2 * (prompt_len // block_size + 1) + 2  # two prompts and their first tokens
    tier_bytes = 4 << 30
    settings = {"kv_offload_memory": tier_bytes} if tier == "host" else {
        "kv_offload_disk": str(workdir / f"kv-tier-{block_size}.bin"), "kv_offload_disk_memory": tier_bytes,
    }  # fmt: skip
    rng = random.Random(block_size)
    with LLM(model, block_size=block_size, num_blocks=pool_blocks, max_model_len=prompt_len + 16, **settings) as llm:
        times: dict[str, list[float]] = {"cold": [], "pool_hit": [], f"{tier}_hit": []}
        cached: dict[str, list[int]] = {k: [] for k in times}
        _ttft(llm, _prompts(rng, 1, prompt_len)[0])  # warm-up
        for _ in range(rounds):
            target, *fillers = _prompts(rng, 3, prompt_len)
            for mode, prompt in (("cold", target), ("pool_hit", target)):
                seconds, hit = _ttft(llm, prompt)
                times[mode].append(seconds)
                cached[mode].append(hit)
            for filler in fillers:  # two prompts' blocks push the target's out of the pool, into the tier
                _ttft(llm, filler)
            seconds, hit = _ttft(llm, target)
            times[f"{tier}_hit"].append(seconds)
            cached[f"{tier}_hit"].append(hit)
        stats = llm.engine.kv.tiers.tiers[0].stats
        engine = llm.engine
        return {
            "block_size": block_size,
            "tier": tier,
            "prompt_tokens": prompt_len,
            "pool_blocks": pool_blocks,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.quantization or "none",
            "block_bytes": engine.kv.tiers.tiers[0].data[0].numel(),
            "ttft_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
            "cached_tokens": {k: statistics.median(v) for k, v in cached.items()},
            "tier_load_us_per_block": round(stats.load_seconds / max(stats.hits, 1) * 1e6, 1),
            "tier_store_us_per_block": round(stats.store_seconds / max(stats.stored, 1) * 1e6, 1),
            "recompute_us_per_block": round(
                statistics.median(times["cold"]) / (prompt_len / block_size) * 1e6, 1
            ),  # prefill time per block's worth of tokens, first token included
            "tier_hits": stats.hits,
            "checksum_failures": stats.checksum_failures,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="inferd-kv-tier-") as tmp:
        for block_size in args.block_sizes:
            for tier in ("host", "disk"):
                r = measure(args.model, block_size, args.prompt_len, args.rounds, tier, Path(tmp))
                print(r, flush=True)
                results.append(r)
    summary = {
        f"bs{r['block_size']}_{r['tier']}": {
            "tier_hit_vs_cold": round(r["ttft_ms"]["cold"] / r["ttft_ms"][f"{r['tier']}_hit"], 2),
            "tier_hit_vs_pool_hit": round(r["ttft_ms"]["pool_hit"] / r["ttft_ms"][f"{r['tier']}_hit"], 2),
        }
        for r in results
    }
    path = record_run(
        "kv_tier", {"machine": machine(), "model": args.model, "results": results, "speedups": summary},
        sys.argv, args.out, started=started,
    )  # fmt: skip
    print(summary)
    print("wrote", path)


if __name__ == "__main__":
    main()
