"""The fleet as a Ray Serve application: an engine deployment per pool behind an OpenAI ingress.

- `EngineReplica` (one deployment per pool, `engine-<pool>`): inferd's engine and its OpenAI server app,
  run in the replica and called in-process over ASGI, so requests, validation, errors, SSE and
  `/metrics` are exactly `inferd serve`'s. A response streams back through Serve as (head, chunks...).
- `OpenAIIngress`: `/v1/completions`, `/v1/chat/completions` (streaming or not), `/v1/models`,
  `/health`. It reads the body and the prompt as the gateway does (`inferd.gateway.errors.parse_json_body`,
  `inferd.prompts`), resolves `model` (name or alias) to its pools, computes the prompt's prefix block
  keys (`inferd.prefix_hash`, the pool's block size) and hands the request to Serve. A non-streaming
  request whose replica dies is sent again to another one; a stream is retried until its first byte.
- `InferdRequestRouter`: Serve's request-router extension, scoring replicas with the gateway's own
  scorers (`inferd.gateway.picker.SCORERS`: queue, KV cache, in-flight, prefix) over each replica's
  routing stats and the gateway's prefix indexes, so routing on Ray is the routing on Kubernetes and behind
  `inferd gateway`: a replica whose engine publishes KV events (`enable_kv_cache_events` in the pool's
  engine settings; each replica binds free ports and reports them, at its node's address, with its routing
  stats) is scored on what its cache holds now (`inferd.gateway.kv_index.KVEventIndex`), the others on the
  keys the router sent them (`inferd.gateway.prefix.MemoryPrefixIndex`).
- `PoolAutoscalingPolicy`: Serve's custom autoscaling policy, driven by the pool's `AutoscalingPolicy`
  (replicas = ceil(total signal / target), the largest over targets, step limits); Serve applies the
  min/max bounds and the up/down delays the policy's windows map to.

`build` puts the application together in code (a hook may change a pool's autoscaling config on the way),
`build_app` is the application builder (`serve run inferd.runtime.ray:build_app config=fleet.yaml`); the
deployments' options, and the `serve deploy`/`serve run` config file that names this module's builder, router
and policy, are rendered by `inferd.deploy.ray`, which imports none of this. `local_ray` runs Ray and Serve
for one process alone and checks that what Ray started has ended; `running_replicas`, `wait_app_running`,
`ReplicaWatch` and `replica_stats` watch an app it runs, and the `recording` hook has each pool's policy log its
decisions (`read_decisions`). This module is what runs: it imports Ray,
the gateway's routing and, in each replica, the engine and the server's app.
"""

import asyncio
import dataclasses
import json
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inferd.chat import messages_text
from inferd.deploy.ray import APP_NAME, INGRESS_NAME, RayOptions, check_spec, deployment_options
from inferd.errors import ConfigError, InferdError, InvalidRequestError
from inferd.fleet.spec import AutoscalingPolicy, FleetSpec, ModelSpec, PoolSpec, load_fleet
from inferd.gateway.config import Scorers
from inferd.gateway.errors import GatewayError, model_not_found, parse_json_body
from inferd.gateway.kv_index import KVEventIndex, public_endpoint
from inferd.gateway.picker import SCORERS, Candidate
from inferd.gateway.prefix import MemoryPrefixIndex
from inferd.gateway.replicas import Load, Replica
from inferd.prefix_hash import adapter_salt, block_hashes
from inferd.prompts import check_prompt, prompt_items

logger = logging.getLogger(__name__)

RETRIES = 2  # other replicas tried when one dies under a request
MAX_ROUTED_CHARS = 65536  # prompt characters tokenized at the ingress for prefix affinity


@dataclass
class RoutedRequest:
    """One OpenAI request on its way to an engine replica; `block_hashes` is what the router matches."""

    path: str
    body: bytes
    headers: list[tuple[str, str]]
    stream: bool
    block_hashes: list[bytes] = field(default_factory=list)
    adapter: str | None = None  # the LoRA adapter asked for: the router prefers replicas running it


