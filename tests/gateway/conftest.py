"""Fixtures for the gateway tests: a tiny model, two real inferd replicas shared by the session, gateways.

The replicas are `python -m inferd.cli serve` processes on free loopback ports, started once and shared
(starting one costs seconds on a 2-core machine); tests that kill a replica start their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inferd.procs import ProcGroup
from tests.conftest import build_tiny_model
from tests.gateway.procs import REPLICA_FLAGS, Proc, redis_binary, start_gateway, start_redis


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("gw-model") / "llama")


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gw-logs")


def healthy_replicas(model: Path, logs: Path, count: int, *extra: str) -> Iterator[list[Proc]]:
    """`count` replicas of `model` with these flags, healthy, for a fixture to yield; stopped after it."""
    with ProcGroup(model, logs, REPLICA_FLAGS, "tiny", start_timeout=120) as group:
        yield group.replicas(count, *extra)


@pytest.fixture(scope="session")
def replicas(tiny_llama, logs) -> Iterator[list[Proc]]:
    yield from healthy_replicas(tiny_llama, logs, 2)


@pytest.fixture
def gateway(logs) -> Iterator[Callable[[dict], Proc]]:
    """Start gateways from config dicts; all are stopped after the test."""
    started: list[Proc] = []

    def start(config: dict) -> Proc:
        proc, _ = start_gateway(config, logs)
        started.append(proc)
        return proc

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def redis_proc(logs) -> Iterator[Proc]:
    """A real redis-server on a free loopback port, for the stores that several gateways share."""
    if redis_binary() is None:
        pytest.skip("redis-server not found on PATH: run `bash scripts/system-deps.sh` (Debian package redis-server)")
    proc = start_redis(logs)
    yield proc
    proc.stop()


def base_config(pools: list[dict], models: list[dict], **extra) -> dict:
    """A gateway config with fast probes, so tests see health changes within a second."""
    return {
        "scrape": {"interval_s": 0.2, "stale_after_s": 1.0},
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_eject": 1, "ejection_s": 30},
        "request_timeout_s": 60,
        "expose_replica_header": True,
        "pools": pools,
        "models": models,
        **extra,
    }


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
