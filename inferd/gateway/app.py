"""The gateway's FastAPI app: the OpenAI routes it proxies, `/v1/models`, `/health` and `/metrics`.

Everything a route does is in `service.Gateway`; this file only wires paths to it and maps every
exception to an OpenAI error body (errors.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferd.gateway.dashboard import install_dashboard
from inferd.gateway.errors import install_error_handlers, model_not_found
from inferd.gateway.service import Gateway


def create_app(gateway: Gateway, on_startup: Callable[[], None] | None = None) -> FastAPI:
    """`on_startup` runs on the event loop once it serves (the CLI installs its SIGHUP handler there)."""
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        if on_startup is not None:
            on_startup()
        yield
        await gateway.stop()

    app = FastAPI(title="inferd gateway", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)
    install_dashboard(app, gateway)  # GET /dashboard: the fleet page (dashboard.py)

    @app.get("/health")
    async def health() -> Response:
        now = time.monotonic()
        pools = {
            name: sum(r.available(now) for r in pool.replicas.values()) for name, pool in gateway.state.pools.items()
        }
        ok = any(pools.values())
        return JSONResponse({"status": "ok" if ok else "no_replica", "pools": pools}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "inferd-gateway"}

    @app.get("/v1/models")
    async def list_models(raw: Request) -> dict:
        gateway.state.authenticate(raw.headers.get("authorization"))
        return {"object": "list", "data": [card(n) for n in gateway.state.router.names()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, raw: Request) -> dict:
        gateway.state.authenticate(raw.headers.get("authorization"))
        if gateway.state.router.resolve(model_id) is None:
            raise model_not_found(model_id, gateway.state.router.names())
        return card(model_id)

    # plain Starlette routes: the gateway reads its own bodies, so FastAPI's per-request parameter solving
    # would be pure cost on the proxied path
    async def completions(raw: Request) -> Response:
        return await gateway.handle("completions", raw)

    async def chat_completions(raw: Request) -> Response:
        return await gateway.handle("chat", raw)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    return app