# -- the engine replica ------------------------------------------------------------------------------
async def asgi_call(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> AsyncIterator:
    """Call an ASGI app in-process; yields {"status", "headers"} first, then the body's chunks as they are
    sent. Closing the generator early tells the app the client left (the server aborts the request)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    task = asyncio.create_task(app(scope, receive, out.put))
    task.add_done_callback(lambda t: out.put_nowait({"type": "inferd.done"}))
    try:
        while True:
            msg = await out.get()
            if msg["type"] == "http.response.start":
                yield {"status": msg["status"], "headers": [(k.decode(), v.decode()) for k, v in msg["headers"]]}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    break
            elif msg["type"] == "inferd.done":
                task.result()  # raises what the app raised
                break
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait_for(task, timeout=30)


class EngineReplica:
    """inferd's engine and server app in one Serve replica."""

    def __init__(self, spec: dict, pool: str, metrics_names: str = "vllm"):
        from inferd.engine.engine import Engine
        from inferd.server.app import create_app
        from inferd.server.state import ServerSettings

        fleet = FleetSpec.model_validate(spec)
        model, pool_spec = next((m, p) for m, p in fleet.pools() if p.name == pool)
        config = model.engine_config(pool_spec)  # as `inferd serve` reads the pool's flags
        if config.kv_events.enabled:  # replicas share nodes: each binds ports of its own (routing stats say which)
            ports = {"kv_events_endpoint": "tcp://*:*", "kv_events_replay_endpoint": "tcp://*:*"}
            config = dataclasses.replace(config, kv_events=dataclasses.replace(config.kv_events, **ports))
        engine = Engine(config)
        settings = ServerSettings([model.name, *model.aliases], model_root=model.model, metrics_names=metrics_names)
        self.app = create_app(engine, settings)
        self.state = self.app.state.inferd
        self._lifespan = None
        self._start_lock = asyncio.Lock()
        self.requests = 0  # OpenAI requests routed here (reported with the routing stats)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (a unit test)
            self.replica_id = "local"

    async def _started(self) -> None:
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan

    async def handle(self, req: RoutedRequest) -> AsyncIterator:
        self.requests += 1
        await self._started()
        first = True
        async for item in asgi_call(self.app, "POST", req.path, req.headers, req.body):
            if first:
                item["headers"].append(("x-inferd-replica", self.replica_id))
                first = False
            yield item

    async def get(self, path: str) -> tuple[int, str]:
        """A GET on the replica's own server (`/metrics`, `/health`): status and text."""
        await self._started()
        chunks, status = [], 500
        async for item in asgi_call(self.app, "GET", path, [], b""):
            if isinstance(item, dict):
                status = item["status"]
            else:
                chunks.append(item)
        return status, b"".join(chunks).decode()

    def _signals(self) -> dict[str, float]:
        ae = self.state.async_engine
        st = ae.stats
        return {
            "waiting": float(st.num_waiting + ae.num_pending),
            "running": float(st.num_running),
            "kv_cache_usage": float(st.kv_cache_usage),
            "prefix_cache_hits": float(st.prefix_cache_hits),
            "prefix_cache_queries": float(st.prefix_cache_queries),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by the request router (every `request_routing_stats_period_s` of the deployment's options):
        the load, and the LoRA adapters running or waiting here and the slots, as `lora_requests_info` says."""
        st = self.state.async_engine.stats
        lora = {"lora_active": sorted(st.running_loras.keys() | st.waiting_loras.keys()), "max_loras": st.max_loras}
        ids = {"replica": self.replica_id, "requests": float(self.requests)}
        return self._signals() | lora | self._kv_events() | ids

    def _kv_events(self) -> dict[str, Any]:
        """Where this replica's KV events can be subscribed to, at its node's address (none: not published)."""
        publisher = self.state.async_engine.engine.kv_events
        if publisher is None:
            return {}
        import ray

        node = f"http://{ray.util.get_node_ip_address()}"
        info = publisher.info()
        replay = info["replay_endpoint"]
        return {"kv_events": {
            "endpoint": public_endpoint(info["endpoint"], node),
            "replay_endpoint": public_endpoint(replay, node) if replay else None,
            "topic": info["topic"],
        }}  # fmt: skip

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by the autoscaling policy, averaged by Serve over the look-back window."""
        return self._signals()

    async def check_health(self) -> None:
        if self.state.async_engine.dead is not None:
            raise RuntimeError(f"engine died: {self.state.async_engine.dead}")


# -- the request router --------------------------------------------------------------------------------
def rank(cands: list[Candidate], weights: Scorers) -> list[tuple[float, Candidate]]:
    """The gateway's weighted sum of scorers, best first."""
    w = weights.model_dump()
    scored = [(sum(w[n] * fn(c) for n, fn in SCORERS.items() if w[n] > 0), c) for c in cands]
    return sorted(scored, key=lambda sc: -sc[0])


class InferdRequestRouter(RequestRouter):
    """Serve's request router with the gateway's scorers and prefix index."""

    def initialize_state(
        self, scorers: dict | None = None, capacity_blocks: int = 65536, kv_events: bool = True, **_: Any
    ) -> None:
        self.weights = Scorers.model_validate(scorers or {})
        self.index = MemoryPrefixIndex(capacity_blocks)  # the keys sent to each replica
        self.events = KVEventIndex(capacity_blocks) if kv_events else None  # what publishing replicas hold
        self._subscribed: set[str] = set()
        self.rng = random.Random()

    def _subscribe(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the KV events of replicas that report publishing them (once each)."""
        for r in replicas:
            rid = r.replica_id.to_full_id_str()
            info = (r.routing_stats or {}).get("kv_events")
            if info and rid not in self._subscribed:
                self.events.subscribe(rid, info["endpoint"], info.get("replay_endpoint"), info.get("topic") or "")
                self._subscribed.add(rid)

    async def _match(self, ids: list[str], hashes: list[bytes], adapter: str | None) -> dict[str, int]:
        """Leading blocks of the prompt each replica holds: from its KV events where it publishes them (not for
        an adapter's requests: the engine salts their keys with the weights' digest), else from the keys sent."""
        exact = self.events.match(ids, hashes) if self.events is not None and adapter is None else {}
        rest = [i for i in ids if i not in exact]
        return exact | (await self.index.match(rest, hashes) if rest else {})

    def _candidate(
        self, r: RunningReplica, hashes: list[bytes], matched: dict[str, int], now: float, adapter: str | None
    ) -> Candidate:
        rid = r.replica_id.to_full_id_str()
        rep = Replica(url=rid, pool="")
        rep.in_flight = self._replica_queue_len_cache.get(r.replica_id) or 0
        stats = r.routing_stats or {}
        load = None
        if stats:
            active = frozenset(stats.get("lora_active", ()))
            load = Load(now, stats.get("waiting", 0.0), kv_usage=stats.get("kv_cache_usage", 0.0),
                        lora_active=active, max_loras=stats.get("max_loras"))  # fmt: skip
        return Candidate(rep, load, matched.get(rid, 0) / len(hashes) if hashes else 0.0, adapter)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        hashes = getattr(req, "block_hashes", None) or []
        ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
        adapter = getattr(req, "adapter", None)
        if self.events is not None:
            self._subscribe(candidate_replicas)
        matched = await self._match(ids, hashes, adapter) if hashes else {}
        now = time.monotonic()
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        cands = [self._candidate(r, hashes, matched, now, adapter) for r in candidate_replicas]
        self.rng.shuffle(cands)  # ties go to a random replica
        return [[by_id[c.replica.url]] for _, c in rank(cands, self.weights)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = pending_request.args[0] if pending_request.args else None
        hashes = getattr(req, "block_hashes", None)
        if hashes:
            _now(self.index.insert(replica_id.to_full_id_str(), hashes))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.to_full_id_str()
        _now(self.index.forget(rid))
        if rid in self._subscribed:
            self._subscribed.discard(rid)
            self.events.retain(self._subscribed)


def _now(coro) -> Any:
    """Run a coroutine that never suspends (the in-memory prefix index's) to its end, right here: the
    router's callbacks are synchronous, and the next pick must already see this one's blocks."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the prefix index suspended; only the in-memory index can run in the router")


# -- autoscaling ----------------------------------------------------------------------------------------
# the policy's targets that replicas report (record_autoscaling_stats); the others are `inferd up`'s
RAY_TARGETS = {"waiting": "waiting", "running": "running", "kv_cache_usage": "kv_cache_usage"}


def desired_replicas(policy: AutoscalingPolicy, current: int, totals: dict[str, float]) -> int:
    """ceil(fleet total / per-replica target), the largest over targets, within the step limits.
    (Serve then applies min/max and the up/down delays.)"""
    targets = policy.targets.model_dump()
    wants = [
        math.ceil(totals[signal] / targets[name] - 1e-9)
        for name, signal in RAY_TARGETS.items()
        if targets[name] is not None and signal in totals
    ]
    want = max(wants, default=current)
    return max(current - policy.max_scale_down_step, min(current + policy.max_scale_up_step, want))


class PoolAutoscalingPolicy:
    """Serve's custom autoscaling policy for one pool (Serve builds it with `policy_kwargs`). With
    `decisions_log` (a file) it also records itself: Serve calls it every control-loop tick (0.1 s), and a call
    whose outcome changed, or the first in half a second, is one JSON line there: wall time `t`, Serve's
    `current` and `target` replicas, the policy's `desired` count (before Serve's bounds), and the `waiting`
    and `running` requests summed over replicas."""

    def __init__(self, decisions_log: str | None = None, **policy: Any):
        self.policy = AutoscalingPolicy.model_validate(policy)
        self.log, self.last, self.last_t = decisions_log, None, 0.0

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        totals = {name: sum(per_replica.values()) for name, per_replica in metrics.items()}
        if ctx.current_num_replicas == 0:  # nothing reports: demand is what waits at the handles
            desired = 1 if ctx.total_num_requests > 0 else 0
        else:
            desired = desired_replicas(self.policy, ctx.current_num_replicas, totals)
        if self.log is not None:
            self._record(desired, ctx.current_num_replicas, ctx.target_num_replicas, totals)
        return desired, {}

    def _record(self, desired: int, current: int, target: int, totals: dict[str, float]) -> None:
        now = time.time()
        if (desired, current, target) == self.last and now - self.last_t < 0.5:
            return
        self.last, self.last_t = (desired, current, target), now
        line = {"t": now, "current": current, "target": target, "desired": desired}
        line |= {k: round(totals.get(k, 0.0), 2) for k in ("waiting", "running")}
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")


def read_decisions(path: Path, t0: float) -> list[dict]:
    """A `decisions_log`'s lines, their times in seconds since `t0`."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r | {"t": r["t"] - t0} for r in rows]


# -- the ingress -------------------------------------------------------------------------------------
ingress_app = FastAPI(title="inferd on Ray Serve")


def _error(e: GatewayError) -> JSONResponse:
    return e.response()


@dataclass
class Route:
    """Where a model's requests go: its pools, each with its engine's block size (what its prefix keys hash)."""

    model: ModelSpec
    block_sizes: dict[str, int]
    tokenizer: Any  # tokenizers.Tokenizer or None (no prefix affinity)
    adapters: frozenset[str] = frozenset()  # its LoRA adapters' names (a request may name one as `model`)


def _load_tokenizer(model: ModelSpec):
    path = Path(model.model)
    if not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def model_routes(spec: FleetSpec) -> dict[str, Route]:
    """Each name and alias a client may send as `model` -> its route."""
    routes = {}
    for m in spec.models:
        sizes = {p.name: m.engine_config(p).cache.block_size for p in m.pools}
        route = Route(m, sizes, _load_tokenizer(m), frozenset(m.adapters()))
        routes |= dict.fromkeys([m.name, *m.aliases, *route.adapters], route)  # an adapter: its base model's pools
    return routes


def routing_prompt(kind: str, body: dict) -> str | list[int] | None:
    """What routes a request by its prefix: a chat's message text, or a completion's first prompt (read with
    the server's prompt type); None for a prompt the server would refuse (the replica answers that)."""
    if kind == "chat":
        messages = body.get("messages")
        return messages_text(messages) if isinstance(messages, list) else ""
    try:
        return prompt_items(check_prompt(body.get("prompt")))[0]
    except InvalidRequestError:
        return None


# (defined before the deployment: Serve serialises the class, with what it refers to, when decorating)
def _headers(head: dict) -> dict[str, str]:
    skip = {"content-length", "transfer-encoding", "connection", "x-request-id"}  # Serve sets its own
    return {k: v for k, v in head["headers"] if k.lower() not in skip}


async def _rest(gen) -> AsyncIterator[bytes]:
    async for chunk in gen:
        yield chunk


@serve.deployment(name=INGRESS_NAME, max_ongoing_requests=256)
@serve.ingress(ingress_app)
class OpenAIIngress:
    def __init__(self, spec: dict, engines: dict[str, Any]):
        self.spec = FleetSpec.model_validate(spec)
        self.engines = engines
        self.routes = model_routes(self.spec)

    def _hashes(self, route: Route, pool: str, kind: str, body: dict) -> list[bytes]:
        prompt = routing_prompt(kind, body)
        if prompt is None or (isinstance(prompt, str) and route.tokenizer is None):
            return []
        cut = isinstance(prompt, str) and len(prompt) > MAX_ROUTED_CHARS  # the prefix is what routes
        if isinstance(prompt, str):
            ids = route.tokenizer.encode(prompt[:MAX_ROUTED_CHARS], add_special_tokens=True).ids
        else:
            ids = prompt
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        adapter = body["model"] if body.get("model") in route.adapters else None
        hashes = block_hashes(ids, route.block_sizes[pool], adapter_salt(salt, adapter))  # keyed as the gateway
        return hashes[:-1] if cut else hashes  # a token may straddle the cut: its block is not trusted

    async def _openai(self, request: Request, kind: str) -> Response:
        raw = await request.body()
        try:  # read as the gateway and the server read it
            body = parse_json_body(raw)
        except GatewayError as e:
            return _error(e)
        route = self.routes.get(body.get("model")) if isinstance(body.get("model"), str) else None
        if route is None:
            return _error(model_not_found(body.get("model"), list(self.routes)))
        pool = random.choice(list(route.block_sizes))
        headers = [(k, v) for k, v in request.headers.items() if k in ("content-type", "authorization", "accept")]
        stream = body.get("stream") is True
        adapter = body["model"] if body["model"] in route.adapters else None
        req = RoutedRequest(request.url.path, raw, headers, stream, self._hashes(route, pool, kind, body), adapter)
        return await self._forward(pool, req)

    async def _forward(self, pool: str, req: RoutedRequest) -> Response:
        handle = self.engines[pool].options(stream=True)
        for attempt in range(RETRIES + 1):
            gen = handle.handle.remote(req)
            try:
                head = await gen.__anext__()
                headers = _headers(head) | {"x-inferd-attempts": str(attempt + 1)}
                if req.stream:
                    return StreamingResponse(_rest(gen), status_code=head["status"], headers=headers)
                chunks = [c async for c in gen]
                return Response(b"".join(chunks), status_code=head["status"], headers=headers)
            except RayActorError as e:  # the replica died under the request: another one takes it
                logger.warning("pool %s: replica died (%s); attempt %d of %d", pool, e, attempt + 1, RETRIES + 1)
        return _error(GatewayError(503, f"no replica of pool {pool} could serve the request", type="server_error"))

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "completion")

    @ingress_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._openai(request, "chat")

    @ingress_app.get("/v1/models")
    async def models(self) -> dict:
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "inferd"} for name in self.routes]
        return {"object": "list", "data": data}

    @ingress_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}


# -- building the application ---------------------------------------------------------------------------
# a pool's autoscaling config as `inferd.deploy.ray` renders it (plain JSON) -> the config Serve gets
AutoscalingHook = Callable[[PoolSpec, dict[str, Any]], dict[str, Any]]


def build(
    spec: FleetSpec, opts: RayOptions | None = None, *, autoscaling: AutoscalingHook | None = None
) -> serve.Application:
    """The fleet as a Serve application. `autoscaling`, where given, sees each autoscaled pool's config before
    Serve does and returns the one to use (another policy function wrapping this one, a shorter
    `metrics_interval_s`): what a scenario changes without copying the rest."""
    opts = opts or RayOptions()
    check_spec(spec)
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    engines = {}
    for m, p in spec.pools():
        options = deployment_options(m, p, opts)
        options["request_router_config"] = RequestRouterConfig(**options["request_router_config"])
        if "autoscaling_config" in options:
            auto = options["autoscaling_config"]
            options["autoscaling_config"] = AutoscalingConfig(**(autoscaling(p, auto) if autoscaling else auto))
        engines[p.name] = (
            serve.deployment(EngineReplica)
            .options(**options)
            .bind(spec.model_dump(mode="json"), p.name, opts.metrics_names)
        )
    return OpenAIIngress.bind(spec.model_dump(mode="json"), engines)


def recording(decisions_log: Path) -> AutoscalingHook:
    """A `build` hook: every pool's policy also writes its decisions to `decisions_log`, and Serve pushes the
    replicas' metrics at the policy's `interval_s` (Serve's default is every 10 s)."""

    def hook(pool: PoolSpec, auto: dict[str, Any]) -> dict[str, Any]:
        kwargs = auto["policy"]["policy_kwargs"] | {"decisions_log": str(decisions_log)}
        policy = auto["policy"] | {"policy_kwargs": kwargs}
        return auto | {"metrics_interval_s": pool.autoscaling.interval_s, "policy": policy}

    return hook


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: `config` (a fleet YAML path) or `spec` (the fleet as a dict)."""
    if "spec" in args:
        spec = args["spec"] if isinstance(args["spec"], FleetSpec) else FleetSpec.model_validate(args["spec"])
    elif "config" in args:
        spec = load_fleet(args["config"])
    else:
        raise ConfigError("build_app needs `config` (a fleet YAML path) or `spec`")
    return build(spec, RayOptions(metrics_names=args.get("metrics_names", "vllm")))


# -- watching a running app -----------------------------------------------------------------------------
def running_replicas(deployment: str, app: str = APP_NAME) -> int:
    """Replicas of `deployment` that Serve reports RUNNING (0 while the app or the deployment is not there)."""
    status = serve.status().applications.get(app)
    dep = status.deployments.get(deployment) if status else None
    return int(dep.replica_states.get("RUNNING", 0)) if dep else 0


def wait_app_running(timeout_s: float, app: str = APP_NAME) -> float:
    """Until the app is RUNNING (every deployment healthy); its wall time then. Raises on failure or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return time.time()
        if status is not None and status.status == "DEPLOY_FAILED":
            raise InferdError(f"the Ray Serve app failed to deploy: {status.message}")
        time.sleep(0.2)
    raise InferdError(f"the Ray Serve app was not running within {timeout_s:.0f} s")


class ReplicaWatch:
    """Serve's count of running replicas of `deployment`, polled from its status in a thread while the block
    runs (`with ReplicaWatch(...) as watch:`), as a list of (seconds since t0, count) changes."""

    def __init__(self, deployment: str, t0: float, app: str = APP_NAME):
        self.deployment, self.app, self.t0 = deployment, app, t0
        self.changes: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "ReplicaWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                n = running_replicas(self.deployment, self.app)
            except Exception:  # Serve shutting down
                return
            if not self.changes or self.changes[-1][1] != n:
                self.changes.append((time.time() - self.t0, n))
            self.stop.wait(0.25)

    def count_between(self, start: float, end: float) -> list[int]:
        """The running counts seen from `start` to `end` (seconds since t0): the one in force at `start`, and
        every change up to `end`."""
        before = [c for t, c in self.changes if t <= start][-1:]
        return before + [c for t, c in self.changes if start < t <= end] or [0]

    def wait_for(self, count: int, timeout: float) -> float:
        """Seconds since t0 when `count` replicas were first seen running; raises after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.changes and self.changes[-1][1] == count:
                return self.changes[-1][0]
            time.sleep(0.1)
        raise InferdError(f"Serve did not reach {count} running replicas within {timeout:.0f} s: {self.changes}")


def replica_stats(deployment: str) -> dict[str, dict]:
    """Each replica of `deployment` by its id: its own counters, as the request router reads them
    (`EngineReplica.record_routing_stats`), with its actor's name under "actor". A replica going away
    meanwhile is left out."""
    import ray

    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith("SERVE_REPLICA::") and deployment in name:
            try:
                handle = ray.get_actor(name, namespace=actor["namespace"])
                stats = ray.get(handle.record_routing_stats.remote(), timeout=10)
            except Exception:
                continue
            out[stats["replica"]] = stats | {"actor": name}
    return out


# -- a local Ray instance ---------------------------------------------------------------------------------
@dataclass
class LocalRay:
    """A Ray instance of this process's own (`local_ray`): Serve's URL, the processes Ray started (read just
    before shutdown: GCS, raylet, workers, replicas) and those of them still alive after it."""

    url: str
    pids: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children()}


def _with_descendants(roots: set[int]) -> list[int]:
    import psutil

    pids = set(roots)
    for pid in roots:
        with suppress(psutil.NoSuchProcess):
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return sorted(pids)


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@contextmanager
def local_ray(
    port: int, *, num_cpus: int = 4, env_vars: dict[str, str] | None = None, linger_s: float = 20.0
) -> Iterator[LocalRay]:
    """Ray started for this process alone (`address="local"`: never a cluster already running on the machine)
    with Serve's HTTP proxy on 127.0.0.1:`port`; Serve and Ray shut down at the end whatever happened, and
    `left` names any process Ray started that is still alive `linger_s` later. A start a loaded machine can
    miss once (Ray gives its raylet a fixed 30 s to register; Serve kills an HTTP proxy slow to report
    healthy) is tried again, Serve's on another free port."""
    import ray

    from inferd.procs import free_port

    before = _children()
    runtime_env = {"env_vars": env_vars} if env_vars else None
    for attempt in range(2):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env=runtime_env,
            )
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    roots = _children() - before  # GCS, raylet, monitors: the processes ray.init started
    run = LocalRay("")
    try:
        for attempt in range(2):
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                break
            except RayActorError:
                serve.shutdown()
                if attempt:
                    raise
                port = free_port()
        run.url = f"http://127.0.0.1:{port}"
        yield run
    finally:
        try:
            with suppress(Exception):  # Ray's processes and their children (workers, replicas), now
                run.pids = _with_descendants(roots)
            serve.shutdown()
        finally:
            ray.shutdown()
            deadline = time.monotonic() + linger_s
            while (left := _alive(run.pids)) and time.monotonic() < deadline:
                time.sleep(0.2)
            run.left = left
