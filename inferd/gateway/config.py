"""The gateway's YAML config as pydantic models; a validation error names the file and line at fault.

Read through `inferd.yaml_config`, so `inferd gateway` says
"gateway.yaml:12: pools.0.block_size: Input should be greater than 0" instead of a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.config import engine_default
from inferd.yaml_config import RefError, parse_yaml_model, read_text


class _Model(BaseModel):
    # a typo in a config key is an error, not a silently ignored setting
    model_config = ConfigDict(extra="forbid")


class Listen(_Model):
    host: str = "127.0.0.1"
    port: int = Field(9000, ge=0, le=65535)


class ScrapeConfig(_Model):
    """Load signals read from each replica's Prometheus `/metrics`."""

    interval_s: float = Field(0.5, gt=0)
    stale_after_s: float = Field(2.0, gt=0, description="older load data counts as unknown, not as idle")
    timeout_s: float = Field(1.0, gt=0)


class HealthConfig(_Model):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failures_to_eject: int = Field(2, ge=1, description="consecutive failures (probes or requests) that eject")
    ejection_s: float = Field(5.0, ge=0, description="an ejected replica gets no traffic for this long")


class Scorers(_Model):
    """Weights of the weighted sum; 0 turns a scorer off."""

    queue: float = Field(1.0, ge=0)
    kv_cache: float = Field(1.0, ge=0)
    in_flight: float = Field(1.0, ge=0)
    in_flight_tokens: float = Field(
        0.0, ge=0, description="prompt + max_tokens in flight: long requests weigh more than short ones"
    )
    prefix: float = Field(2.0, ge=0)
    lora_affinity: float = Field(
        1.0, ge=0, description="a LoRA adapter's requests: replicas running it first, then those with a free slot"
    )


class Saturation(_Model):
    """A replica past any of these takes no new request; when all are, requests queue at the gateway."""

    max_waiting: int | None = Field(None, ge=0, description="scraped queue depth")
    max_kv_cache_usage: float | None = Field(None, gt=0, le=1)
    max_in_flight: int | None = Field(None, ge=1, description="requests this gateway has in flight there")


class QueueConfig(_Model):
    max_size: int = Field(1024, ge=0)
    max_wait_s: float = Field(30.0, gt=0)
    fairness: Literal["in_flight", "vtc"] = Field(
        "in_flight",
        description="among tenants of one priority, who is admitted first: the fewest requests in flight, or "
        "the least service received (vtc: virtual token counters, weighted by the tenants' weight)",
    )


class RoutingConfig(_Model):
    picker: Literal["scored", "round_robin", "random"] = "scored"
    scorers: Scorers = Scorers()
    saturation: Saturation = Saturation()
    queue: QueueConfig = QueueConfig()


class PrefixIndexConfig(_Model):
    store: Literal["memory", "redis"] = "memory"
    capacity_blocks: int = Field(65536, ge=1, description="blocks remembered per replica (LRU)")
    kv_events: bool = Field(
        True,
        description="subscribe to the KV cache events of replicas that publish them (GET /kv_events) and score "
        "prefix affinity on what their caches hold; the index above scores the others",
    )


class DeletionCostConfig(_Model):
    """On Kubernetes: keep each replica pod's `controller.kubernetes.io/pod-deletion-cost` at what its cache
    serves, so a scale-down removes the least useful cache (inferd/gateway/deletion_cost.py)."""

    enabled: bool = False
    interval_s: float = Field(30.0, gt=0, description="how often the pods are listed and patched")
    api_server: str = "https://kubernetes.default.svc"
    namespace: str | None = Field(None, description="default: the service account's")
    label_selector: str = "app.kubernetes.io/name=inferd,app.kubernetes.io/component=engine"
    token_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


class TracingConfig(_Model):
    """OpenTelemetry: a span per request with a child per upstream attempt, whose context goes to the replica in
    `traceparent` (inferd/tracing.py). Read at start. Without an endpoint the client's traceparent is passed on."""

    otlp_endpoint: str | None = Field(None, description="an OTLP/HTTP collector, e.g. http://otel-collector:4318")
    service_name: str = "inferd-gateway"
    headers: dict[str, str] = Field(default_factory=dict, description="sent with each export (a collector's key)")


class DnsDiscovery(_Model):
    """Replicas behind a DNS name (a Kubernetes headless service, say): every address it resolves to."""

    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(5.0, gt=0, description="how often the name is resolved again")


