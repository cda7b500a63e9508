"""`inferd up` killed with SIGKILL, which runs none of its shutdown: its gateway, its disaggregation proxy,
its prefill and decode replicas and its Prometheus end with it, each sent SIGTERM by the kernel (the
parent-death signal they are started with), within seconds."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.procs import spawn, wait_http
from tests.net import free_port

GONE_WITHIN_S = 10.0

FLEET = """\
models:
  - name: tiny
    model: {model}
    engine: {{max_model_len: 512, attention_backend: torch, num_threads: 1, max_num_seqs: 2, num_blocks: 64}}
    pools:
      - {{name: tiny-prefill, role: prefill, replicas: 1, resources: {{cpu: 1}}}}
      - {{name: tiny-decode, role: decode, replicas: 1, resources: {{cpu: 1}}}}
gateway:
  scrape: {{interval_s: 0.25}}
"""


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], fields[19]


def children_of(pid: int) -> dict[int, str]:
    """The live children of `pid`: {pid: start time} (the start time tells a reused pid apart)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] == pid and st[1] != "Z":
                out[int(entry.name)] = st[2]
    return out


def alive(pid: int, started: str) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == started and st[1] != "Z"  # a zombie has ended, unreaped by its new parent


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.timeout(240)
def test_sigkill_of_inferd_up_takes_its_gateway_proxy_replicas_and_prometheus_with_it(tmp_path, tiny_models):
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET.format(model=tiny_models["llama"]))
    port = free_port()
    argv = [sys.executable, "-m", "inferd.cli", "up", "--config", str(config), "--port", str(port)]
    argv += ["--state-dir", str(tmp_path / "state"), "--drain-timeout", "5", "--status-every", "1"]
    with_prometheus = shutil.which("prometheus") is not None
    if with_prometheus:
        argv += ["--prometheus", "start", "--prometheus-port", str(free_port())]
    up = spawn("up", argv, port, tmp_path)
    children: dict[int, str] = {}
    try:
        wait_http(up, "/metrics", timeout=90)
        body = {"model": "tiny", "prompt": "the quick brown fox " * 4, "max_tokens": 4}
        r = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120)  # through proxy, prefill and decode
        assert r.status_code == 200, r.text
        children = children_of(up.popen.pid)
        # the gateway, the proxy, a prefill and a decode replica (and Prometheus)
        assert len(children) == 4 + with_prometheus, (children, up.log_tail())
        up.popen.send_signal(signal.SIGKILL)
        up.popen.wait(10)
        t0 = time.monotonic()
        while any(alive(p, s) for p, s in children.items()) and time.monotonic() - t0 < GONE_WITHIN_S:
            time.sleep(0.05)
        took = time.monotonic() - t0
        left = [p for p, s in children.items() if alive(p, s)]
        assert not left, f"still running {took:.1f} s after inferd up was killed: {left}"
        assert not listening(port), "the gateway still listens"
        print(f"{len(children)} children gone {took:.2f} s after SIGKILL of inferd up")
    finally:
        up.kill()
        for pid, started in children.items():  # whatever outlived it, so the test leaves nothing behind
            if alive(pid, started):
                os.kill(pid, signal.SIGKILL)
