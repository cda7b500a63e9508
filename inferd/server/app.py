"""The FastAPI app: routes, life cycle (the AsyncEngine starts and stops with it), auth, limits, errors.

What a client can count on for bad input (status codes, the error body, the limits) is written down in
docs/hardening.md; the OpenAPI schema at /openapi.json declares every status a route answers with.
"""

from __future__ import annotations

import asyncio
import gc
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.engine import Engine
from inferd.prefix_hash import HASH_ROOT, HASH_SCHEME
from inferd.server.auth import BearerAuth
from inferd.server.body import BodyLimit, CheckedRoute
from inferd.server.chat import create_chat_completion
from inferd.server.completions import create_completion
from inferd.server.dashboard import DashboardHub, install_dashboard
from inferd.server.errors import APIError, install_error_handlers
from inferd.server.metrics import ServerMetrics
from inferd.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    KVEventsInfo,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from inferd.server.state import ServerSettings, ServerState, public_root
from inferd.server.vllm_metrics import exposition_registry
from inferd.tracing import RequestTracer, make_tracer, wrap_abort, wrap_hook


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse} for s in statuses}


def _sse(model) -> dict:
    """A 200 that is JSON, or a text/event-stream when the request asks to stream (its events: see _sse_event)."""
    return {200: {"content": {"text/event-stream": {"schema": _sse_event(model)}}, "description": "OK"}}


def _sse_event(model) -> dict:
    """One server-sent event (OpenAPI 3.1 reads `schema` as describing each event): its data is a `model` chunk,
    an error body (an error after the stream began) or the closing [DONE]."""
    ref = "#/components/schemas/{}"
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": ref.format(model.__name__)}, {"$ref": ref.format("ErrorResponse")}]},
    }
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _freeze_startup_heap() -> None:
    """Move everything alive at start-up (torch, transformers, the model, the tokenizer: ~230k objects) out of the
    garbage collector's reach, as vLLM's API server does. A full collection walks every tracked object with the GIL
    held, so it stalls the event loop: ~90 ms here for the start-up heap alone, up to 0.4-0.5 s in a process with
    more on its heap (the test suite's). Frozen, an oldest-generation collection walks only what was created since.
    """
    gc.collect()
    gc.freeze()


