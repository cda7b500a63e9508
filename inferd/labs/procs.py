"""Real processes for the labs that need a network: `inferd serve` replicas and an `inferd gateway`, each on a
free loopback port, waited for with a deadline, and stopped (SIGTERM, then SIGKILL) when the lab run ends.

The test suite has its own helpers for this (tests/gateway/procs.py); the package cannot import tests, so the
labs carry this small launcher. Children import the same inferd as the parent (PYTHONPATH is set to it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn(name: str, argv: list[str], port: int, log_dir: Path) -> Proc:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = log_dir / f"{name}-{port}.log"
    with log.open("wb") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Proc(name, popen, port, log)


def wait_ready(proc: Proc, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(proc.url + path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s:\n{proc.log_tail()}")


def start_replica(model: str, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` serving `model` as "m" (the caller waits for /health)."""
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", model]
    argv += ["--port", str(port), "--served-model-name", "m", "--num-threads", "1", "--drain-timeout", "1", *extra]
    return spawn("replica", argv, port, log_dir)


def start_gateway(config: dict, log_dir: Path) -> Proc:
    port = free_port()
    path = log_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "gateway", "--config", str(path)]
    proc = spawn("gateway", argv, port, log_dir)
    wait_ready(proc, "/metrics", timeout=60)
    return proc


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {sample name: value}, labels summed."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


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