class PoolConfig(_Model):
    """Replicas that serve one upstream model."""

    name: str = Field(min_length=1)
    replicas: list[str] = Field(default_factory=list, description="base URLs, e.g. http://10.0.0.5:8000")
    replicas_file: Path | None = Field(None, description="one URL a line, re-read when it changes")
    replicas_dns: DnsDiscovery | None = None
    model: str | None = Field(None, description="the model name sent upstream (default: the route's name)")
    api_key: str | None = None
    block_size: int = Field(
        engine_default("block_size"), ge=1, description="the replicas' --block-size, for prefix affinity"
    )
    scheduling_policy: Literal["fcfs", "priority", "deadline"] = Field(
        engine_default("scheduling_policy"),
        description="the replicas' --scheduling-policy: whether a tenant's engine_priority or ttft_deadline_ms is "
        "passed on (an fcfs replica refuses them)",
    )
    tokenizer: str = Field(
        "replica",
        description="'replica' (ask the replica's /tokenize), a tokenizer.json path or folder, or 'estimate'",
    )

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if not self.replicas and self.replicas_file is None and self.replicas_dns is None:
            raise ValueError("a pool needs `replicas`, `replicas_file` or `replicas_dns`")
        return self

    @field_validator("replicas")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for i, u in enumerate(urls):
            problem = replica_url_problem(u)
            if problem is not None:
                raise RefError((i,), problem)
        return [u.rstrip("/") for u in urls]


def replica_url_problem(url: str) -> str | None:
    """What is wrong with a replica's base URL (http or https, a host, a port in 1..65535 if one is given);
    None when nothing is. The config's `replicas` and the lines of a `replicas_file` are both checked here."""
    if not url.startswith(("http://", "https://")):
        return f"replica URL must start with http:// or https://, got {url!r}"
    parts = urlsplit(url)
    if not parts.hostname:
        return f"replica URL {url!r} has no host"
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        return f"replica URL {url!r}: the port must be an integer in 1..65535"
    return None


class Backend(_Model):
    pool: str
    weight: float = Field(1.0, ge=0)
    model: str | None = Field(None, description="upstream model name (default: the pool's, else the route's)")


class Fallback(_Model):
    """Tried in order when no backend could serve: another pool, or another route by model name."""

    pool: str | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one(self) -> Fallback:
        if (self.pool is None) == (self.model is None):
            raise ValueError("a fallback names exactly one of `pool` or `model`")
        return self


class ResumeConfig(_Model):
    """A stream whose replica fails after the client got its first byte is re-issued to another replica of the
    pool with the tokens already sent, and the continuation spliced into the same client stream
    (inferd/gateway/resume.py). Off: such a stream ends with an SSE error event."""

    enabled: bool = False
    max_attempts: int = Field(
        2, ge=1, description="requests sent to resume one stream; past them a break ends it with the error event"
    )
    seed_unseeded: bool = Field(
        True,
        description="a sampled stream without a seed gets one from the gateway (returned in x-inferd-seed), so it "
        "can be continued exactly; off: such a stream ends with the error event when its replica fails",
    )


class RouteConfig(_Model):
    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    #: LoRA adapters the route's replicas serve (`inferd serve --lora-modules`): a request naming one goes where
    #: the route goes, under the adapter's name, to a replica that runs it or has room for it
    adapters: list[str] = Field(default_factory=list)
    backends: list[Backend] = Field(min_length=1)
    fallbacks: list[Fallback] = Field(default_factory=list)
    resume: ResumeConfig = ResumeConfig()

    @model_validator(mode="after")
    def _some_weight(self) -> RouteConfig:
        if sum(b.weight for b in self.backends) <= 0:
            raise ValueError("the backends' weights must not all be 0")
        return self


class TokenLimits(_Model):
    """Per window; unset = unlimited."""

    input: int | None = Field(None, ge=0)
    output: int | None = Field(None, ge=0)
    total: int | None = Field(None, ge=0)
    cost: float | None = Field(None, ge=0, description="limit on the weighted cost, see `cost`")


class CostWeights(_Model):
    input: float = Field(1.0, ge=0)
    cached_input: float = Field(1.0, ge=0)
    output: float = Field(1.0, ge=0)


class Limits(_Model):
    requests: int | None = Field(None, ge=0, description="requests per window")
    tokens: TokenLimits = TokenLimits()
    cost: CostWeights = CostWeights()
    max_concurrent: int | None = Field(None, ge=1)
    window_s: float = Field(60.0, gt=0, description="a window opens at a tenant's first request after the last")


