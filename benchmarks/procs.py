"""Servers for the benchmarks, as separate processes on loopback, through the package's launcher
(`inferd/procs.py`); here are the benchmarks' replica defaults. Benchmarks import nothing from tests/.
"""

from __future__ import annotations

from pathlib import Path

from inferd.procs import Proc, free_port, spawn, start_gateway, start_serve, wait_http
from inferd.procs import metrics as replica_metrics

__all__ = ["Proc", "free_port", "spawn", "wait_http", "start_gateway", "start_replica", "replica_metrics"]


def start_replica(model_dir: Path, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` (served as `tiny`, one thread, the torch attention backend); wait with wait_http."""
    return start_serve(model_dir, log_dir, "tiny", "--attention-backend", "torch", *extra)
