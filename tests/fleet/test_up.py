"""`inferd up` end to end: a burst grows the fleet from 1 to 2 replicas and back, no request fails, with a
real Prometheus scraping the replicas and the first request waiting at the gateway for the cold start."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import build_tiny_model
from tests.gateway.procs import spawn, wait_http
from tests.net import free_port

FLEET = """\
models:
  - name: tiny
    model: {model}
    engine: {{max_model_len: 512, attention_backend: torch, num_threads: 1, max_num_seqs: 2}}
    pools:
      - name: tiny-both
        replicas: 1
        resources: {{cpu: 1}}
        autoscaling:
          min_replicas: 1
          max_replicas: 2
          targets: {{waiting: 2, kv_cache_usage: null}}
          interval_s: 0.5
          window_s: 3
          scale_down_stabilization_s: 2
          cooldown_s: 2
gateway:
  scrape: {{interval_s: 0.25}}
"""


def fleet_replicas(metrics_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(metrics_url, timeout=2).text.splitlines():
        if line.startswith("inferd_fleet_replicas{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_burst_grows_the_fleet_to_two_and_back_to_one_without_a_failed_request(tmp_path):
    model = build_tiny_model("llama", tmp_path / "tiny")
    config = tmp_path / "fleet.yaml"
    config.write_text(FLEET.format(model=model))
    port, metrics_port = free_port(), free_port()
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "inferd.cli", "up", "--config", str(config), "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port), "--prometheus", "start", "--prometheus-port", str(free_port())]
    argv += ["--state-dir", str(state), "--drain-timeout", "5", "--status-every", "1"]
    up = spawn("up", argv, port, tmp_path)
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    body = {"model": "tiny", "prompt": "hello world " * 8, "max_tokens": 32, "ignore_eos": True}
    statuses: list[int] = []
    seen_ready: set[int] = set()
    stop = threading.Event()

    def send(_: int) -> None:
        while not stop.is_set():
            statuses.append(httpx.post(f"{up.url}/v1/completions", json=body, timeout=120).status_code)

    try:
        wait_http(up, "/metrics", timeout=90)
        # the first request arrives before any replica is ready: it waits at the gateway for the cold start
        first = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert fleet_replicas(metrics)["ready"] == 1

        def ready() -> int:
            n = int(fleet_replicas(metrics).get("ready", 0))
            seen_ready.add(n)
            return n

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(send, i) for i in range(8)]
            try:
                wait_for(lambda: ready() == 2, 120, "a second replica")
                served = len(statuses)
                wait_for(lambda: len(statuses) >= served + 8, 60, "requests served by two replicas")
            finally:
                stop.set()
                for f in futures:
                    f.result(timeout=150)
        wait_for(lambda: ready() == 1 and fleet_replicas(metrics).get("draining") == 0, 60, "the scale-down")
        assert statuses and set(statuses) == {200}, statuses
        assert seen_ready >= {1, 2} and max(seen_ready) == 2
    finally:
        up.stop()
        if up.alive():
            up.kill()
    assert up.popen.returncode == 0, up.log_tail()
    summary = json.loads((state / "summary.json").read_text())
    kinds = [(e["kind"], e["text"].split(":", 1)[0]) for e in summary["events"]]
    assert ("scale", "1 -> 2") in kinds and ("scale", "2 -> 1") in kinds, kinds
    # a cold start per replica that became ready: the first, the one the burst added, and at most one per replica
    # any later scale-up added (the burst's tail may scale up once more while the first scale-down drains)
    ups = [tuple(map(int, text.split(" -> "))) for kind, text in kinds if kind == "scale"]
    added = sum(max(0, new - old) for old, new in ups)
    assert 2 <= len(summary["cold_starts_s"]) <= 1 + added and all(c > 0 for c in summary["cold_starts_s"])
    log = up.log.read_text()
    assert "cold start" in log and "TTFT p95" in log and "stopping" in log


def test_up_sets_fine_buckets_around_the_targets(tmp_path):
    from inferd.fleet.spec import parse_fleet
    from inferd.runtime.up import PoolRun, UpOptions, replica_argv

    spec = parse_fleet(FLEET.format(model="gemma3-270m").replace("waiting: 2,", "ttft_p95_s: 0.5, itl_p95_s: 0.04,"))
    model, pool = spec.pools()[0]
    argv = replica_argv(spec, PoolRun(model, pool, tmp_path / "x"), 1234, UpOptions(state_dir=tmp_path))
    ttft = [float(b) for b in argv[argv.index("--ttft-buckets") + 1].split(",")]
    itl = [float(b) for b in argv[argv.index("--itl-buckets") + 1].split(",")]
    assert {0.45, 0.5, 0.55} <= set(ttft) and {0.038, 0.04, 0.042} <= set(itl)
    assert argv[argv.index("--port") + 1] == "1234" and "--max-num-seqs" in argv


def test_a_scale_down_stops_the_replica_whose_cache_serves_least():
    from inferd.runtime.up import ReplicaProc, drain_order

    a, b, c = (ReplicaProc("p", port, None, started, None) for port, started in ((1, 10.0), (2, 20.0), (3, 30.0)))
    worths = {a.url: 512.0, b.url: 4096.0}  # c: no figure at the gateway yet
    assert [r.port for r in drain_order([a, b, c], worths)] == [3, 1, 2]
    assert [r.port for r in drain_order([a, b, c], {})] == [3, 2, 1]  # no gateway figures: the newest first
