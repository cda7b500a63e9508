"""`inferd disagg proxy`: one OpenAI endpoint in front of a prefill pool and a decode pool.

Each completion or chat request goes first to the least-loaded prefill instance as a one-token,
non-streaming request with `kv_transfer_params: {"do_remote_decode": true}`; its answer carries the
signed lease on the prompt's blocks. The original request then goes to the least-loaded decode instance
with those `kv_transfer_params`, and the decode's answer (a stream or one body) goes back to the client
byte for byte, so streaming behaves exactly as the server's.

The HTTP edge is the gateway's: its pool type (`inferd.gateway.replicas`), its request parsing and
OpenAI error bodies, the headers it passes on and its SSE relay (`inferd.gateway.proxy`), so the two
front doors answer alike.

Failures: a prefill that cannot be reached, answers 5xx or times out is skipped and the decode instance
prefills itself (a *local prefill*); a 4xx from the prefill instance is the client's error and goes back
unchanged. A decode instance that cannot be reached answers 502 with an OpenAI error body; one that
breaks mid-stream ends the stream with one SSE error event (`stream_broken`) and no `[DONE]`, as the
gateway's streams end.

With `--decider cost` the proxy predicts, per request, whether prefilling on the decode instance is
faster than the handoff: the prompt's tokens over the decode pool's measured prefill rate against the
prefill pool's queue wait plus its prefill time plus the measured transfer overhead (all running
averages of what the proxy saw).

The pools are fixed URL lists, or list files (`--prefill-file`, `--decode-file`, one URL a line) read
again whenever they change, checked on every pick (one `stat`): `inferd up` lists a replica there once it
is ready and unlists it before it stops, so the proxy follows both pools as they scale. A list may be
empty: with no prefill instance every request prefills on its decode instance (`no_prefill_instance`);
with no decode instance a request waits up to `--decode-wait` seconds for one to be listed, then gets 503.

This module runs beside any server speaking the protocol: it imports no engine, model or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferd.gateway.errors import GatewayError, parse_json_body
from inferd.gateway.proxy import ClosingStream, SSEFilter, passed_headers, relay_sse
from inferd.gateway.replicas import Replica, Replicas

logger = logging.getLogger(__name__)


@dataclass
class ProxySettings:
    prefill: list[str]
    decode: list[str]
    api_key: str | None = None
    prefill_timeout: float = 60.0
    decider: str = "always"  # always | cost
    prefill_file: str | None = None  # a list file followed as it changes (instead of `prefill`)
    decode_file: str | None = None
    decode_wait: float = 30.0  # seconds a request waits for a decode instance when none is listed


class Pool(Replicas):
    """Least-loaded choice over the front doors' pool: fewest requests in flight, then the least picked.

    With `file`, the instances are the URLs listed there, read again when the file changes: an instance
    that stays keeps its counters, one that leaves is no longer picked (the requests it has in flight
    finish on it).
    """

    def __init__(self, urls: list[str], file: str | Path | None = None, on_change=None, name: str = ""):
        super().__init__(name, urls, file, on_change)

    @property
    def instances(self) -> list[Replica]:
        return list(self.replicas.values())

    def refresh(self) -> None:
        if self.refresh_discovery():
            logger.info("%s: now %s", self.file.path, list(self.replicas))

    def pick(self) -> Replica | None:
        self.refresh()
        if not self.replicas:
            return None
        inst = min(self.replicas.values(), key=lambda i: (i.in_flight, i.picks))
        inst.picks += 1
        return inst


@dataclass
class Ewma:
    value: float | None = None
    alpha: float = 0.2

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass
class CostModel:
    """Running measurements for the cost-based decider (seconds per token, seconds per request)."""

    remote_prefill_per_token: Ewma = field(default_factory=Ewma)  # prefill round trip / prompt tokens
    local_prefill_per_token: Ewma = field(default_factory=Ewma)  # decode TTFT of local prefills / prompt tokens
    handoff_overhead: Ewma = field(default_factory=Ewma)  # decode TTFT after a remote prefill

    def prefer_local(self, prompt_tokens: int, prefill_queue: int) -> bool:
        """Local when predicted faster; with no measurement yet, remote (which measures it)."""
        local, remote = self.local_prefill_per_token.value, self.remote_prefill_per_token.value
        if local is None or remote is None or self.handoff_overhead.value is None:
            return False
        remote_time = (prefill_queue + 1) * remote * prompt_tokens + self.handoff_overhead.value
        return local * prompt_tokens < remote_time


class ProxyMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("inferd:disagg_proxy_requests", "Requests by endpoint.", ["endpoint"], registry=r)
        self.prefills = Counter(
            "inferd:disagg_proxy_prefills", "Prefills by where they ran and why.", ["where", "reason"], registry=r
        )
        self.prefill_seconds = Histogram(
            "inferd:disagg_proxy_prefill_seconds", "Round trip of the remote prefill.", registry=r
        )
        self.instances = Gauge("inferd:disagg_proxy_instances", "Instances listed, by pool.", ["pool"], registry=r)


class Proxy:
    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.metrics = ProxyMetrics()
        gauge = self.metrics.instances
        self.prefill = Pool(settings.prefill, settings.prefill_file, gauge.labels("prefill").set, "prefill")
        self.decode = Pool(settings.decode, settings.decode_file, gauge.labels("decode").set, "decode")
        gauge.labels("prefill").set(len(self.prefill.instances))
        gauge.labels("decode").set(len(self.decode.instances))
        self.cost = CostModel()
        self.client: httpx.AsyncClient | None = None

    def headers(self, raw: Request) -> dict[str, str]:
        out = {"content-type": "application/json"}
        auth = f"Bearer {self.settings.api_key}" if self.settings.api_key else raw.headers.get("authorization")
        if auth:
            out["authorization"] = auth
        return out

    # -- the two legs --------------------------------------------------------------------------------
    async def remote_prefill(self, path: str, body: dict, headers: dict) -> tuple[dict | None, Response | None, str]:
        """(kv_transfer_params, None, "") on success; (None, response, "") for a 4xx to pass through;
        (None, None, reason) when the decode instance should prefill itself."""
        inst = self.prefill.pick()
        if inst is None:
            return None, None, "no_prefill_instance"
        inst.in_flight += 1
        t0 = time.monotonic()
        try:
            resp = await self.client.post(
                inst.url + path, json=_prefill_body(body), headers=headers, timeout=self.settings.prefill_timeout
            )
        except httpx.TimeoutException:
            return None, None, "prefill_timeout"
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s failed: %s; prefilling on the decode instance", inst.url, e)
            return None, None, "prefill_unreachable"
        finally:
            inst.in_flight -= 1
        elapsed = time.monotonic() - t0
        if resp.status_code >= 500:
            logger.warning(
                "prefill instance %s answered %d; prefilling on the decode instance", inst.url, resp.status_code
            )
            return None, None, f"prefill_{resp.status_code}"
        if resp.status_code != 200:
            return None, _passthrough(resp), ""
        try:
            answer = resp.json()
        except ValueError:
            return None, None, "prefill_bad_answer"
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            return None, None, "prefill_no_params"
        self.metrics.prefill_seconds.observe(elapsed)
        prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens") or 0
        if prompt_tokens:
            self.cost.remote_prefill_per_token.add(elapsed / prompt_tokens)
        return kv, None, ""

    async def handle(self, path: str, raw: Request) -> Response:
        self.metrics.requests.labels(path).inc()
        try:
            body = parse_json_body(await raw.body())
        except GatewayError as e:
            return e.response()
        if not await self.wait_for_decode():  # before a prefill whose lease nobody would collect
            return _no_decode()
        headers = self.headers(raw)
        kv, early, reason = None, None, "cost"
        if not self._decide_local(body):
            kv, early, reason = await self.remote_prefill(path, body, headers)
            if early is not None:
                return early
        self.metrics.prefills.labels("remote" if kv else "local", reason or "handoff").inc()
        decode_body = {**body, "kv_transfer_params": kv}
        if kv is None:
            decode_body.pop("kv_transfer_params")
        return await self.forward_decode(path, decode_body, headers, remote=kv is not None)

    def _decide_local(self, body: dict) -> bool:
        if self.settings.decider != "cost":
            return False
        tokens = _rough_prompt_tokens(body)
        return self.cost.prefer_local(tokens, self.prefill.in_flight)

    async def forward_decode(self, path: str, body: dict, headers: dict, remote: bool) -> Response:
        if not body.get("stream"):
            return await self._decode_once(path, body, headers, remote)
        inst = await self.decode_instance()
        if inst is None:
            return _no_decode()
        inst.in_flight += 1
        t0 = time.monotonic()
        request = self.client.build_request("POST", inst.url + path, json=body, headers=headers, timeout=None)
        try:
            resp = await self.client.send(request, stream=True)
            if resp.status_code != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
                try:  # an answer that is not a stream (a refusal) is read whole and passed on
                    await resp.aread()
                finally:
                    await resp.aclose()
        except httpx.HTTPError as e:
            inst.in_flight -= 1
            return _decode_failed(e)
        if resp.is_closed:
            inst.in_flight -= 1
            self._measure(time.monotonic() - t0, remote, body)
            return _passthrough(resp)

        async def on_close() -> None:
            inst.in_flight -= 1
            await resp.aclose()

        def on_broken(kind: str) -> None:
            logger.warning("decode instance %s failed mid-answer: %s", inst.url, kind)

        events = relay_sse(
            resp.aiter_raw(),
            SSEFilter(forced_usage=False),
            lambda: self._measure(time.monotonic() - t0, remote, body),
            on_broken,
            (httpx.HTTPError,),
            source="the decode instance",
        )
        resp_headers = passed_headers(resp.headers)
        resp_headers.pop("content-type", None)
        return ClosingStream(events, on_close, resp_headers)

    async def _decode_once(self, path: str, body: dict, headers: dict, remote: bool) -> Response:
        """A non-streaming answer, read whole first: a decode instance dying mid-answer is a clear 502."""
        inst = await self.decode_instance()
        if inst is None:
            return _no_decode()
        inst.in_flight += 1
        t0 = time.monotonic()
        try:
            resp = await self.client.post(inst.url + path, json=body, headers=headers, timeout=None)
        except httpx.HTTPError as e:
            return _decode_failed(e)
        finally:
            inst.in_flight -= 1
        self._measure(time.monotonic() - t0, remote, body)
        return _passthrough(resp)

    def _measure(self, ttfb: float, remote: bool, body: dict) -> None:
        tokens = _rough_prompt_tokens(body)
        if remote:
            self.cost.handoff_overhead.add(ttfb)
        elif tokens:
            self.cost.local_prefill_per_token.add(ttfb / tokens)

    async def wait_for_decode(self) -> bool:
        """While no decode instance is listed, wait up to `decode_wait` for one; False if none came."""
        deadline = time.monotonic() + self.settings.decode_wait
        self.decode.refresh()
        while not self.decode.instances and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            self.decode.refresh()
        return bool(self.decode.instances)

    async def decode_instance(self) -> Replica | None:
        """The least-loaded decode instance (waiting for one as `wait_for_decode`)."""
        await self.wait_for_decode()
        return self.decode.pick()

    async def models(self, raw: Request) -> Response:
        inst = await self.decode_instance()
        if inst is None:
            return _no_decode()
        try:
            resp = await self.client.get(inst.url + "/v1/models", headers=self.headers(raw), timeout=10)
        except httpx.HTTPError as e:
            return _decode_failed(e)
        return _passthrough(resp)


def _prefill_body(body: dict) -> dict:
    """The request as a prefill: one token, no stream, no logprobs, one sequence; the lease asked for."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    out.update(stream=False, max_tokens=1, min_tokens=0, n=1, kv_transfer_params={"do_remote_decode": True})
    if "messages" in body:
        out.update(max_completion_tokens=1, logprobs=False, top_logprobs=None)
    else:
        out.update(logprobs=None, echo=False)
    return out


def _rough_prompt_tokens(body: dict) -> int:
    """About four characters a token: enough to compare costs before the prompt is tokenized."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    text = json.dumps(body.get("messages") if "messages" in body else prompt)
    return max(1, len(text) // 4)


def _passthrough(resp: httpx.Response) -> Response:
    return Response(resp.content, status_code=resp.status_code, headers=passed_headers(resp.headers))


def _no_decode() -> JSONResponse:
    return GatewayError(
        503, "no decode instance is ready; try again later", "server_error", code="no_replica",
        headers={"Retry-After": "1"},
    ).response()  # fmt: skip


def _decode_failed(e: httpx.HTTPError) -> JSONResponse:
    return GatewayError(502, f"the decode instance failed: {type(e).__name__}", "server_error").response()


def create_app(settings: ProxySettings) -> FastAPI:
    proxy = Proxy(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        proxy.client = httpx.AsyncClient(limits=limits)
        yield
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proxy.client.aclose(), 5)

    app = FastAPI(title="inferd disagg proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.handle("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await proxy.models(raw)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
