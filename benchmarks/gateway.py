"""The gateway's cost and its gain, written to benchmarks/results/gateway.json (gateway_quick.json with --quick).

1. Overhead: p50/p99 latency a request gains by going through `inferd gateway` instead of straight to a
   fast fake upstream (a separate process that answers at once), streaming and not, the gateway's CPU
   time per request (next to the fake upstream's, a FastAPI app that does nothing), and the requests/s
   one gateway process proxies at a given client concurrency. Target: < 2 ms added at p50.
2. Routing gain: a shared-prefix workload (many system prompts, many users each, in random order) over
   2 real inferd replicas of a random-weight llama big enough for prefill to cost real time, with a KV
   cache that holds about half the prefixes per replica; round-robin vs least-loaded (scored, prefix
   weight 0) vs prefix-aware (scored). TTFT mean/p99 at the client and the replicas' prefix-cache hit
   rate (from their /metrics). Target: prefix-aware cuts mean TTFT by >= 2x against round-robin.

    python benchmarks/gateway.py            # full
    python benchmarks/gateway.py --quick    # a smoke run: small model, few requests (numbers not meaningful)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, machine, write_json  # noqa: E402
from benchmarks.procs import free_port, replica_metrics, spawn, start_gateway, start_replica, wait_http  # noqa: E402
from inferd.measure.stats import percentile  # noqa: E402
from inferd.models.tiny import build_tokenizer, llama_config, write_random_model  # noqa: E402


# -- a fast fake upstream, run as `python benchmarks/gateway.py --fake-upstream PORT` -------------------
def run_fake_upstream(port: int) -> None:
    import uvicorn

    app = FastAPI()
    chunk = {"id": "x", "object": "text_completion", "model": "fake", "choices": [{"index": 0, "text": "a"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("inferd:num_requests_waiting 0\ninferd:kv_cache_usage_perc 0\n")

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        n = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        if not body.get("stream"):
            return JSONResponse({**chunk, "choices": [{"index": 0, "text": "a" * n}], "usage": usage})

        async def events():
            for _ in range(n):
                yield f"data: {json.dumps(chunk)}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux): a cost per request that a busy machine skews
    far less than it skews latencies."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _latencies(url: str, body: dict, n: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            t = time.perf_counter()
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            out.append(time.perf_counter() - t)
    return out


async def _throughput(url: str, body: dict, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one():
            async with sem:
                r = await client.post(url, json=body)
                assert r.status_code == 200

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t)


def overhead(args, logs: Path) -> dict:
    port = free_port()
    fake = spawn("fake", [sys.executable, __file__, "--fake-upstream", str(port)], port, logs)
    try:
        wait_http(fake, "/health")
        cfg = {
            "pools": [{"name": "f", "replicas": [fake.url], "tokenizer": "estimate"}],
            "models": [{"name": "fake", "backends": [{"pool": "f"}]}],
            "routing": {"scorers": {"prefix": 0}},
        }
        gw = start_gateway(cfg, logs)
        out = {}
        try:
            for stream in (False, True):
                body = {"model": "fake", "prompt": "hello", "max_tokens": 16, "stream": stream}
                asyncio.run(_latencies(fake.url + "/v1/completions", body, 50))  # warm both paths
                asyncio.run(_latencies(gw.url + "/v1/completions", body, 50))
                direct = asyncio.run(_latencies(fake.url + "/v1/completions", body, args.overhead_requests))
                cpu = cpu_seconds(gw.popen.pid), cpu_seconds(fake.popen.pid)
                via = asyncio.run(_latencies(gw.url + "/v1/completions", body, args.overhead_requests))
                gw_cpu, up_cpu = (
                    1000 * (cpu_seconds(p.popen.pid) - c) / len(via) for p, c in zip((gw, fake), cpu, strict=True)
                )
                rps = asyncio.run(_throughput(gw.url + "/v1/completions", body, args.overhead_requests * 2, 32))
                rps_direct = asyncio.run(
                    _throughput(fake.url + "/v1/completions", body, args.overhead_requests * 2, 32)
                )
                out["stream" if stream else "non_stream"] = {
                    "direct_p50_ms": 1000 * percentile(direct, 50),
                    "gateway_p50_ms": 1000 * percentile(via, 50),
                    "added_p50_ms": 1000 * (percentile(via, 50) - percentile(direct, 50)),
                    "added_p99_ms": 1000 * (percentile(via, 99) - percentile(direct, 99)),
                    "gateway_cpu_ms_per_request": gw_cpu,
                    "upstream_cpu_ms_per_request": up_cpu,
                    "gateway_requests_per_s_c32": rps,
                    "direct_requests_per_s_c32": rps_direct,
                }
        finally:
            gw.stop()
        return out
    finally:
        fake.stop()


# -- routing gain --------------------------------------------------------------------------------------
def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random-weight Llama of this size in `folder` (kept there: a later run reuses it)."""
    if (folder / "config.json").exists():
        return folder
    heads = max(4, hidden // 64)
    config = llama_config(384, hidden, hidden * 4, layers, heads, heads)
    return write_random_model(folder, config, build_tokenizer(config.vocab_size))


def workload(seed: int, systems: int, users: int, system_words: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "paged", "fox", "dog", "quick", "lazy", "12"]
    sys_prompts = [" ".join(rng.choice(words) for _ in range(system_words)) for _ in range(systems)]
    prompts = [f"{s}\nUser {u}: {rng.choice(words)} {rng.choice(words)}?" for s in sys_prompts for u in range(users)]
    rng.shuffle(prompts)
    return prompts


async def _ttfts(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    out: list[float] = []
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(p: str):
            async with sem:
                body = {"model": "m", "prompt": p, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
                t = time.perf_counter()
                async with client.stream("POST", url, json=body) as r:
                    assert r.status_code == 200, (r.status_code, await r.aread())
                    first = True
                    async for _ in r.aiter_raw():  # read to the end: the request must finish
                        if first:
                            out.append(time.perf_counter() - t)
                            first = False

        await asyncio.gather(*(one(p) for p in prompts))
    return out


def routing_gain(args, logs: Path) -> dict:
    from tokenizers import Tokenizer

    model = build_model(logs / f"llama-{args.hidden}x{args.layers}", args.hidden, args.layers)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [p for seed in (100, 101, 102) for p in workload(seed, args.systems, args.users, args.system_words)]
    longest = max(len(tok.encode(p).ids) for p in prompts)
    prefix_blocks = args.systems * (longest // 16)
    max_len = 16 * (1 + (longest + args.max_tokens) // 16)
    # each replica holds 60% of all prefixes' blocks: enough for its half under prefix affinity, not for all
    num_blocks = max(int(0.6 * prefix_blocks), 2 * max_len // 16)
    extra = ["--num-blocks", str(num_blocks), "--max-model-len", str(max_len)]
    out = {"num_blocks_per_replica": num_blocks, "prefix_blocks_total": prefix_blocks, "prompt_tokens_max": longest}
    reps = [start_replica(model, logs, *extra) for _ in range(2)]
    try:
        for r in reps:
            wait_http(r, "/health", timeout=300)
        pool = {"name": "p", "replicas": [r.url for r in reps], "model": "tiny", "tokenizer": str(model)}
        pickers = {
            "round_robin": {"picker": "round_robin"},
            "least_loaded": {"scorers": {"prefix": 0}},
            "prefix_aware": {},
        }
        for seed, (name, routing) in enumerate(pickers.items()):
            cfg = {
                "pools": [pool],
                "models": [{"name": "m", "backends": [{"pool": "p"}]}],
                "routing": routing,
                "scrape": {"interval_s": 0.2},
            }
            gw = start_gateway(cfg, logs)
            try:
                prompts = workload(100 + seed, args.systems, args.users, args.system_words)
                asyncio.run(_ttfts(gw.url + "/v1/completions", prompts[:2], 1, 1))  # warm-up
                before = [replica_metrics(r.url) for r in reps]
                ttft = asyncio.run(_ttfts(gw.url + "/v1/completions", prompts, args.concurrency, args.max_tokens))
                after = [replica_metrics(r.url) for r in reps]
            finally:
                gw.stop()

            def delta(key: str, after=after, before=before) -> float:
                return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))

            out[name] = {
                "ttft_mean_s": statistics.mean(ttft),
                "ttft_p99_s": percentile(ttft, 99),
                "prefix_hit_rate": delta("inferd:prefix_cache_hits_total")
                / max(1.0, delta("inferd:prefix_cache_queries_total")),
                "requests": len(ttft),
            }
            print(name, out[name], flush=True)
    finally:
        for r in reps:
            r.stop()
    rr, pa = out["round_robin"]["ttft_mean_s"], out["prefix_aware"]["ttft_mean_s"]
    out["ttft_mean_speedup_prefix_aware_vs_round_robin"] = rr / pa
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake-upstream", type=int, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a smoke run with a small model and few requests")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-routing", action="store_true")
    args = p.parse_args()
    if args.fake_upstream:
        run_fake_upstream(args.fake_upstream)
        return 0
    quick = args.quick
    args.overhead_requests = 100 if quick else 1000
    args.hidden, args.layers = (64, 2) if quick else (512, 8)
    args.systems, args.users, args.system_words = (4, 3, 60) if quick else (12, 8, 160)
    args.concurrency, args.max_tokens = (2, 4) if quick else (4, 8)

    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="inferd-gw-bench-"))
    result = {"quick": quick, "machine": machine(), "settings": {k: v for k, v in vars(args).items() if v is not None}}
    if not args.skip_overhead:
        result["overhead"] = overhead(args, logs)
        print("overhead", json.dumps(result["overhead"], indent=1), flush=True)
    if not args.skip_routing:
        result["routing"] = routing_gain(args, logs)
    target = RESULTS / ("gateway_quick.json" if quick else "gateway.json")
    if target.exists() and (args.skip_overhead or args.skip_routing):  # a partial run keeps the other part
        result = {**json.loads(target.read_text()), **result}
    path = write_json(target, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
