"""The FastAPI app: routes, life cycle (the AsyncEngine starts and stops with it), auth, errors."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.engine import Engine
from inferd.server.auth import BearerAuth
from inferd.server.chat import create_chat_completion
from inferd.server.completions import create_completion
from inferd.server.errors import APIError, install_error_handlers, model_not_found
from inferd.server.metrics import ServerMetrics
from inferd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from inferd.server.state import ServerSettings, ServerState


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; its step thread runs while the app's lifespan does."""
    metrics = ServerMetrics(settings.served_model_names[0])
    async_engine = AsyncEngine(engine, settings.max_waiting_requests)
    async_engine.hooks = metrics.attach(lambda: (async_engine.stats, async_engine.num_pending))
    state = ServerState(async_engine, settings, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        state.ready = True
        yield
        state.ready = False
        await async_engine.stop()

    app = FastAPI(title="inferd", version="0.1.0", lifespan=lifespan)
    app.state.inferd = state
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)

    def serving() -> ServerState:
        if not state.ready:
            raise APIError(503, "the model is still loading", "server_error", code="loading")
        return state

    @app.get("/health")
    async def health() -> Response:
        if async_engine.dead is not None:
            return JSONResponse({"status": "error", "error": str(async_engine.dead)}, status_code=500)
        if not state.ready or not async_engine.accepting:
            return JSONResponse({"status": "draining" if state.ready else "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, root=settings.model_root, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in settings.served_model_names])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in settings.served_model_names:
            raise model_not_found(model_id, state.model_name)
        return card(model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving(), body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving(), body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        st = serving()
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = st.apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            tokens = st.encode(body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=st.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        st = serving()
        st.check_model(body.model)
        return DetokenizeResponse(prompt=st.decode(body.tokens))

    return app
