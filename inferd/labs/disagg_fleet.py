"""Disaggregated serving as real processes for the labs: `inferd serve --role prefill` and `--role decode`
instances and `inferd disagg proxy` in front, on loopback, plus the streaming client the labs time them with.

Every process is started through `inferd.procs` (free port, log file, SIGTERM then SIGKILL) and handed to a
`Fleet`, which stops them all when the lab ends, however it ends. No process is pinned to a core: on a
shared machine a pinned process waits for its core while another sits idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import httpx

from inferd.labs.context import LabContext
from inferd.labs.procs import Proc, metrics, start_replica
from inferd.procs import free_port, spawn, wait_http

SECRET = "inferd-lab-kv-secret"  # loopback only, for this run's processes
START_TIMEOUT = 600.0  # a real model on a busy machine can take minutes to load


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class Fleet:
    """The processes one lab started; `stop` ends every one (registered with the context as it starts)."""

    ctx: LabContext
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx.on_close(self.stop)

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def serve(self, *extra: str) -> Proc:
        """An `inferd serve` of the run's model, one thread unless `extra` says otherwise."""
        return self.add(start_replica(self.ctx.model, self.ctx.workdir, *self.ctx.replica_flags(), *extra))

    def prefill(self, *extra: str) -> tuple[Proc, str]:
        """A prefill instance and its KV channel's host:port."""
        port = free_port()
        return self.serve(
            "--role", "prefill", "--kv-secret", SECRET, "--kv-port", str(port), *extra
        ), f"127.0.0.1:{port}"

    def decode(self, peers: list[str], *extra: str) -> Proc:
        return self.serve("--role", "decode", "--kv-secret", SECRET, *extra, "--kv-peers", *peers)

    def proxy(self, prefill: list[Proc], decode: list[Proc]) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "disagg", "proxy", "--port", str(port)]
        argv += ["--prefill", *[p.url for p in prefill], "--decode", *[d.url for d in decode]]
        return self.add(spawn("proxy", argv, port, self.ctx.workdir))

    def wait(self, *procs: Proc) -> None:
        for p in procs or self.procs:
            wait_http(p, "/health", timeout=START_TIMEOUT)

    def stop(self, *procs: Proc) -> None:
        """Stop these processes (all of them if none is named)."""
        for p in procs or list(self.procs):
            self.procs.remove(p)
            p.stop()


@dataclass
class Streamed:
    ttft: float
    itls: list[float]
    tokens: int


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, **extra) -> Streamed:
    """A streamed completion of token ids, read to the end: its time to the first chunk and the gaps after."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json={**body, **extra, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url}: a stream with no tokens")
    return Streamed(stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], len(stamps))


async def _ttfts(url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(p: list[int]) -> float:
            async with sem:
                return (await stream(client, url, p, 2)).ttft

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def ttfts(url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    """Streamed completions of 2 tokens, `concurrency` at a time: their TTFTs in seconds, in prompt order."""
    return asyncio.run(_ttfts(url, prompts, concurrency))


def leases_released(prefill: Proc, timeout: float = 10.0) -> float:
    """Blocks the prefill instance still lends after the decode side acknowledged (0 once every lease is
    released); waits up to `timeout` for the acknowledgements in flight."""
    deadline = time.monotonic() + timeout
    while True:
        left = metrics(prefill.url).get("inferd:kv_leases_active", 0.0)
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def summed_delta(after: list[dict[str, float]], before: list[dict[str, float]], key: str) -> float:
    """`key`'s rise summed over servers (their /metrics after and before, in the same order)."""
    return sum(delta(a, b, key) for a, b in zip(after, before, strict=True))
