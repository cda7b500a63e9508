"""Real processes on loopback for the gateway tests: inferd replicas, gateways, redis-server.

Each is started on a free port, waited for with a deadline, and always stopped (SIGTERM, then SIGKILL)
by the fixture that started it. Their output goes to a log file that a failing test prints.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tests.net import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int
    log: Path
    config_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def spawn(name: str, argv: list[str], port: int, log_dir: Path) -> Proc:
    log = log_dir / f"{name}-{port}.log"
    f = log.open("wb")
    popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True)
    f.close()
    return Proc(name, popen, port, log)


def wait_http(proc: Proc, path: str, timeout: float = 60.0) -> None:
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
    proc.kill()
    raise RuntimeError(f"{proc.name} not ready after {timeout}s:\n{proc.log_tail()}")


def start_replica(model_dir: Path, log_dir: Path, *extra: str) -> Proc:
    """`inferd serve` with the tiny model, as a separate process (caller waits with wait_http)."""
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "serve", "--model", str(model_dir)]
    argv += ["--port", str(port), "--served-model-name", "tiny", "--max-model-len", "512"]
    argv += ["--num-threads", "1", "--attention-backend", "torch", "--drain-timeout", "1", *extra]
    return spawn("replica", argv, port, log_dir)


def start_gateway(config: dict, log_dir: Path, port: int | None = None) -> tuple[Proc, Path]:
    port = port or free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}}
    path = log_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING", "gateway", "--config", str(path)]
    proc = spawn("gateway", argv, port, log_dir)
    proc.config_path = path
    wait_http(proc, "/metrics", timeout=30)
    return proc, path


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis(log_dir: Path) -> Proc:
    port = free_port()
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


def replica_metrics(url: str) -> dict[str, float]:
    """A replica's /metrics as {sample name: value} (labels summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out
