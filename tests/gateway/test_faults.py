"""Faults and operations with real processes: a replica killed mid-run (no request lost that had not started
streaming; a started stream ends with a clean SSE error event), and SIGHUP reload with a stream in flight."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.gateway.conftest import base_config, wait_until
from tests.gateway.procs import start_replica, wait_http

pytestmark = pytest.mark.timeout(150)


def _gauge(gw_url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{gw_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def victim(tiny_llama, logs):
    proc = start_replica(tiny_llama, logs)
    try:
        wait_http(proc, "/health", timeout=120)
        yield proc
    finally:
        proc.kill()


def test_failover_when_a_replica_is_killed_mid_run(replicas, victim, gateway):
    survivor = replicas[0]
    pools = [
        {"name": "both", "replicas": [victim.url, survivor.url], "model": "tiny"},
        {"name": "victim-only", "replicas": [victim.url], "model": "tiny"},
    ]
    models = [
        {"name": "tiny", "backends": [{"pool": "both"}]},
        {"name": "doomed", "backends": [{"pool": "victim-only"}]},
    ]
    # round robin: half the requests reach the victim whatever its load (the scored picker could steer them
    # all to the idle survivor, and the victim then never had two in flight)
    # probes every 2 s: the frozen victim is not ejected before requests reach it (on a loaded machine the
    # 0.2 s probes ejected it first, and no request was ever in flight there to be cut)
    health = {"interval_s": 2.0, "timeout_s": 0.5, "failures_to_eject": 1, "ejection_s": 30}
    gw = gateway(base_config(pools, models, retries=2, routing={"picker": "round_robin"}, health=health))

    stream_body = {"model": "doomed", "prompt": [5, 6], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=stream_body, timeout=60) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_raw()
        received = next(chunks)
        # freeze the victim with the stream half-way, so it cannot finish before the kill on a fast machine;
        # requests sent to it from now on hang in flight until the kill cuts them
        os.kill(victim.popen.pid, signal.SIGSTOP)

        results: list[int] = []
        body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 48, "ignore_eos": True}

        def one(_):
            r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=60)
            assert r.status_code != 200 or r.json()["usage"]["completion_tokens"] == 48
            return r.status_code

        with ThreadPoolExecutor(12) as ex:
            futures = [ex.submit(one, i) for i in range(36)]
            wait_until(lambda: _gauge(gw.url, "inferd_gateway_replica_in_flight", pool="both", replica=victim.url) >= 2)
            victim.kill()  # SIGKILL, mid-run: requests in flight there lose their connection
            results = [f.result() for f in futures]
        received += b"".join(chunks)

    assert results == [200] * 36, results  # none lost: each one that had not streamed was retried elsewhere
    assert _gauge(gw.url, "inferd_gateway_retries_total") >= 1
    events = [e for e in received.decode().split("\n\n") if e]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "stream_broken" and last["error"]["type"] == "server_error"
    assert "data: [DONE]" not in events  # a started stream is never retried nor closed as if complete

    wait_until(lambda: httpx.get(f"{gw.url}/health").json()["pools"]["both"] == 1, what="the victim ejected")
    r = httpx.post(f"{gw.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and r.headers["x-inferd-replica"] == survivor.url
    r = httpx.post(f"{gw.url}/v1/completions", json={**stream_body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"  # a pool with no live replica


def test_sighup_reload_keeps_a_stream_in_flight(replicas, gateway):
    pool = {"name": "a", "replicas": [replicas[0].url], "model": "tiny"}
    cfg = base_config([pool], [{"name": "tiny", "backends": [{"pool": "a"}]}])
    gw = gateway(cfg)
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as stream:
        chunks = stream.iter_raw()
        received = next(chunks)

        # a broken file is refused and changes nothing
        gw.config_path.write_text("pools: [\n")
        gw.popen.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        names = lambda: {m["id"] for m in httpx.get(f"{gw.url}/v1/models").json()["data"]}
        assert gw.alive() and names() == {"tiny"}
        assert "keeping the running config" in gw.log.read_text()
        # a good one is taken for new requests; the stream keeps its replica and its state
        new = {**cfg, "listen": {"host": "127.0.0.1", "port": gw.port}}
        new["models"] = [{"name": "tiny", "aliases": ["tiny-v2"], "backends": [{"pool": "a"}]}]
        gw.config_path.write_text(yaml.safe_dump(new))
        gw.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "tiny-v2" in names(), what="the reload")
        assert _gauge(gw.url, "inferd_gateway_replica_in_flight", replica=replicas[0].url) == 1
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": "tiny-v2", "prompt": [5], "max_tokens": 1})
        assert r.status_code == 200
        received += b"".join(chunks)
    events = [e for e in received.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all("error" not in json.loads(e[6:]) for e in events[:-1])
    assert _gauge(gw.url, "inferd_gateway_replica_in_flight", replica=replicas[0].url) == 0


def test_request_timeout_is_504_before_the_first_byte_and_an_sse_error_after(replicas, gateway):
    pool = {"name": "a", "replicas": [replicas[1].url], "model": "tiny"}
    gw = gateway(base_config([pool], [{"name": "tiny", "backends": [{"pool": "a"}]}], request_timeout_s=0.4))
    aborts_before = _aborts(replicas[1].url)
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 480, "ignore_eos": True}
    t = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t < 3

    r = httpx.post(f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert json.loads(events[-1][6:])["error"]["code"] == "timeout" and "data: [DONE]" not in events
    # the gateway closed both upstream requests: the replica aborted them instead of generating on
    wait_until(lambda: _aborts(replicas[1].url) == aborts_before + 2, timeout=5, what="two aborts on the replica")


def _aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(x.rsplit(" ", 1)[1])
        for x in text.splitlines()
        if x.startswith("inferd:request_success_total") and 'finished_reason="abort"' in x
    )
