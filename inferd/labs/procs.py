"""Real processes for the labs that need a network: `inferd serve` replicas and an `inferd gateway`, each on a
free loopback port, waited for with a deadline, and stopped (SIGTERM, then SIGKILL) when the lab run ends.

The launcher is `inferd/procs.py` (shared with the tests and the benchmarks); here are the labs' replica
defaults, the gateway config they use, and the one completion request they send (`complete`).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from inferd.procs import Proc, metrics, start_gateway, start_serve

__all__ = ["Proc", "complete", "metrics", "start_gateway", "start_replica", "gateway_config"]


def start_replica(model: str, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` serving `model` as "m" (the caller waits for /health)."""
    return start_serve(model, log_dir, "m", *extra)


def gateway_config(replicas: list[Proc], **extra) -> dict:
    """One pool of these replicas behind the model name "m", with fast probes."""
    return {
        "scrape": {"interval_s": 0.2, "stale_after_s": 2.0},
        "health": {"interval_s": 0.5, "timeout_s": 1.0},
        "request_timeout_s": 120,
        "pools": [{"name": "p", "replicas": [r.url for r in replicas], "model": "m"}],
        "models": [{"name": "m", "backends": [{"pool": "p"}]}],
        **extra,
    }


def complete(url: str, prompt: str | list[int], max_tokens: int, *, timeout: float = 120, headers=None, **body):
    """A greedy completion from the model "m" of exactly `max_tokens` (eos ignored), not streamed; `body`
    adds to the request or overrides it."""
    base = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=base | body, headers=headers, timeout=timeout)
