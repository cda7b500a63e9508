"""The gateway runs beside any OpenAI-compatible server: importing it loads no engine, no model code, no torch;
and a SIGHUP while it starts (a config tool reloading it) does not end it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.gateway.procs import REPO, _env, free_port, spawn, wait_http

pytestmark = pytest.mark.timeout(60)


def test_gateway_imports_no_torch_and_no_engine():
    code = (
        "import sys, time; t = time.perf_counter();"
        "import inferd.gateway.app, inferd.gateway.cli, inferd.gateway.service;"
        "banned = ('torch', 'inferd.engine', 'inferd.models', 'inferd.server');"
        "bad = [m for m in sys.modules if m.startswith(banned)];"
        "print(bad, round(time.perf_counter() - t, 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    bad, _ = out.stdout.rsplit(" ", 1)
    assert bad == "[]", out.stdout


def _reader_waiting(fifo, deadline: float) -> int:
    """A write end of `fifo`, once the gateway has opened it to read its config."""
    while time.monotonic() < deadline:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: no reader yet
            if e.errno != errno.ENXIO:
                raise
            time.sleep(0.005)
    raise AssertionError("the gateway never opened its config")


def test_a_sighup_before_the_port_opens_is_held_and_replayed(tmp_path):
    """The config is a FIFO, so the test knows the gateway is reading it (well before its port opens) and
    sends SIGHUP right then: SIGHUP's default action would end the process."""
    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "pools": [{"name": "a", "replicas": ["http://127.0.0.1:9"]}],
        "models": [{"name": "tiny", "backends": [{"pool": "a"}]}],
    }
    fifo = tmp_path / "gateway.yaml"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "inferd.cli", "--log-level", "INFO", "gateway", "--config", str(fifo)]
    proc = spawn("gateway", argv, port, tmp_path)
    try:
        deadline = time.monotonic() + 30
        fd = _reader_waiting(fifo, deadline)
        proc.popen.send_signal(signal.SIGHUP)
        time.sleep(0.2)
        assert proc.alive(), proc.log_tail()
        os.write(fd, yaml.safe_dump(cfg).encode())
        os.close(fd)
        # the held SIGHUP came after the read began: the gateway reads the file again once it runs
        while "gateway on http" not in proc.log.read_text():  # the first read is over
            assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.02)
        cfg["models"][0]["aliases"] = ["tiny-v2"]
        fd = _reader_waiting(fifo, deadline)
        os.write(fd, yaml.safe_dump(cfg).encode())
        os.close(fd)
        wait_http(proc, "/v1/models", timeout=30)
        assert [m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"]] == ["tiny", "tiny-v2"]
        assert "reloaded" in proc.log.read_text()
    finally:
        proc.stop()
