"""The gateway's fleet dashboard (inferd/gateway/dashboard.py): its JSON through a real gateway and replicas,
who may see which tenant's budget, and the page in headless Chromium."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from tests.gateway.conftest import base_config, wait_until

pytestmark = pytest.mark.timeout(150)

OPERATOR = "sk-operator"


def _tenant(name: str, **limits) -> dict:
    return {"id": name, "api_key_sha256": [hashlib.sha256(f"sk-{name}".encode()).hexdigest()], "limits": limits}


def _auth(name: str) -> dict:
    return {"Authorization": f"Bearer sk-{name}"}


@pytest.fixture
def fleet_gateway(replicas, gateway, monkeypatch):
    monkeypatch.setenv("INFERD_GATEWAY_DASHBOARD_KEY_SHA256", hashlib.sha256(OPERATOR.encode()).hexdigest())
    tenants = [_tenant("alpha", requests=3, tokens={"total": 10_000}), _tenant("beta", max_concurrent=2)]
    config = base_config(
        [{"name": "a", "replicas": [r.url for r in replicas], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        tenants=tenants,
    )
    return gateway(config)


def test_fleet_snapshot_shows_replicas_affinity_budgets_and_rejections(fleet_gateway, replicas):
    url = fleet_gateway.url
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and "/dashboard/static/gateway.js" in page.text
    assert httpx.get(url + "/dashboard/static/gateway.js").status_code == 200
    assert httpx.get(url + "/dashboard/static/x.js").status_code == 404
    assert httpx.get(url + "/dashboard/fleet").status_code == 401
    assert httpx.get(url + "/dashboard/fleet", headers={"Authorization": "Bearer nope"}).status_code == 401

    prompt = list(range(5, 5 + 40))  # two full blocks: prefix affinity sends the repeats to one replica
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True}
    statuses = [httpx.post(url + "/v1/completions", json=body, headers=_auth("alpha"), timeout=60).status_code]
    statuses += [httpx.post(url + "/v1/completions", json=body, headers=_auth("alpha"), timeout=60).status_code]
    statuses += [httpx.post(url + "/v1/completions", json=body, headers=_auth("alpha"), timeout=60).status_code]
    statuses += [httpx.post(url + "/v1/completions", json=body, headers=_auth("alpha"), timeout=60).status_code]
    assert statuses == [200, 200, 200, 429]  # three requests a window

    def fleet(headers: dict) -> dict:
        r = httpx.get(url + "/dashboard/fleet", headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    wait_until(lambda: all(r["load_age_s"] is not None for r in fleet(_auth("alpha"))["replicas"]), 10, "a scrape")
    snap = fleet(_auth("alpha"))
    assert {r["url"] for r in snap["replicas"]} == {r.url for r in replicas}
    assert all(r["available"] and r["in_flight"] == 0 for r in snap["replicas"])
    assert sum(r["picks"] for r in snap["replicas"]) == 3
    assert all(r["kv_usage"] is not None for r in snap["replicas"])
    (pool,) = snap["pools"]
    assert pool["name"] == "a" and pool["prefix_blocks_hit"] >= 4 and pool["prefix_blocks_miss"] >= 2
    assert snap["requests_by_status"] == {"200": 3.0}  # a refusal is a rejection, not an answered request
    assert sum(snap["rejections"]["alpha"].values()) == 1
    # a tenant sees its own budget only: 3 of 3 requests used, the tokens of three requests
    (alpha,) = snap["tenants"]
    assert alpha["id"] == "alpha" and alpha["used"][0] == 3 and alpha["limits"][0] == 3
    assert alpha["used"][3] == 3 * (40 + 3) and alpha["reset_s"] > 0
    (beta,) = fleet(_auth("beta"))["tenants"]
    assert beta["id"] == "beta" and beta["reset_s"] is None and beta["max_concurrent"] == 2
    # the operator sees every tenant
    everyone = fleet({"Authorization": f"Bearer {OPERATOR}"})
    assert [t["id"] for t in everyone["tenants"]] == ["alpha", "beta"]


def test_gateway_page_in_a_browser(fleet_gateway, replicas):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{fleet_gateway.url}/dashboard?key=sk-alpha")
            page.wait_for_function("window.fleet.polls >= 2", timeout=20_000)
            assert page.inner_text("#conn") == "live"
            assert page.locator("#replicas tbody tr").count() == len(replicas)
            assert page.locator("#tenants tbody tr").count() == 1
            assert errors == []
        finally:
            browser.close()
