"""Saturation and tenancy through a real gateway and replica: requests wait at the gateway and are admitted by
priority; a tenant that isolates its cache gets its id as cache_salt, so the replica shares no prefix with it."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.conftest import base_config, wait_until
from tests.gateway.procs import replica_metrics

pytestmark = pytest.mark.timeout(120)


def _tenant(name: str, **extra) -> dict:
    return {"id": name, "api_key_sha256": [hashlib.sha256(f"sk-{name}".encode()).hexdigest()], **extra}


def _headers(name: str) -> dict:
    return {"Authorization": f"Bearer sk-{name}"}


def _queued(gw_url: str) -> float:
    line = next(
        x for x in httpx.get(f"{gw_url}/metrics").text.splitlines() if x.startswith("inferd_gateway_queue_size")
    )
    return float(line.rsplit(" ", 1)[1])


def test_saturated_pool_queues_at_the_gateway_and_admits_by_priority(replicas, gateway):
    tenants = [_tenant("low", priority=0), _tenant("high", priority=10)]
    cfg = base_config(
        [{"name": "a", "replicas": [replicas[0].url], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        tenants=tenants,
        routing={"saturation": {"max_in_flight": 1}, "scorers": {"prefix": 0}},
        health={"interval_s": 0.2, "timeout_s": 5, "failures_to_eject": 3},  # a frozen replica stays in
    )
    gw = gateway(cfg)
    long = {"model": "tiny", "prompt": [5, 6], "max_tokens": 100, "ignore_eos": True, "stream": True}
    short = {"model": "tiny", "prompt": [7, 8], "max_tokens": 2}
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, tenant: str) -> int:
        r = httpx.post(f"{gw.url}/v1/completions", json=short, headers=_headers(tenant), timeout=60)
        with lock:
            finished.append(name)
        return r.status_code

    with httpx.stream("POST", f"{gw.url}/v1/completions", json=long, headers=_headers("low"), timeout=60) as s:
        chunks = s.iter_raw()
        next(chunks)  # the one slot is taken
        # freeze the replica, so the stream holds the slot however fast the tiny model generates
        os.kill(replicas[0].popen.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(3) as ex:
            try:
                futures = [ex.submit(send, "low-1", "low")]
                wait_until(lambda: _queued(gw.url) == 1, what="low-1 queued")
                futures.append(ex.submit(send, "low-2", "low"))
                wait_until(lambda: _queued(gw.url) == 2, what="low-2 queued")
                futures.append(ex.submit(send, "high", "high"))
                wait_until(lambda: _queued(gw.url) == 3, what="high queued")
                assert finished == []
            finally:
                os.kill(replicas[0].popen.pid, signal.SIGCONT)
            b"".join(chunks)  # the long stream ends: the slot frees
            assert [f.result() for f in futures] == [200, 200, 200]
    assert finished == ["high", "low-1", "low-2"]


def test_isolated_tenant_gets_its_own_cache_salt(replicas, gateway):
    tenants = [_tenant("shared-1"), _tenant("shared-2"), _tenant("private", isolate_cache=True)]
    cfg = base_config(
        [{"name": "a", "replicas": [replicas[1].url], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        tenants=tenants,
    )
    gw = gateway(cfg)
    prompt = [random.randrange(10, 380) for _ in range(65)]  # 4 full blocks, new to the replica's cache

    def hits_after(tenant: str) -> float:
        before = replica_metrics(replicas[1].url)["inferd:prefix_cache_hits_total"]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        assert httpx.post(f"{gw.url}/v1/completions", json=body, headers=_headers(tenant)).status_code == 200
        return replica_metrics(replicas[1].url)["inferd:prefix_cache_hits_total"] - before

    assert hits_after("shared-1") == 0
    assert hits_after("shared-2") == 64  # tenants that do not isolate share the prefix
    assert hits_after("private") == 0  # salted with its id: no block in common
    assert hits_after("private") == 64  # but it shares with itself


def test_a_request_queued_past_max_wait_s_is_503_with_retry_after(replicas, gateway):
    max_wait = 0.3
    cfg = base_config(
        [{"name": "a", "replicas": [replicas[0].url], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        routing={"saturation": {"max_in_flight": 1}, "scorers": {"prefix": 0}, "queue": {"max_wait_s": max_wait}},
        health={"interval_s": 0.2, "timeout_s": 5, "failures_to_eject": 3},  # a frozen replica stays in
    )
    gw = gateway(cfg)
    long = {"model": "tiny", "prompt": [5, 6], "max_tokens": 100, "ignore_eos": True, "stream": True}
    short = {"model": "tiny", "prompt": [7, 8], "max_tokens": 2}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=long, timeout=60) as s:
        chunks = s.iter_raw()
        next(chunks)  # the one slot is taken
        # freeze the replica, so the stream holds the slot however fast the tiny model generates
        os.kill(replicas[0].popen.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            r = httpx.post(f"{gw.url}/v1/completions", json=short, timeout=30)
            waited = time.monotonic() - t
        finally:
            os.kill(replicas[0].popen.pid, signal.SIGCONT)
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "queue_timeout" and err["type"] == "server_error" and "max_wait_s" in err["message"]
    assert r.headers["Retry-After"] == "1"
    assert max_wait <= waited < max_wait + 1.5, waited
    assert httpx.post(f"{gw.url}/v1/completions", json=short, timeout=30).status_code == 200  # the slot is free
