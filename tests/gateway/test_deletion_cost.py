"""Cache-aware scale-down on Kubernetes: the gateway patches each replica pod's pod-deletion-cost to what its cache
serves. No cluster here: an HTTP server on loopback answers the two Kubernetes API calls the gateway makes (list
pods, merge-patch one), as the API server does, and records the patches."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from inferd.gateway.config import DeletionCostConfig
from inferd.gateway.deletion_cost import ANNOTATION, DeletionCosts, changed_enough, cost_of
from inferd.gateway.replicas import Replica
from tests.gateway.conftest import wait_until
from tests.net import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def api_server():
    """Pods of namespace `ns`: three engine pods and one of something else; patches are applied and recorded."""
    pods = {
        "engine-a": {"ip": "10.0.0.1", "labels": {"app.kubernetes.io/component": "engine"}, "annotations": {}},
        "engine-b": {"ip": "10.0.0.2", "labels": {"app.kubernetes.io/component": "engine"}, "annotations": {}},
        "engine-c": {"ip": "10.0.0.3", "labels": {"app.kubernetes.io/component": "engine"}, "annotations": {}},
        "other": {"ip": "10.0.0.9", "labels": {"app": "other"}, "annotations": {}},
    }
    patches: list[tuple[str, str, dict]] = []
    app = FastAPI()

    @app.get("/api/v1/namespaces/ns/pods")
    async def list_pods(labelSelector: str = ""):  # noqa: N803 (the API's parameter name)
        want = dict(kv.split("=", 1) for kv in labelSelector.split(",") if kv)
        items = [
            {"metadata": {"name": n, "labels": p["labels"], "annotations": dict(p["annotations"])},
             "status": {"podIP": p["ip"]}}
            for n, p in pods.items()
            if all(p["labels"].get(k) == v for k, v in want.items())
        ]  # fmt: skip
        return {"kind": "PodList", "items": items}

    @app.patch("/api/v1/namespaces/ns/pods/{name}")
    async def patch_pod(name: str, request: Request):
        body = await request.json()
        patches.append((name, request.headers["content-type"], body))
        pods[name]["annotations"].update(body["metadata"]["annotations"])
        return {"metadata": {"name": name}}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the API server")
    yield f"http://127.0.0.1:{port}", pods, patches
    server.should_exit = True
    thread.join(10)


def _replica(ip: str, worth: int) -> Replica:
    r = Replica(f"http://{ip}:8000", "p")
    r.cache_worth = worth
    return r


def test_pods_get_their_cache_value_as_deletion_cost(api_server):
    url, pods, patches = api_server
    config = DeletionCostConfig(
        enabled=True,
        api_server=url,
        namespace="ns",
        label_selector="app.kubernetes.io/component=engine",
        token_file=None,
        ca_file=None,
        interval_s=1,
    )
    costs = DeletionCosts(config)
    now = time.monotonic()
    replicas = [_replica("10.0.0.1", 2500), _replica("10.0.0.2", 0), _replica("10.9.9.9", 7000)]

    async def run():
        await costs.tick(replicas, now)
        await costs.tick(replicas, now + 0.5)  # within interval_s: nothing
        replicas[0].cache_worth += 16  # a hair more: not worth a patch
        await costs.tick(replicas, now + 2)
        await costs.close()

    asyncio.run(run())
    assert pods["engine-a"]["annotations"] == {ANNOTATION: "2500"}
    assert pods["engine-b"]["annotations"] == {ANNOTATION: "0"}
    assert pods["engine-c"]["annotations"] == {} and pods["other"]["annotations"] == {}  # no replica of the gateway's
    assert len(patches) == 2 and {p[1] for p in patches} == {"application/merge-patch+json"}


def test_an_unreachable_api_server_is_logged_not_raised(caplog):
    config = DeletionCostConfig(enabled=True, api_server=f"http://127.0.0.1:{free_port()}", namespace="ns",
                                token_file=None, ca_file=None)  # fmt: skip
    costs = DeletionCosts(config)
    asyncio.run(costs.tick([_replica("10.0.0.1", 1000)], 0.0))
    assert "pod deletion costs not updated" in caplog.text


def test_cost_rounding_and_hysteresis():
    assert cost_of(0.0) == 0 and cost_of(1234.4) == 1234 and cost_of(1e12) == 2**31 - 1
    assert changed_enough(None, 0) and not changed_enough(1000, 1090) and changed_enough(1000, 1200)
