"""The gateway's request path, composed from the small managers: auth → body → route → budget → pick → proxy.

`Gateway` owns what lives as long as the process (the HTTP clients, the budget store, the prefix index,
the wait queue, the metrics, the monitor task); `GatewayState` is everything built from one config
(pools, routes, tenants, picker, tokenizers) and is swapped whole on reload, so a request keeps the
state it started with and in-flight streams are never dropped. Pools keep their replicas' live state
(in-flight counts, load, health) across a reload. A stream of a route with `resume` that breaks after its
first byte is continued on another replica of its pool (`Gateway._resume`, inferd/gateway/resume.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from inferd.errors import InvalidRequestError
from inferd.gateway.admission import AdmissionQueue
from inferd.gateway.budget import (
    DIMENSIONS,
    Decision,
    MemoryBudgetStore,
    RedisBudgetStore,
    amount_vector,
    limit_vector,
    rate_limit_headers,
)
from inferd.gateway.cache_worth import CACHE_WORTH_WINDOW_S, RecentBlocks, unique_recent_tokens
from inferd.gateway.config import GatewayConfig, PoolConfig, ResumeConfig, TenantConfig
from inferd.gateway.deletion_cost import DeletionCosts
from inferd.gateway.errors import GatewayError, bad_request, model_not_found, no_replica, parse_json_body
from inferd.gateway.kv_index import KVEventIndex
from inferd.gateway.metrics import GatewayMetrics
from inferd.gateway.monitor import Monitor
from inferd.gateway.picker import AllSaturated, Pick, Picker
from inferd.gateway.prefix import MemoryPrefixIndex, RedisPrefixIndex
from inferd.gateway.proxy import (
    ClosingStream,
    Retry,
    SSEFilter,
    Upstream,
    Usage,
    new_session,
    open_upstream,
    parse_usage,
    relay_events,
)
from inferd.gateway.replicas import Pool
from inferd.gateway.resume import (
    RESUMED_HEADER,
    SEED_HEADER,
    StreamState,
    continuation,
    is_greedy,
    is_seeded,
    left_to_generate,
    refuses_resume,
    why_not_resumable,
)
from inferd.gateway.routes import ModelRouter, Target
from inferd.gateway.store import redis_client
from inferd.gateway.tokens import PoolTokenizer, PromptTokens
from inferd.prefix_hash import adapter_salt, block_hashes
from inferd.prompts import check_prompt
from inferd.tracing import TRACE_HEADERS, extract, inject, make_tracer, wall_ns

logger = logging.getLogger(__name__)
WORTH_INTERVAL_S = 5.0  # how often the replicas' cache worth is computed again (a pass over recent keys)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ANONYMOUS = "anonymous"


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class GatewayState:
    """Everything built from one config; replaced whole on reload."""

    config: GatewayConfig
    pools: dict[str, Pool]
    router: ModelRouter
    picker: Picker
    tenants: dict[str, TenantConfig]  # sha256 of an API key -> tenant
    tokenizers: dict[str, PoolTokenizer]

    @classmethod
    def build(cls, config: GatewayConfig, client: httpx.AsyncClient, old: GatewayState | None) -> GatewayState:
        pools = {p.name: Pool(p) for p in config.pools}
        if old is not None:
            for name, pool in pools.items():
                if name in old.pools:
                    pool.adopt(old.pools[name])
        tenants = {d: t for t in config.tenants for d in t.api_key_sha256}
        tokenizers = {p.name: PoolTokenizer(p.tokenizer, client, p.api_key) for p in config.pools}
        picker = Picker(config.routing, config.scrape.stale_after_s)
        return cls(config, pools, ModelRouter(config, pools), picker, tenants, tokenizers)

    def authenticate(self, authorization: str | None) -> TenantConfig | None:
        """The caller's tenant; None when the gateway has no tenants (open access)."""
        if not self.tenants:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        tenant = self.tenants.get(key_digest(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise GatewayError(
                401,
                "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant


@dataclass
class RequestInfo:
    """What the gateway reads from a request body; the rest goes upstream untouched."""

    kind: str
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int | None
    n: int
    num_prompts: int
    client_wants_ids: bool = False  # the client asked for return_token_ids (a resumable stream asks for them)


def _int_field(body: dict, name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise bad_request(f"`{name}` must be an integer >= {minimum}", param=name)
    return v


def read_request(kind: str, body: dict) -> RequestInfo:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options")
    max_tokens = _int_field(body, "max_tokens", 0)
    if kind == "chat":  # the server reads max_completion_tokens first, then max_tokens
        completion_cap = _int_field(body, "max_completion_tokens", 0)
        max_tokens = completion_cap if completion_cap is not None else max_tokens
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("`messages` must be a non-empty list of message objects", param="messages")
        num_prompts = 1
    else:
        if body.get("prompt") is None:
            raise bad_request("`prompt` is required: a string, a list of strings or token ids", param="prompt")
        try:  # the server's own prompt type, as it reads it (the token counts and prefix keys need that)
            prompt = body["prompt"] = check_prompt(body["prompt"])
        except InvalidRequestError as e:
            raise bad_request(str(e), param=e.param) from None
        num_prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
    n = _int_field(body, "n", 1) or 1
    wants_usage = bool(opts and opts.get("include_usage"))
    return RequestInfo(kind, model, stream, wants_usage, max_tokens, n, num_prompts)


@dataclass
class _Resume:
    """What continuing one stream on another replica of its pool needs (`Gateway._resume`)."""

    state: GatewayState
    target: Target
    body: dict  # what was sent upstream, as a dict
    auth: str | None
    tried: set[str]
    fractions: dict[str, float]
    stream: StreamState | None  # None: the request cannot be continued (Flight.unresumable says why)
    attempts: int = 0
    upstreams: list[Upstream] = field(default_factory=list)  # the continuations' answers, closed at the end


@dataclass
class Flight:
    """One admitted request: what must be given back, once, however it ends."""

    gateway: Gateway
    tenant: TenantConfig | None
    info: RequestInfo
    arrived: float
    decision: Decision | None = None
    reserved: list[float] | None = None
    pick: Pick | None = None
    expected_tokens: int = 0  # prompt + max_tokens (times n and prompts): its weight on a replica
    first_at: float | None = None
    queued_at: float | None = None  # when it first waited in the gateway's queue
    prefix_blocks: tuple[int, int] | None = None  # (blocks predicted cached on the replica picked, full blocks)
    charged: int = 0  # tokens counted to the tenant's fair share (vtc) so far
    done: bool = False
    extra_headers: dict[str, str] = field(default_factory=dict)
    resume: ResumeConfig | None = None  # its route's, for a stream whose route resumes streams
    unresumable: str | None = None  # why such a stream could not be continued, if it could not
    span: Any = None  # its OpenTelemetry span (with tracing), and the current upstream attempt's
    attempt_span: Any = None
    trace_headers: dict[str, str] = field(default_factory=dict)  # without tracing: the client's, passed on

    @property
    def weight(self) -> float:
        return self.tenant.weight if self.tenant else 1.0

    @property
    def tenant_id(self) -> str:
        return self.tenant.id if self.tenant else ANONYMOUS

    @property
    def replica_label(self) -> str:
        return self.pick.replica.url if self.pick else ""

    def picked(self, pick: Pick) -> None:
        self.pick = pick
        self.gateway.queue.in_flight[self.tenant_id] += 1
        # the fair share's counter: the tokens it expects, corrected to the real usage when it ends
        self.charged += self.expected_tokens
        self.gateway.queue.charge(self.tenant_id, self.expected_tokens, self.weight)

    def attempt(self, replica: str, pool: str, resumed: bool = False) -> dict[str, str]:
        """The trace context headers of an upstream attempt: a child span of the request's, ending the attempt
        before it (a retry); without tracing, the client's own headers."""
        tracer = self.gateway.tracer
        if tracer is None or self.span is None:
            return self.trace_headers
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self.end_attempt("retried")
        attrs = {"server.address": replica, "inferd.pool": pool, "inferd.resumed": resumed}
        self.attempt_span = tracer.start_span("upstream", trace.set_span_in_context(self.span), SpanKind.CLIENT, attrs)
        return inject(self.attempt_span)

    def end_attempt(self, error: str | None, status: int | None = None) -> None:
        span, self.attempt_span = self.attempt_span, None
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def _end_span(self, status: int, usage: Usage | None) -> None:
        self.end_attempt("failed" if status >= 500 else None, status)
        span, self.span = self.span, None
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        span.set_attribute("inferd.replica", self.replica_label)
        if usage is not None:
            span.set_attribute("gen_ai.usage.prompt_tokens", usage.prompt)
            span.set_attribute("gen_ai.usage.completion_tokens", usage.completion)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"status {status}"))
        span.end()

    def release_pick(self) -> None:
        if self.pick is not None:
            self.pick.release()
            self.gateway.queue.in_flight[self.tenant_id] -= 1
            self.pick = None
            self.gateway.queue.wake_all()

    async def finish(self, status: int, usage: Usage | None, keep_reservation: bool = False) -> None:
        if self.done:
            return
        self.done = True
        self._end_span(status, usage)
        m, g = self.gateway.metrics, self.gateway
        replica = self.replica_label
        m.requests.labels(self.tenant_id, self.info.model, replica, str(status)).inc()
        m.duration.labels(self.tenant_id, self.info.model).observe(time.monotonic() - self.arrived)
        if usage is not None:
            m.tokens.labels(self.tenant_id, self.info.model, replica, "input").observe(usage.prompt)
            m.tokens.labels(self.tenant_id, self.info.model, replica, "output").observe(usage.completion)
            if self.first_at is not None and usage.completion > 1:
                tpot = (time.monotonic() - self.first_at) / (usage.completion - 1)
                m.tpot.labels(self.info.model, replica).observe(tpot)
        if self.charged:
            served = usage.prompt + usage.completion if usage is not None else 0
            g.queue.charge(self.tenant_id, served - self.charged, self.weight)
            self.charged = 0
        self.release_pick()
        if self.decision is not None and self.tenant is not None:
            await g.settle(self, usage, status, keep_reservation)


def _scheduling(tenant: TenantConfig | None, pool: PoolConfig, body: dict) -> dict:
    """The tenant's scheduling class for a pool whose replicas rank requests: its engine_priority under the
    priority policy, its ttft_deadline_ms under the deadline policy, unless the request names its own."""
    if tenant is None:
        return {}
    if pool.scheduling_policy == "priority" and tenant.engine_priority is not None and "priority" not in body:
        return {"priority": tenant.engine_priority}
    if pool.scheduling_policy == "deadline" and tenant.ttft_deadline_ms is not None and "ttft_deadline_ms" not in body:
        return {"ttft_deadline_ms": tenant.ttft_deadline_ms}
    return {}


class Gateway:
    def __init__(self, config: GatewayConfig, redis=None):
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._session = None  # aiohttp, for requests to replicas; made on the event loop that serves
        self.redis = redis
        if (
            redis is None
            and config.redis_url
            and (config.budget_store == "redis" or config.prefix_index.store == "redis")
        ):
            self.redis = redis_client(config.redis_url, config.redis_timeout_s)
        self.state = GatewayState.build(config, self.client, None)
        self.budgets = (
            RedisBudgetStore(self.redis, config.redis_prefix) if config.budget_store == "redis" else MemoryBudgetStore()
        )
        cap = config.prefix_index.capacity_blocks
        self.prefix_index = (
            RedisPrefixIndex(self.redis, config.redis_prefix, cap)
            if config.prefix_index.store == "redis"
            else MemoryPrefixIndex(cap)
        )
        # what the replicas' caches hold, from their KV events (where they publish them)
        self.kv_index = KVEventIndex(cap) if config.prefix_index.kv_events else None
        self.recent_blocks = RecentBlocks(cap)  # when each prefix block was last asked for: caches' worth
        self._worth_at = float("-inf")
        # on Kubernetes: each replica pod's deletion cost, from what its cache serves (cache-aware scale-down)
        cost = config.pod_deletion_cost
        self.deletion_costs = DeletionCosts(cost) if cost.enabled else None
        q = config.routing.queue
        self.queue = AdmissionQueue(q.max_size, q.max_wait_s, q.fairness)
        self.metrics = GatewayMetrics(self._snapshot, self.kv_index.stats if self.kv_index else None)
        self.monitor = Monitor(self)
        tracing = config.tracing  # a span per request, a child per upstream attempt (inferd/tracing.py)
        self.tracer, self._tracer_provider = (
            make_tracer(tracing.service_name, tracing.otlp_endpoint, tracing.headers)
            if tracing.otlp_endpoint
            else (None, None)
        )

    def _snapshot(self) -> tuple[list, int]:
        now = time.monotonic()
        reps = [(r, r.available(now)) for p in self.state.pools.values() for r in p.replicas.values()]
        return reps, len(self.queue)

    @property
    def session(self):
        """The request path's client (`proxy.new_session`); httpx `client` serves probes and /tokenize."""
        if self._session is None:
            self._session = new_session(self.state.config.connect_timeout_s)
        return self._session

    async def start(self) -> None:
        self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        if self.kv_index is not None:
            self.kv_index.close()
        if self.deletion_costs is not None:
            await self.deletion_costs.close()
        await self.client.aclose()
        if self._session is not None:
            await self._session.close()
        if self.redis is not None:
            await self.redis.aclose()
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()  # what is queued goes out

    def reload(self, config: GatewayConfig) -> None:
        """Swap in a new config; requests in flight keep the state they started with."""
        self.state = GatewayState.build(config, self.client, self.state)
        q = config.routing.queue
        self.queue.max_size, self.queue.max_wait_s, self.queue.fairness = q.max_size, q.max_wait_s, q.fairness
        self.queue.wake_all()

    # -- the request path ----------------------------------------------------------------------------
    async def handle(self, kind: str, raw: Request) -> Response:
        arrived = time.monotonic()
        st = self.state
        tenant = st.authenticate(raw.headers.get("authorization"))
        body = parse_json_body(await read_body(raw, st.config.max_body_bytes))
        info = read_request(kind, body)
        if tenant is not None and info.max_tokens is None:
            # the cap reserved is the cap sent upstream: a replica's own default (none at all, for chat)
            # could generate more than the budget holds
            info.max_tokens = body["max_tokens"] = tenant.default_max_tokens
        route = st.router.resolve(info.model)
        if route is None:
            self._reject(tenant, "(unknown)", "model_not_found")  # a client's string is no metric label
            raise model_not_found(info.model, st.router.names())
        targets = st.router.plan(info.model)
        flight = Flight(self, tenant, info, arrived)
        self._trace(flight, raw)
        seed = None
        if info.stream and route.resume.enabled:
            flight.resume = route.resume
            if route.resume.seed_unseeded and not (is_greedy(body) or is_seeded(body)):
                # any seed samples as well as none, and a seeded stream's tokens can be continued exactly
                seed = body["seed"] = secrets.randbits(63)
            flight.unresumable = why_not_resumable(kind, body, info.n, info.num_prompts)
            if flight.unresumable is None:  # the token ids of each chunk: where a continuation takes over
                body["return_token_ids"], info.client_wants_ids = True, body.get("return_token_ids") is True
        salt = self._cache_salt(tenant, body)
        deadline = arrived + st.config.request_timeout_s
        prompt = await self._prompt_tokens(st, targets[0], kind, body)
        await self._reserve(flight, prompt)
        if seed is not None:
            flight.extra_headers[SEED_HEADER] = str(seed)
        try:
            if info.stream:
                body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            for target in targets:
                resp = await self._try_pool(st, flight, target, body, prompt, salt, deadline)
                if resp is not None:
                    return resp
            raise no_replica(info.model, "every replica is down, ejected or failed")
        except BaseException as e:
            status = e.status if isinstance(e, GatewayError) else 500
            await flight.finish(status, None)
            raise

    def _trace(self, flight: Flight, raw: Request) -> None:
        """Start the request's span under the client's trace context; without tracing keep that context to pass
        on to the replica."""
        if self.tracer is None:
            flight.trace_headers = {k: raw.headers[k] for k in TRACE_HEADERS if k in raw.headers}
            return
        from opentelemetry.trace import SpanKind

        attrs = {"gen_ai.request.model": flight.info.model, "inferd.tenant": flight.tenant_id,
                 "inferd.stream": flight.info.stream}  # fmt: skip
        # its start is the request's arrival (the body was read by now)
        start = wall_ns(flight.arrived, time.monotonic(), time.time_ns())
        flight.span = self.tracer.start_span(
            "gateway_request", extract(raw.headers), SpanKind.SERVER, attrs, start_time=start
        )

    def _reject(self, tenant: TenantConfig | None, model: str, reason: str) -> None:
        self.metrics.rejections.labels(tenant.id if tenant else ANONYMOUS, model, reason).inc()

    def _cache_salt(self, tenant: TenantConfig | None, body: dict) -> str | None:
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise bad_request("`cache_salt` must be a string", param="cache_salt")
        if tenant is not None and tenant.isolate_cache:
            salt = tenant.id if not salt else f"{tenant.id}:{salt}"
            body["cache_salt"] = salt
        return salt

    async def _prompt_tokens(self, st: GatewayState, target: Target, kind: str, body: dict) -> PromptTokens | None:
        """Tokenize only when something needs it: token budgets or prefix affinity."""
        routing = st.config.routing
        wants_prefix = routing.picker == "scored" and routing.scorers.prefix > 0
        if not wants_prefix and not st.tenants:
            return None
        now = time.monotonic()
        replica = next((r.url for r in target.pool.replicas.values() if r.available(now)), None)
        return await st.tokenizers[target.pool.name].count(kind, body, target.model, replica)

    async def _reserve(self, flight: Flight, prompt: PromptTokens | None) -> None:
        tenant, info = flight.tenant, flight.info
        if tenant is None:
            return
        limits = tenant.limits
        output = info.max_tokens * info.n * info.num_prompts  # handle() set max_tokens where the client did not
        amounts = amount_vector(limits, prompt.count if prompt else 0, output)
        try:
            decision = await self.budgets.reserve(
                tenant.id, limit_vector(limits), amounts, limits.window_s, limits.max_concurrent
            )
        except GatewayError:  # the budget store is down
            self._reject(tenant, info.model, "budget_store")
            raise
        headers = rate_limit_headers(decision)
        if not decision.allowed:
            self._reject(tenant, info.model, "budget")
            raise _over_budget(decision, amounts, headers)
        flight.decision, flight.reserved, flight.extra_headers = decision, amounts, headers

    async def settle(self, flight: Flight, usage: Usage | None, status: int, keep: bool) -> None:
        """Correct the reservation to what was used: the real usage, nothing if the request failed."""
        limits = flight.tenant.limits
        if usage is not None:
            actual = amount_vector(limits, usage.prompt, usage.completion, usage.cached)
        elif keep:
            actual = flight.reserved  # a stream broke mid-way: the usage is unknown, charge what was reserved
        else:
            actual = [1.0] + [0.0] * (len(DIMENSIONS) - 1)  # refused or failed: the request counts, no tokens
        deltas = [a - r for a, r in zip(actual, flight.reserved, strict=True)]
        try:
            await self.budgets.settle(flight.tenant.id, flight.decision.window_start, deltas)
        except GatewayError:
            pass  # the budget store is down: its guard logged that once
        except Exception:
            logger.exception("settling tenant %s failed", flight.tenant.id)

    async def _try_pool(
        self,
        st: GatewayState,
        flight: Flight,
        target: Target,
        body: dict,
        prompt: PromptTokens | None,
        salt: str | None,
        deadline: float,
    ) -> Response | None:
        """Up to 1 + retries replicas of one pool; None if none could serve (the next target follows)."""
        pool = target.pool
        salt = adapter_salt(salt, target.adapter)  # an adapter's blocks are its own on the replica
        hashes = block_hashes(prompt.ids, pool.config.block_size, salt) if prompt and prompt.ids else []
        self.recent_blocks.touch(hashes, time.monotonic())  # asked for now, whichever replica serves it
        matched = await self._prefix_match(pool, hashes, target.adapter)
        fractions = {url: n / len(hashes) for url, n in matched.items()} if hashes else {}
        sent = {**body, **_scheduling(flight.tenant, pool.config, body), "model": target.model}
        payload = json.dumps(sent).encode()
        auth = f"Bearer {pool.config.api_key}" if pool.config.api_key else None
        info = flight.info
        output = (info.max_tokens or 0) * info.n * info.num_prompts
        flight.expected_tokens = (prompt.count if prompt else 0) + output
        tried: set[str] = set()
        for attempt in range(1 + st.config.retries):
            pick = await self._pick(st, flight, pool, tried, fractions, deadline, target.adapter)
            if pick is None:
                return None
            flight.picked(pick)
            tried.add(pick.replica.url)
            self.metrics.routing.labels(pool.name, pick.replica.url).inc()
            if hashes:
                hit = matched.get(pick.replica.url, 0)
                flight.prefix_blocks = (hit, len(hashes))
                pick.replica.cache_hits.add(hit, time.monotonic())
                self.metrics.prefix_blocks.labels(pool.name, "hit").inc(hit)
                self.metrics.prefix_blocks.labels(pool.name, "miss").inc(len(hashes) - hit)
                await self.prefix_index.insert(pick.replica.url, hashes)
            url = pick.replica.url + PATHS[flight.info.kind]
            try:
                trace = flight.attempt(pick.replica.url, pool.name)
                up = await open_upstream(self.session, url, payload, auth, flight.info.stream, deadline, trace)
            except Retry as r:
                flight.end_attempt(r.kind)
                self._upstream_failed(st, flight, r)
                if attempt < st.config.retries:
                    self.metrics.retries.labels(flight.info.model).inc()
                continue
            pick.replica.record_success()
            self.metrics.upstream_latency.labels(pick.replica.url).observe(up.headers_at - flight.arrived)
            resume = None
            if flight.resume is not None and up.rest is not None:
                stream = StreamState(flight.info.kind, flight.info.client_wants_ids) if not flight.unresumable else None
                resume = _Resume(st, target, sent, auth, tried, fractions, stream)
            return await self._answer(flight, up, deadline, resume)
        return None

    async def _prefix_match(self, pool, hashes: list, adapter: str | None) -> dict[str, int]:
        """Leading blocks of the prompt each replica holds: from its KV events where it publishes them (not for
        an adapter's requests, whose keys the engine salts with the weights' digest), else from the keys sent
        there (`prefix_index`)."""
        if not hashes:
            return {}
        urls = list(pool.replicas)
        exact = self.kv_index.match(urls, hashes) if self.kv_index is not None and adapter is None else {}
        rest = [u for u in urls if u not in exact]
        if exact:
            self.metrics.prefix_source.labels(pool.name, "events").inc(len(exact))
        if rest:
            self.metrics.prefix_source.labels(pool.name, "sent").inc(len(rest))
        return exact | (await self.prefix_index.match(rest, hashes) if rest else {})

    def update_cache_worth(self, now: float) -> None:
        """Every replica's `cache_worth` (inferd/gateway/cache_worth.py), at most every WORTH_INTERVAL_S: the
        tokens of the blocks asked for in the last CACHE_WORTH_WINDOW_S that it alone in its pool holds, by its
        KV events where it publishes them, else by the keys sent there."""
        if now - self._worth_at < WORTH_INTERVAL_S:
            return
        self._worth_at = now
        keys = self.recent_blocks.since(now - CACHE_WORTH_WINDOW_S)
        for pool in self.state.pools.values():
            recent = dict.fromkeys(keys, pool.config.block_size)
            worth = unique_recent_tokens(list(pool.replicas), self._holds, recent)
            for url, replica in pool.replicas.items():
                replica.cache_worth = worth[url]

    def _holds(self, url: str, key) -> bool:
        if self.kv_index is not None and self.kv_index.synced(url):
            return self.kv_index.holds(url, key)
        return self.prefix_index.holds(url, key)

    def _upstream_failed(self, st: GatewayState, flight: Flight, r: Retry) -> None:
        replica = flight.pick.replica
        self.metrics.errors.labels(flight.tenant_id, flight.info.model, replica.url, r.kind).inc()
        if r.replica_failed:
            replica.record_failure(st.config.health)
        logger.warning("replica %s: %s; trying another", replica.url, r.kind)
        flight.release_pick()

    async def _pick(
        self,
        st: GatewayState,
        flight: Flight,
        pool: Pool,
        tried: set[str],
        fractions: dict[str, float],
        deadline: float,
        adapter: str | None = None,
    ) -> Pick | None:
        """A replica of the pool, waiting in the gateway's queue while every one is saturated, or while the
        pool lists none at all (scaled to zero, or its first replica still starting: `inferd up`)."""
        seq = None
        priority = flight.tenant.priority if flight.tenant else 0
        while True:
            cands = st.picker.candidates(list(pool.replicas.values()), tried, fractions, adapter)
            try:
                if not pool.replicas and not tried and not pool.config.replicas:  # discovered, none yet
                    raise AllSaturated()
                return st.picker.pick(cands, flight.expected_tokens)
            except AllSaturated:
                if flight.queued_at is None:
                    flight.queued_at = time.monotonic()
                seq = await self.queue.wait(flight.tenant_id, priority, seq, flight.queued_at, deadline)
                pool = self.state.pools.get(pool.name, pool)  # a reload may have rebuilt it

    async def _resume(self, flight: Flight, r: _Resume, deadline: float) -> Upstream | None:
        """A stream that broke after its first byte, continued on another replica of its pool: the upstream
        answer whose events follow, or None (the stream then ends with the error event). Exact where the replica
        takes `resume`; greedy-equivalent for a greedy request where it does not (inferd/gateway/resume.py)."""
        model, broken = flight.info.model, flight.replica_label
        flight.release_pick()  # the broken replica's slot

        def failed(why: str) -> None:
            self.metrics.resumes.labels(model, "failed").inc()
            logger.warning("a stream of %s broke on %s and was not resumed: %s", model, broken, why)

        s = r.stream
        if s is None:
            return failed(f"it cannot be: {flight.unresumable}")
        if s.finished:
            return failed("its choice had already finished")
        if s.text and not s.saw_ids:
            return failed("the replica sent no token ids (return_token_ids)")
        if not left_to_generate(r.body, len(s.token_ids)):
            return failed("max_tokens leaves nothing after the tokens sent")
        try:
            return await self._continue(flight, r, s, deadline, failed)
        except GatewayError as e:  # the deadline, or the wait queue's limits, while it waited for a replica
            flight.release_pick()
            return failed(e.message)

    async def _continue(self, flight: Flight, r: _Resume, s: StreamState, deadline: float, failed) -> Upstream | None:
        """`_resume`'s attempts: one replica after another, up to the route's `max_attempts`."""
        model = flight.info.model
        exact = True
        pool = r.target.pool
        while r.attempts < flight.resume.max_attempts:
            pick = await self._pick(r.state, flight, pool, r.tried, r.fractions, deadline, r.target.adapter)
            if pick is None:
                return failed("no other replica of the pool can take it")
            r.attempts += 1
            flight.picked(pick)
            url = pick.replica.url
            r.tried.add(url)
            body, prompt_extra = continuation(flight.info.kind, r.body, s, exact)
            try:
                trace = flight.attempt(url, pool.name, resumed=True)
                payload = json.dumps(body).encode()
                up = await open_upstream(
                    self.session, url + PATHS[flight.info.kind], payload, r.auth, True, deadline, trace
                )
            except Retry as e:
                flight.end_attempt(e.kind)
                self._upstream_failed(r.state, flight, e)
                continue
            taken = up.status == 200 and up.rest is not None
            if taken and (not exact or not s.token_ids or RESUMED_HEADER in up.response.headers):
                pick.replica.record_success()
                r.upstreams.append(up)
                s.begin(prompt_extra)
                outcome = "exact" if exact else "greedy"
                self.metrics.resumes.labels(model, outcome).inc()
                logger.info("a stream of %s resumed on %s after %d tokens (%s)", model, url, len(s.token_ids), outcome)
                return up
            up.close()
            flight.release_pick()
            if exact and is_greedy(r.body) and (taken or refuses_resume(up.status, up.body or b"")):
                exact = False  # a replica that does not take `resume`: a greedy request goes on as prompt
                r.tried.discard(url)
                continue
            why = "it ignored `resume`" if taken else f"it answered {up.status}"
            return failed(f"replica {url} cannot continue it exactly ({why}) and the request is not greedy")
        return failed(f"all {flight.resume.max_attempts} attempts were used")

    async def _answer(self, flight: Flight, up: Upstream, deadline: float, resume: _Resume | None = None) -> Response:
        headers = {**up.headers(), **flight.extra_headers}
        if flight.gateway.state.config.expose_replica_header:
            headers["x-inferd-replica"] = flight.pick.replica.url
            if flight.prefix_blocks is not None:  # what prefix affinity predicted there: "hit/total" blocks
                headers["x-inferd-prefix-blocks"] = "{}/{}".format(*flight.prefix_blocks)
        if up.rest is None:  # a whole body (or a non-200 answer to a stream request)
            usage = _json_usage(up.body) if up.status == 200 else None
            await flight.finish(up.status, usage)
            return Response(up.body, status_code=up.status, headers=headers)
        stream = resume.stream if resume is not None else None
        sse = SSEFilter(forced_usage=not flight.info.client_wants_usage, each=stream.event if stream else None)
        broken: list[str] = []

        def on_first() -> None:
            flight.first_at = time.monotonic()
            self.metrics.ttft.labels(flight.info.model, flight.replica_label).observe(flight.first_at - flight.arrived)

        def on_broken(kind: str) -> None:
            broken.append(kind)
            self.metrics.errors.labels(flight.tenant_id, flight.info.model, flight.replica_label, kind).inc()
            if kind == "stream_broken" and flight.pick is not None:
                flight.pick.replica.record_failure(self.state.config.health)

        async def on_close() -> None:
            up.close()
            for more in resume.upstreams if resume is not None else ():
                more.close()
            ok = not broken or (resume is not None and len(resume.upstreams) == len(broken))  # each break resumed
            await flight.finish(200 if ok else 502, sse.usage, keep_reservation=sse.usage is None)

        go_on = (lambda: self._resume(flight, resume, deadline)) if resume is not None else None
        body = relay_events(up, sse, deadline, on_first, on_broken, go_on)
        headers.pop("content-type", None)
        return ClosingStream(body, on_close, headers)


def _json_usage(body: bytes) -> Usage | None:
    try:
        return parse_usage(json.loads(body))
    except ValueError:
        return None


def _over_budget(d: Decision, amounts: list[float], headers: dict[str, str]) -> GatewayError:
    retry_after = max(1, int(d.reset_s + 0.999))
    if d.failed is not None and d.failed < len(DIMENSIONS):
        name = DIMENSIONS[d.failed]
        lim, used, want = d.limits[d.failed], d.used[d.failed], amounts[d.failed]
        msg = f"rate limit: this request needs {want:g} {name} but {max(0.0, lim - used):g} of {lim:g} remain"
        msg += f" in this window; it resets in {d.reset_s:.1f}s"
        code = "rate_limit_exceeded"
    else:
        msg = "too many concurrent requests for this API key; retry when one finishes"
        code, retry_after = "concurrency_limit_exceeded", 1
    return GatewayError(429, msg, "rate_limit_error", code=code, headers={**headers, "Retry-After": str(retry_after)})


async def read_body(raw: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while reading)."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"the request body is over the gateway's limit of {limit} bytes", code="too_large")
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"the request body is over the gateway's limit of {limit} bytes", code="too_large")
        chunks.append(chunk)
    return b"".join(chunks)
