"""Colocated against disaggregated serving on this machine's cores, written to benchmarks/results/disagg.json
(disagg_quick.json with --quick).

The workload: a steady Poisson stream of short streamed completions (a short plain prompt, since the
random model has no chat template; `--short-tokens` streamed output tokens each) plus, every
`--long-every` seconds, a long prompt (`--long-prompt` tokens, a few output tokens).
The claim under test: when prefill and decode share a step, each long prompt stretches
the inter-token latency of every short request decoding beside it; with the prefill in its own process
on its own core, the short requests' ITL p99 stays flat.

- colocated: one `inferd serve` (--role both) on cores 0-1, two torch threads;
- disaggregated: `--role prefill` on core 0 and `--role decode` on core 1 (one torch thread each), the
  KV handed over through shared memory, `inferd disagg proxy` in front (same total cores).

Reported per setup: TTFT and ITL p50/p99 of the short requests, TTFT of the long ones, output tokens/s,
and for the disaggregated run the handoff's cost from the decode instance's /metrics (bytes and blocks
pulled, transfer time per request).

    python benchmarks/disagg.py             # full: a 512x8 random llama, 60 s per setup
    python benchmarks/disagg.py --quick     # a smoke run: tiny model, a few seconds (numbers not meaningful)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, machine, portable  # noqa: E402
from benchmarks.gateway import build_model  # noqa: E402
from benchmarks.procs import Proc, free_port, replica_metrics, spawn, wait_http  # noqa: E402
from inferd.measure.arrivals import arrivals_within  # noqa: E402
from inferd.measure.stats import percentile  # noqa: E402
from inferd.procs import start_proxy  # noqa: E402

SECRET = "bench-secret"


def _pin(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else []


def serve(model: Path, logs: Path, cores: str, threads: int, *extra: str) -> Proc:
    port = free_port()
    argv = [*_pin(cores), sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--served-model-name", "m", "--max-model-len", "4096", "--num-blocks", "1024"]
    argv += ["--num-threads", str(threads), *extra]
    return spawn("serve", argv, port, logs)


def proxy(logs: Path, prefill: Proc, decode: Proc) -> Proc:
    return start_proxy(logs, [prefill.url], [decode.url])


async def short_request(client: httpx.AsyncClient, url: str, words: str, max_tokens: int, out: list) -> None:
    # a plain prompt: the benchmark's random model has no chat template; one chunk per token
    body = {"model": "m", "prompt": words, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"short request failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    if stamps:
        out.append(
            {
                "ttft": stamps[0] - t0,
                "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                "tokens": len(stamps),
            }
        )


async def long_request(client: httpx.AsyncClient, url: str, tokens: list[int], out: list) -> None:
    body = {"model": "m", "prompt": tokens, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        first = True
        async for line in r.aiter_lines():  # read to the end: the request stays in the batch until then
            if first and line.startswith("data: ") and line != "data: [DONE]":
                out.append({"ttft": time.perf_counter() - t0})
                first = False


async def workload(url: str, args) -> dict:
    rng = random.Random(args.seed)
    shorts: list[dict] = []
    longs: list[dict] = []
    tasks = []
    start = time.perf_counter()
    next_long = args.long_every / 2
    async with httpx.AsyncClient(timeout=600) as client:
        for t in arrivals_within(args.duration, args.rate, 1.0, np.random.default_rng(args.seed)):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            words = " ".join(
                rng.choice(["paged", "attention", "blocks", "decode", "batch", "cache"]) for _ in range(20)
            )
            tasks.append(asyncio.create_task(short_request(client, url, words, args.short_tokens, shorts)))
            if t >= next_long:
                prompt = [rng.randrange(3, 380) for _ in range(args.long_prompt)]
                tasks.append(asyncio.create_task(long_request(client, url, prompt, longs)))
                next_long += args.long_every
        failures = [r for r in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(r, BaseException)]
    if failures:
        print(f"{len(failures)} requests failed, e.g. {failures[0]!r}", file=sys.stderr)
    wall = time.perf_counter() - start
    itl = [g for s in shorts for g in s["itl"]]
    ttft = [s["ttft"] for s in shorts]
    return {
        "short_requests": len(shorts),
        "failed_requests": len(failures),
        "long_requests": len(longs),
        "short_ttft_p50_s": percentile(ttft, 50),
        "short_ttft_p99_s": percentile(ttft, 99),
        "short_itl_p50_s": percentile(itl, 50),
        "short_itl_p99_s": percentile(itl, 99),
        "long_ttft_p50_s": percentile([x["ttft"] for x in longs], 50),
        "output_tokens_per_s": sum(s["tokens"] for s in shorts) / wall,
        "wall_s": wall,
    }


def transfer_overhead(decode: Proc) -> dict:
    m = replica_metrics(decode.url)
    n = m.get("inferd:kv_transfer_seconds_count", 0.0)
    return {
        "remote_prefills": m.get("inferd:remote_prefills_total", 0.0),
        "local_prefills": m.get("inferd:local_prefills_total", 0.0),
        "bytes_pulled": m.get("inferd:kv_transfer_bytes_total", 0.0),
        "blocks_pulled": m.get("inferd:kv_transfer_blocks_total", 0.0),
        "transfer_s_mean": m.get("inferd:kv_transfer_seconds_sum", 0.0) / n if n else None,
    }


def run_setup(name: str, procs: list[Proc], url: str, args, decode: Proc | None) -> dict:
    try:
        for p in procs:
            wait_http(p, "/health", timeout=300)
        asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "duration": min(3.0, args.duration)})))  # warm
        result = asyncio.run(workload(url, args))
        if decode is not None:
            result["handoff"] = transfer_overhead(decode)
        print(name, json.dumps(result, indent=1))
        return result
    finally:
        for p in procs:
            p.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per setup")
    ap.add_argument("--rate", type=float, default=2.0, help="short requests per second")
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", default="/tmp/inferd-bench-disagg")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.duration, args.long_prompt, args.long_every = 64, 2, 4.0, 300, 2.0
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    model = build_model(logs / f"llama-{args.hidden}x{args.layers}", args.hidden, args.layers)
    both = serve(model, logs, "0,1", 2)
    colocated = run_setup("colocated", [both], both.url, args, None)
    kv_port = free_port()
    prefill = serve(model, logs, "0", 1, "--role", "prefill", "--kv-secret", SECRET, "--kv-port", str(kv_port))
    decode = serve(model, logs, "1", 1, "--role", "decode", "--kv-secret", SECRET, "--kv-peers", f"127.0.0.1:{kv_port}")
    front = proxy(logs, prefill, decode)
    disaggregated = run_setup("disaggregated", [prefill, decode, front], front.url, args, decode)
    out = {
        "machine": machine(),
        "command": "python benchmarks/disagg.py" + (" --quick" if args.quick else ""),
        "settings": {k: v for k, v in vars(args).items() if k not in ("logs", "quick")},
        "colocated": colocated,
        "disaggregated": disaggregated,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("disagg_quick.json" if args.quick else "disagg.json")
    path.write_text(json.dumps(portable(out), indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
