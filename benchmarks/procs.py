"""Servers for the benchmarks, as separate processes on loopback: `inferd serve`, `inferd gateway`, or any
command; each on a free port, waited for with a deadline, stopped with SIGTERM (then SIGKILL), its output
in a log file that an error quotes. Benchmarks import nothing from tests/.
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

REPO = Path(__file__).resolve().parent.parent


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
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn(name: str, argv: list[str], port: int, log_dir: Path) -> Proc:
    """Start `argv` with this checkout first on PYTHONPATH, so `python -m inferd.cli` is this code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = log_dir / f"{name}-{port}.log"
    with log.open("wb") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    return Proc(name, popen, port, log)


def wait_http(proc: Proc, path: str, timeout: float = 60.0) -> None:
    """Until `path` answers 200; stops the process and raises with its log if it exits or never does."""
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
    raise RuntimeError(f"{proc.name} not ready after {timeout}s:\n{proc.log_tail()}")


def start_replica(model_dir: Path, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` (served as `tiny`, one thread, the torch attention backend); wait with wait_http."""
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--served-model-name", "tiny", "--num-threads", "1"]
    argv += ["--attention-backend", "torch", "--drain-timeout", "1", *extra]
    return spawn("replica", argv, port, log_dir)


def start_gateway(config: dict, log_dir: Path) -> Proc:
    """`inferd gateway` with `config` (a dict, written as YAML beside the logs), ready when it returns."""
    port = free_port()
    path = log_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "gateway", "--config", str(path)]
    proc = spawn("gateway", argv, port, log_dir)
    wait_http(proc, "/metrics", timeout=60)
    return proc


def replica_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {sample name: value}, labels summed."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out
