"""The gateway's fleet dashboard: GET /dashboard (a static page) and GET /dashboard/fleet (its JSON, polled).

One snapshot of what the gateway knows, read without touching the request path: every pool's replicas
(health, the gateway's own in-flight count, the load each replica's /metrics last reported, how often
the picker chose it), prefix-affinity hits and misses per pool, the admission queue, the requests
answered and refused (by tenant, by reason), and each tenant's budget window (used against limits).
Counters come from the gateway's Prometheus registry, so the page and /metrics always agree.

Access: the page and its script are open (they hold no data). The snapshot follows the API's rule: with
no tenants configured it is open; with tenants it needs a tenant's key and shows the fleet with that
tenant's budget only; an operator key, given as the sha256 hex digest of a key in the environment
variable INFERD_GATEWAY_DASHBOARD_KEY_SHA256, sees every tenant.
"""

from __future__ import annotations

import hmac
import os
import time
from collections import defaultdict
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from inferd.gateway.budget import DIMENSIONS, MemoryBudgetStore, RedisBudgetStore, limit_vector
from inferd.gateway.config import TenantConfig
from inferd.gateway.errors import GatewayError
from inferd.gateway.service import Gateway, key_digest

OPERATOR_ENV = "INFERD_GATEWAY_DASHBOARD_KEY_SHA256"
STATIC = {"gateway.js": "text/javascript", "gateway.css": "text/css"}


def _samples(registry, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` in a Prometheus registry."""
    return [(s.labels, s.value) for family in registry.collect() for s in family.samples if s.name == name]


def _by(samples: list[tuple[dict[str, str], float]], *keys: str) -> dict:
    """Sum sample values by the given label keys (one key: a flat dict; more: nested)."""
    out: dict = defaultdict(float) if len(keys) == 1 else defaultdict(lambda: defaultdict(float))
    for labels, value in samples:
        if len(keys) == 1:
            out[labels.get(keys[0], "")] += value
        else:
            out[labels.get(keys[0], "")][labels.get(keys[1], "")] += value
    return {k: (dict(v) if isinstance(v, defaultdict) else v) for k, v in out.items()}


def fleet_replicas(gateway: Gateway) -> list[dict[str, Any]]:
    now = time.monotonic()
    st = gateway.state
    stale = st.config.scrape.stale_after_s
    picks = _by(_samples(gateway.metrics.registry, "inferd_gateway_routing_decisions_total"), "replica")
    out = []
    for pool in st.pools.values():
        for r in pool.replicas.values():
            load = r.fresh_load(now, stale)
            out.append(
                {
                    "pool": pool.name,
                    "url": r.url,
                    "available": r.available(now),
                    "healthy": r.healthy,
                    "ejected_for_s": round(max(0.0, r.ejected_until - now), 1),
                    "in_flight": r.in_flight,
                    "in_flight_tokens": r.in_flight_tokens,
                    "picks": picks.get(r.url, 0.0),
                    "load_age_s": round(now - r.load.at, 2) if r.load is not None else None,
                    "running": load.running if load else None,
                    "waiting": load.waiting if load else None,
                    "kv_usage": load.kv_usage if load else None,
                    "prefix_hit_rate": load.prefix_hits / load.prefix_queries if load and load.prefix_queries else None,
                }
            )
    return out


async def tenant_budget(gateway: Gateway, tenant: TenantConfig) -> dict[str, Any]:
    """The tenant's current window: used and limit per dimension (-1: no limit), seconds to reset."""
    limits = tenant.limits
    window_s = limits.window_s
    used, start = [0.0] * len(DIMENSIONS), None
    store = gateway.budgets
    if isinstance(store, MemoryBudgetStore):
        w = store._windows.get(tenant.id)  # read only: the store has no public reader
        if w is not None:
            used, start = list(w.used), w.start
    elif isinstance(store, RedisBudgetStore):
        fields = await store.window(tenant.id)
        if "start" in fields:
            start = fields["start"] / 1000  # the window's start in Redis's clock, ms
            used = [fields.get(f"d{i + 1}", 0.0) for i in range(len(DIMENSIONS))]
    now = time.time()
    open_ = start is not None and now < start + window_s
    return {
        "id": tenant.id,
        "priority": tenant.priority,
        "in_flight": gateway.queue.in_flight.get(tenant.id, 0),
        "window_s": window_s,
        "reset_s": round(start + window_s - now, 1) if open_ else None,
        "dimensions": list(DIMENSIONS),
        "used": used if open_ else [0.0] * len(DIMENSIONS),
        "limits": limit_vector(limits),
        "max_concurrent": limits.max_concurrent,
    }


async def fleet_snapshot(gateway: Gateway, tenants: list[TenantConfig]) -> dict[str, Any]:
    reg = gateway.metrics.registry
    st = gateway.state
    affinity = _by(_samples(reg, "inferd_gateway_prefix_affinity_blocks_total"), "pool", "result")
    return {
        "ts": time.time(),
        "models": st.router.names(),
        "pools": [
            {
                "name": p.name,
                "model": p.config.model,
                "replicas": len(p.replicas),
                "prefix_blocks_hit": affinity.get(p.name, {}).get("hit", 0.0),
                "prefix_blocks_miss": affinity.get(p.name, {}).get("miss", 0.0),
            }
            for p in st.pools.values()
        ],
        "replicas": fleet_replicas(gateway),
        "queue": {"size": len(gateway.queue), "max_size": gateway.queue.max_size},
        "requests_by_status": _by(_samples(reg, "inferd_gateway_requests_total"), "status"),
        "requests_by_tenant": _by(_samples(reg, "inferd_gateway_requests_total"), "tenant"),
        "rejections": _by(_samples(reg, "inferd_gateway_rejections_total"), "tenant", "reason"),
        "retries": sum(v for _, v in _samples(reg, "inferd_gateway_retries_total")),
        "upstream_errors": _by(_samples(reg, "inferd_gateway_upstream_errors_total"), "kind"),
        "tenants": [await tenant_budget(gateway, t) for t in tenants],
    }


def visible_tenants(gateway: Gateway, authorization: str | None) -> list[TenantConfig]:
    """Which tenants' budgets the caller may see (raises 401 where the API would)."""
    st = gateway.state
    operator = os.environ.get(OPERATOR_ENV, "").strip().lower()
    scheme, _, key = (authorization or "").strip().partition(" ")
    is_bearer = scheme.lower() == "bearer" and key.strip()
    if operator and is_bearer and hmac.compare_digest(key_digest(key.strip()), operator):
        return list(st.config.tenants)
    tenant = st.authenticate(authorization)
    return list(st.config.tenants) if tenant is None else [tenant]


def _static(name: str) -> bytes:
    return resources.files("inferd.gateway").joinpath("static", name).read_bytes()


def install_dashboard(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(_static("gateway.html"), media_type="text/html; charset=utf-8")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC:
            raise GatewayError(404, f"no dashboard file {name!r}", "not_found_error", code="not_found")
        return Response(_static(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/fleet", include_in_schema=False)
    async def dashboard_fleet(raw: Request) -> Response:
        tenants = visible_tenants(gateway, raw.headers.get("authorization"))
        return JSONResponse(await fleet_snapshot(gateway, tenants), headers={"Cache-Control": "no-store"})