class TenantConfig(_Model):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    api_key_sha256: list[str] = Field(min_length=1, description="sha256 hex digests of the tenant's API keys")
    priority: int = Field(0, description="higher is admitted first when requests queue")
    engine_priority: int | None = Field(
        None,
        description="sent upstream as the request's `priority` (lower runs first) to pools whose replicas run "
        "--scheduling-policy priority, unless the request names one",
    )
    ttft_deadline_ms: float | None = Field(
        None,
        ge=0,
        description="sent upstream as the request's `ttft_deadline_ms` to pools whose replicas run "
        "--scheduling-policy deadline, unless the request names one",
    )
    isolate_cache: bool = Field(False, description="send the tenant id as cache_salt: no prefix shared with others")
    weight: float = Field(1.0, gt=0, description="its share under routing.queue.fairness: vtc (2: twice the tokens)")
    limits: Limits = Limits()
    default_max_tokens: int = Field(
        256, ge=1, description="a request's max_tokens when it sets none: reserved and sent upstream"
    )

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, digests: list[str]) -> list[str]:
        for d in digests:
            if len(d) != 64 or any(c not in "0123456789abcdefABCDEF" for c in d):
                raise ValueError("api_key_sha256 holds sha256 hex digests (64 hex characters), not keys")
        return [d.lower() for d in digests]


class GatewayConfig(_Model):
    listen: Listen = Listen()
    max_body_bytes: int = Field(4 << 20, ge=1024)
    request_timeout_s: float = Field(300.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    retries: int = Field(2, ge=0, description="other replicas tried after a connect error or a 503")
    expose_replica_header: bool = Field(
        False,
        description="answer with `x-inferd-replica: <url>` and `x-inferd-prefix-blocks: <predicted cached>/<full "
        "blocks>` (for debugging and measuring routing)",
    )
    scrape: ScrapeConfig = ScrapeConfig()
    health: HealthConfig = HealthConfig()
    routing: RoutingConfig = RoutingConfig()
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()
    pod_deletion_cost: DeletionCostConfig = DeletionCostConfig()
    tracing: TracingConfig = TracingConfig()
    budget_store: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    redis_timeout_s: float = Field(
        1.0, gt=0, description="connect and answer timeout for Redis; past it a budget check is a 503"
    )
    redis_prefix: str = "inferd-gw"
    pools: list[PoolConfig] = Field(min_length=1)
    models: list[RouteConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(default_factory=list, description="none: no API key is asked for")

    @model_validator(mode="after")
    def _cross_refs(self) -> GatewayConfig:
        pools = {p.name for p in self.pools}
        for i, p in enumerate(self.pools):
            if [q.name for q in self.pools].index(p.name) != i:
                raise RefError(("pools", i, "name"), f"pool name {p.name!r} is used twice")
        names: set[str] = set()
        for i, r in enumerate(self.models):
            fields = [("name",), *(("aliases", k) for k in range(len(r.aliases))),
                      *(("adapters", k) for k in range(len(r.adapters)))]  # fmt: skip
            for n, where in zip([r.name, *r.aliases, *r.adapters], fields, strict=True):
                if n in names:
                    raise RefError(("models", i, *where), f"model name, alias or adapter {n!r} is used twice")
                names.add(n)
        for i, r in enumerate(self.models):
            for kind, refs in (("backends", r.backends), ("fallbacks", r.fallbacks)):
                for j, ref in enumerate(refs):
                    if ref.pool is not None and ref.pool not in pools:
                        msg = f"unknown pool {ref.pool!r}; pools: {sorted(pools)}"
                        raise RefError(("models", i, kind, j, "pool"), msg)
                    if getattr(ref, "model", None) is not None and kind == "fallbacks" and ref.model not in names:
                        raise RefError(("models", i, kind, j, "model"), f"unknown model {ref.model!r}")
        needs_redis = self.budget_store == "redis" or self.prefix_index.store == "redis"
        if needs_redis and not self.redis_url:
            raise ValueError("`redis_url` is required when budget_store or prefix_index.store is redis")
        ids = [t.id for t in self.tenants]
        for i, t in enumerate(self.tenants):
            if ids.index(t.id) != i:
                raise RefError(("tenants", i, "id"), f"tenant id {t.id!r} is used twice")
        return self


def parse_config(text: str, source: str = "<config>") -> GatewayConfig:
    """Validate YAML text; every error names `source:line`."""
    return parse_yaml_model(text, GatewayConfig, source, "gateway config")


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    cfg = parse_config(read_text(path, "gateway config"), str(path))
    base = path.parent
    for pool in cfg.pools:  # relative paths are relative to the config file
        if pool.replicas_file is not None and not pool.replicas_file.is_absolute():
            pool.replicas_file = base / pool.replicas_file
    return cfg
