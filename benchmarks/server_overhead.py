"""Server overhead: the same greedy workload offline (LLM.generate) and through `inferd serve` (streaming).

Both sides use the same engine settings (`--quantization` passed to both: left out, `LLM` would take None as
no quantization while `inferd serve` takes its default), with max_num_seqs = the client concurrency, so the
batch sizes match and the difference is what HTTP, SSE and the step thread cost. Output tokens/s of both and their
ratio go to benchmarks/results/server_overhead-<kind>.json, one run per invocation. Target: the server keeps
>= 90% of offline throughput.
The two run alternately (`--repeats`, medians), and each server run says where the cores' time went. Each side
warms up on prompts of its own that are not timed, and the offline engine's prefix cache is reset before each
timed run (a new server process starts with an empty one), so neither side is served a timed prompt from its
cache.

    .venv/bin/python benchmarks/server_overhead.py --num-requests 64 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find benchmarks.common
from benchmarks.common import OUT_HELP, record_run  # noqa: E402
from inferd.config import DEFAULT_MODEL, engine_choices, engine_default  # noqa: E402
from inferd.engine.engine import LLM
from inferd.procs import free_port  # noqa: E402
from inferd.sampling import SamplingParams

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "paged",
    "attention",
    "keeps",
    "every",
    "block",
    "busy",
]


def make_prompts(n: int, words: int) -> list[str]:
    # distinct prompts (no shared prefix beyond chance), deterministic
    return [f"Request {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) for i in range(n)]


def engine_kwargs(args) -> dict:
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.concurrency,
        kv_cache_memory=args.kv_cache_memory,
    )


def make_llm(args) -> LLM:
    from inferd.config import parse_memory

    return LLM(args.model, **engine_kwargs(args) | {"kv_cache_memory": parse_memory(args.kv_cache_memory)})


def run_offline(args, llm: LLM, prompts: list[str], warm: list[str]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(warm, params)  # warm-up: a short one left the first timed run slow
    llm.reset_prefix_cache()  # the last repeat's prompts are this one's: none may be served from the cache
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed}


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of `pid` so far, by thread id, with its OS name (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = ((task / "comm").read_text().strip(), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):  # the thread ended in between
            continue
    return out


def cpu_split(pid: int, before: dict, after: dict, wall: float, client_s: float) -> dict:
    """Where the 2 cores' time went during the timed run: the server's event loop (its main thread), the step
    thread, the other server threads (torch's OpenMP workers, helpers) and the benchmark client."""
    spent = {tid: (name, t - before.get(tid, (name, 0.0))[1]) for tid, (name, t) in after.items()}
    main_s = spent.pop(pid, ("", 0.0))[1]
    engine = sum(t for name, t in spent.values() if name == "inferd-engine" and t > 0)
    others = sorted(
        ((name, round(t, 3)) for name, t in spent.values() if name != "inferd-engine" and t > 0.01), key=lambda x: -x[1]
    )
    return {
        "wall_s": wall,
        "cores_s": wall * (os.cpu_count() or 1),
        "server_event_loop_s": main_s,
        "server_step_threads_s": engine,  # the step thread (and OpenMP workers it started, which take its name)
        "server_other_threads_s": others,
        "client_s": client_s,
    }


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--model", args.model, "--port", str(port)]
    for flag, value in engine_kwargs(args).items():
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    env = os.environ | dict(kv.split("=", 1) for kv in args.server_env)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in time")


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def _drive(
    url: str, server_pid: int, prompts: list[str], warm: list[str], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(_one(client, p, max_tokens) for p in warm))  # warm-up, on prompts not timed
        queue = list(reversed(prompts))
        total = 0

        async def worker() -> None:
            nonlocal total
            while queue:
                tokens = await _one(client, queue.pop(), max_tokens)  # not `total += await ...`: lost updates
                total += tokens

        start, cpu0, threads0 = time.perf_counter(), time.process_time(), thread_cpu(server_pid)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, client_s = time.perf_counter() - start, time.process_time() - cpu0
        return total, wall, cpu_split(server_pid, threads0, thread_cpu(server_pid), wall, client_s)


def run_server(args, prompts: list[str], warm: list[str]) -> dict:
    port = free_port()
    proc = start_server(args, port)
    try:
        url = f"http://127.0.0.1:{port}"
        tokens, elapsed, cpu = asyncio.run(_drive(url, proc.pid, prompts, warm, args.concurrency, args.output_len))
    finally:
        proc.terminate()
        proc.wait(30)
    return {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed, "cpu": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization",
        default=engine_default("quantization"),
        choices=engine_choices("quantization"),
        help="the weights' quantization, the same on both sides (default: the engine's)",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-words", type=int, default=32, help="words per prompt")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--repeats", type=int, default=3, help="offline and server runs, alternated; medians")
    p.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for the server's environment only")
    p.add_argument("--out", help=OUT_HELP)
    args = p.parse_args()

    # the warm-up's prompts (one per slot) are not timed: none of the timed prompts is cached on either side
    prompts = make_prompts(args.num_requests + args.concurrency, args.input_words)
    prompts, warm = prompts[: args.num_requests], prompts[args.num_requests :]
    llm = make_llm(args)
    runs = []
    for i in range(args.repeats):  # alternated, so a drift of the machine's speed hits both sides alike
        offline = run_offline(args, llm, prompts, warm)
        print(f"offline: {offline['output_tokens_per_s']:.1f} output tok/s ({offline['seconds']:.1f} s)", flush=True)
        server = run_server(args, prompts, warm)
        print(f"server:  {server['output_tokens_per_s']:.1f} output tok/s ({server['seconds']:.1f} s)", flush=True)
        cpu = server["cpu"]
        print(
            f"cpu:     of {cpu['cores_s']:.1f} core-s: step threads {cpu['server_step_threads_s']:.1f}, event loop "
            f"{cpu['server_event_loop_s']:.1f}, other server threads {cpu['server_other_threads_s'][:4]}, "
            f"client {cpu['client_s']:.1f}",
            flush=True,
        )
        runs.append({"offline": offline, "server": server})
        ratio = server["output_tokens_per_s"] / offline["output_tokens_per_s"]
        print(f"ratio:   {ratio:.3f} (run {i + 1})", flush=True)
    offline_tps = statistics.median(r["offline"]["output_tokens_per_s"] for r in runs)
    server_tps = statistics.median(r["server"]["output_tokens_per_s"] for r in runs)
    ratio = server_tps / offline_tps
    print(f"medians: offline {offline_tps:.1f}, server {server_tps:.1f} tok/s; ratio {ratio:.3f} (target >= 0.90)")
    result = {
        "benchmark": "server_overhead",
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "quantization_chosen": llm.engine.quantization or "none",
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "input_words": args.input_words,
        "output_len": args.output_len,
        "server_env": args.server_env,
        "repeats": args.repeats,
        "runs": runs,
        "offline_output_tokens_per_s": offline_tps,
        "server_output_tokens_per_s": server_tps,
        "ratio": ratio,  # of the medians
    }
    print(f"wrote {record_run('server_overhead', result, sys.argv, args.out)}")


if __name__ == "__main__":
    main()