def cache_config_labels(engine: Engine) -> dict[str, str]:
    """The labels of `cache_config_info`, under vLLM's names (its CPU backend too calls its KV blocks
    num_gpu_blocks), and the dtype the cache stores."""
    cache = engine.config.cache
    return {
        "block_size": str(engine.kv.block_size),
        "cache_dtype": cache.kv_cache_dtype,
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "num_gpu_blocks": str(engine.kv.num_blocks),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
    }


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """An app serving `engine`; its step thread runs while the app's lifespan does."""
    metrics = ServerMetrics(
        settings.served_model_names[0], settings.ttft_buckets, settings.itl_buckets, cache_config_labels(engine)
    )
    exposed = exposition_registry(metrics.registry, settings.metrics_names)
    async_engine = AsyncEngine(engine, settings.max_waiting_requests)
    async_engine.hooks = metrics.attach(lambda: (async_engine.stats, async_engine.num_pending))
    tracer = None
    if settings.otlp_traces_endpoint:  # a span per request (inferd/tracing.py), ended from the step hook
        tracer = RequestTracer(*make_tracer("inferd", settings.otlp_traces_endpoint), settings.served_model_names[0])
        hooks = async_engine.hooks
        hooks.on_step, hooks.on_abort = wrap_hook(hooks.on_step, tracer), wrap_abort(hooks.on_abort, tracer)
    state = ServerState(
        async_engine,
        settings,
        metrics,
        engine.tokenizer,
        engine.max_model_len,
        engine.vocab_size,
        model_type=engine.model_type,
        tracer=tracer,
    )
    dashboard = DashboardHub(engine, async_engine, settings.served_model_names[0]) if settings.dashboard else None
    created = int(time.time())
    root = public_root(settings.model_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        _freeze_startup_heap()
        async_engine.start()
        if dashboard is not None:
            dashboard.start()
        state.loop = asyncio.get_running_loop()
        state.ready = True
        yield
        state.ready = False
        if dashboard is not None:
            await dashboard.stop()
        await async_engine.stop()
        if tracer is not None:
            tracer.shutdown()  # what is queued goes out
        gc.unfreeze()

    app = FastAPI(title="inferd", version="0.1.0", lifespan=lifespan)
    app.router.route_class = CheckedRoute
    app.state.inferd = state
    install_error_handlers(app)
    # the outermost middleware runs first: auth answers 401 before a body is read, then the size cap
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    _precise_openapi(app)
    if dashboard is not None:
        install_dashboard(app, dashboard)
    auth = (401,) if settings.api_key else ()

    def serving() -> ServerState:
        if not state.ready:
            raise APIError(503, "the model is still loading", "server_error", code="loading")
        return state

    @app.head("/health", operation_id="health_head", responses={503: {"model": HealthResponse}})
    @app.get("/health", operation_id="health", responses={503: {"model": HealthResponse}})
    async def health() -> HealthResponse:
        if async_engine.dead is not None:
            return JSONResponse({"status": "error", "error": str(async_engine.dead)}, status_code=500)
        if not state.ready or not async_engine.accepting:
            return JSONResponse({"status": "draining" if state.ready else "loading"}, status_code=503)
        return HealthResponse(status="ok")

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus() -> Response:
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_events", responses=_errors(*auth))
    async def kv_events() -> KVEventsInfo:
        """Where the KV cache events are published (`--kv-events-config`), for routers that subscribe."""
        if engine.kv_events is not None:
            return KVEventsInfo(**engine.kv_events.info())
        return KVEventsInfo(
            enabled=False, block_size=engine.kv.block_size, hash=HASH_SCHEME, hash_root=HASH_ROOT.decode()
        )

    def card(name: str) -> ModelCard:
        dtype, quant = engine.dtype_choice.name, engine.quantization
        adapter = state.adapter(name) if name not in settings.served_model_names else None
        return ModelCard(
            id=name,
            created=created,
            root=root if adapter is None else public_root(str(adapter.path)),
            parent=None if adapter is None else state.model_name,
            max_model_len=engine.max_model_len,
            dtype=dtype,
            quantization=quant,
        )

    @app.get("/v1/models", responses=_errors(*auth))
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in [*settings.served_model_names, *state.adapter_names()]])

    @app.get("/v1/models/{model_id:path}", responses=_errors(*auth, 404))
    async def get_model(model_id: str) -> ModelCard:
        state.check_model(model_id)
        return card(model_id)

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=_errors(400, *auth, 503))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's API: serve a PEFT adapter as a model from now on (checked against the base model first)."""
        st = serving()
        if engine.lora is None:
            raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora", param="lora_name")
        if body.lora_name in settings.served_model_names:
            raise APIError(400, f"`{body.lora_name}` is the base model's name", param="lora_name")
        if st.adapter(body.lora_name) is not None and not body.load_inplace:
            raise APIError(
                400,
                f"the LoRA adapter `{body.lora_name}` is already loaded (send load_inplace: true to replace it)",
                param="lora_name",
                code="adapter_exists",
            )
        await st.async_engine.call(lambda: engine.add_lora(body.lora_name, body.lora_path))
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=_errors(400, *auth, 404, 503))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        st = serving()
        await st.async_engine.call(lambda: engine.remove_lora(body.lora_name))
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_sse(CompletionResponse), **_errors(400, *auth, 404, 413, 503)},
    )
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving(), body, raw)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_sse(ChatCompletionChunk), **_errors(400, *auth, 404, 413, 503)},
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving(), body, raw)

    @app.post("/tokenize", responses=_errors(400, *auth, 404, 413, 503))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        st = serving()
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tools = st.tool_plan(body.tools, body.tool_choice)
            tokens = await st.apply_chat_template(body.messages, body.add_generation_prompt, tools=tools)
        else:
            tokens = await st.encode_async(body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=st.max_model_len, tokens=tokens)

    @app.post("/detokenize", responses=_errors(400, *auth, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        st = serving()
        st.check_model(body.model)
        return DetokenizeResponse(prompt=await st.decode_async(body.tokens))

    return app


def _precise_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; this server answers 400 with ErrorResponse instead (OpenAI's)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            # the stream chunk models appear only inside event schemas, which FastAPI does not look into
            for model in (CompletionResponse, ChatCompletionChunk, ErrorResponse):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components.setdefault(model.__name__, body)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
