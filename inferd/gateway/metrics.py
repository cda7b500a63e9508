"""The gateway's Prometheus metrics, under OpenTelemetry's `gen_ai.*` names where they exist.

OpenTelemetry's GenAI semantic conventions name `gen_ai.client.token.usage` (tokens per request, by
`gen_ai.token.type`), `gen_ai.client.operation.duration`, `gen_ai.server.time_to_first_token` and
`gen_ai.server.time_per_output_token`; in Prometheus the dots become underscores. What they do not
cover (rejections, routing, retries, replica state) is under `inferd_gateway_*`. Every request
metric carries the tenant, the model the client asked for and, where one was picked, the replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304]
LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160]
TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5]


class _Memo:
    """`labels(*values)` remembered: prometheus_client takes a lock and checks the values on every call, a
    dozen times per request here. Children are never removed, so a remembered one stays the registered one."""

    def labels(self, *values: str):
        memo = self.__dict__.setdefault("_memo", {})
        child = memo.get(values)
        if child is None:
            child = memo[values] = super().labels(*values)
        return child


class _Counter(_Memo, Counter):
    pass


class _Histogram(_Memo, Histogram):
    pass


class _StateCollector(Collector):
    """Replica and queue gauges, read from the gateway's live state at scrape time."""

    def __init__(self, snapshot: Callable[[], tuple[list, int]]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        replicas, queued = self.snapshot()
        labels = ["pool", "replica"]
        in_flight = GaugeMetricFamily(
            "inferd_gateway_replica_in_flight", "Requests in flight, per replica.", labels=labels
        )
        healthy = GaugeMetricFamily("inferd_gateway_replica_healthy", "1 if the replica takes traffic.", labels=labels)
        cache = GaugeMetricFamily(
            "inferd_gateway_replica_cache_hit_rate",
            "Prefix blocks per second the replica's cache served to requests routed there, as predicted, recently "
            "(half-life 5 min).",
            labels=labels,
        )
        worth = GaugeMetricFamily(
            "inferd_gateway_replica_cache_worth_tokens",
            "Tokens of the prefix blocks asked for in the last 5 min that only this replica of its pool holds: what "
            "the traffic would compute again without it (a scale-down stops the least worth first).",
            labels=labels,
        )
        now = time.monotonic()
        for r, available in replicas:
            in_flight.add_metric([r.pool, r.url], r.in_flight)
            healthy.add_metric([r.pool, r.url], 1.0 if available else 0.0)
            cache.add_metric([r.pool, r.url], r.cache_hits.rate(now))
            worth.add_metric([r.pool, r.url], r.cache_worth)
        yield in_flight
        yield healthy
        yield cache
        yield worth
        q = GaugeMetricFamily("inferd_gateway_queue_size", "Requests waiting at the gateway for a replica.")
        q.add_metric([], queued)
        yield q


class _KVIndexCollector(Collector):
    """The event-driven prefix index (inferd/gateway/kv_index.py), per subscribed replica."""

    def __init__(self, stats: Callable[[], list[tuple[str, int, int, int, bool]]]):
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        blocks = GaugeMetricFamily(
            "inferd_gateway_kv_index_blocks", "Blocks a replica's KV events say its cache holds.", labels=["replica"]
        )
        synced = GaugeMetricFamily(
            "inferd_gateway_kv_index_synced", "1 while the replica's events are in sequence.", labels=["replica"]
        )
        batches = CounterMetricFamily("inferd_gateway_kv_events_batches", "Event batches applied.", labels=["replica"])
        resyncs = CounterMetricFamily(
            "inferd_gateway_kv_events_resyncs", "Replays asked for after a gap in the sequence.", labels=["replica"]
        )
        for url, n, applied, gaps, ok in self.stats():
            blocks.add_metric([url], n)
            synced.add_metric([url], 1.0 if ok else 0.0)
            batches.add_metric([url], applied)
            resyncs.add_metric([url], gaps)
        yield from (blocks, synced, batches, resyncs)


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], tuple[list, int]], kv_stats: Callable[[], list] | None = None):
        self.registry = r = CollectorRegistry()
        req = ["tenant", "model", "replica"]
        self.requests = _Counter(
            "inferd_gateway_requests", "Requests answered, by status code.", [*req, "status"], registry=r
        )
        self.tokens = _Histogram(
            "gen_ai_client_token_usage",
            "Tokens per request, by type (input, output).",
            ["tenant", "gen_ai_request_model", "replica", "gen_ai_token_type"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.duration = _Histogram(
            "gen_ai_client_operation_duration_seconds",
            "Request duration at the gateway, arrival to last byte.",
            ["tenant", "gen_ai_request_model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = _Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Arrival at the gateway to the first streamed token sent on.",
            ["gen_ai_request_model", "replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = _Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time per output token after the first, per streamed request.",
            ["gen_ai_request_model", "replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.upstream_latency = _Histogram(
            "inferd_gateway_upstream_latency_seconds",
            "Request sent upstream to response headers received.",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = _Counter(
            "inferd_gateway_rejections",
            "Requests refused before any engine work, by reason.",
            ["tenant", "model", "reason"],
            registry=r,
        )
        self.errors = _Counter(
            "inferd_gateway_upstream_errors",
            "Upstream failures, by kind.",
            ["tenant", "model", "replica", "kind"],
            registry=r,
        )
        self.retries = _Counter(
            "inferd_gateway_retries", "Requests sent again to another replica.", ["model"], registry=r
        )
        self.resumes = _Counter(
            "inferd_gateway_stream_resumes",
            "Streams whose replica failed after the first byte, by how they went on: exact (continued where they "
            "broke, token for token), greedy (a greedy request re-issued with the output so far as prompt), failed "
            "(ended with the SSE error event).",
            ["model", "outcome"],
            registry=r,
        )
        self.routing = _Counter(
            "inferd_gateway_routing_decisions",
            "Replicas picked, per pool and replica.",
            ["pool", "replica"],
            registry=r,
        )
        self.prefix_blocks = _Counter(
            "inferd_gateway_prefix_affinity_blocks",
            "Full prompt blocks routed, by whether the picked replica held them (hit) or not (miss).",
            ["pool", "result"],
            registry=r,
        )
        self.prefix_source = _Counter(
            "inferd_gateway_prefix_affinity_source",
            "Replicas scored for prefix affinity, by what their score came from: the replica's KV events (events) "
            "or the keys the gateway sent there (sent).",
            ["pool", "source"],
            registry=r,
        )
        r.register(_StateCollector(snapshot))
        if kv_stats is not None:
            r.register(_KVIndexCollector(kv_stats))
