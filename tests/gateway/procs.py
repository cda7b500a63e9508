"""Real processes on loopback for the tests: inferd replicas with the tiny model, gateways, redis-server.

The launcher is the package's (`inferd/procs.py`, shared with the benchmarks and the labs); here are the
tests' defaults and redis. Each process is always stopped by the fixture that started it; its log is
printed by a failing test.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from inferd import procs
from inferd.procs import Proc, free_port, spawn, wait_http
from inferd.procs import metrics as replica_metrics

REPO = procs.ROOT
_env = procs.child_env

__all__ = [
    "Proc",
    "free_port",
    "spawn",
    "wait_http",
    "replica_metrics",
    "start_replica",
    "start_gateway",
    "start_redis",
]


# float32: a replica's tokens are then the same on every CPU, and a resumed stream's recomputed rows take the
# arithmetic its decode steps took (with bf16 on AMX one row and many take different kernels: docs/gateway.md)
REPLICA_FLAGS = ("--max-model-len", "512", "--attention-backend", "torch", "--dtype", "float32")


def start_replica(model_dir: Path, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` with the tiny model as `tiny`, as a separate process (caller waits with wait_http)."""
    return procs.start_serve(model_dir, log_dir, "tiny", *REPLICA_FLAGS, *extra)


def start_gateway(config: dict, log_dir: Path, port: int | None = None) -> tuple[Proc, Path]:
    proc = procs.start_gateway(config, log_dir, port, timeout=30)
    return proc, proc.config_path


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis(log_dir: Path, port: int | None = None) -> Proc:
    """redis-server on `port` (a free one by default), answering PING on return."""
    port = port or free_port()
    argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn("redis", argv, port, log_dir)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start:\n{proc.log_tail()}")
