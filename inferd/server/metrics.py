"""Prometheus metrics under vLLM's names with the `inferd:` prefix, so dashboards and KEDA queries carry over.

Per-request latencies come from the engine's own timestamps (RequestMetrics), observed on the step thread
through AsyncEngine's hooks. Gauges and the engine's cumulative counters are read from the latest stats
snapshot at scrape time. Each app gets its own CollectorRegistry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.engine.async_engine import EngineHooks
from inferd.engine.engine import EngineStats
from inferd.outputs import RequestMetrics, RequestOutput

# vLLM's buckets, so histogram_quantile queries written for vLLM read the same
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680]

P = "inferd:"


def parse_buckets(text: str) -> list[float]:
    """`--ttft-buckets 0.1,0.2,0.4`: upper bounds in seconds, positive, sorted, no duplicates."""
    try:
        bounds = sorted({float(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"histogram buckets are seconds separated by commas, got {text!r}") from None
    if not bounds or bounds[0] <= 0 or bounds[-1] == float("inf"):
        raise ValueError(f"histogram buckets must be finite and positive, got {text!r}")
    return bounds


class _EngineStateCollector(Collector):
    """Gauges and the engine's own cumulative counters, read from the latest snapshot when scraped."""

    def __init__(self, model_name: str, snapshot: Callable[[], tuple[EngineStats, int]]):
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        stats, pending = self.snapshot()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting + pending)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_cache_usage)
        yield counter("num_preemptions", "Preemptions (by recompute) since start.", stats.num_preemptions)
        yield counter("prefix_cache_queries", "Prefix cache queries since start.", stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits since start.", stats.prefix_cache_hits)
        # vLLM's spec_decode_* counters (zero without --speculative-method)
        yield counter("spec_decode_num_drafts", "Requests' steps with drafts since start.", stats.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            labels=[*labels, "position"],
        )
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], n)
        yield per_pos
        yield from _lora_families(stats, labels, values)
        yield from _tier_families(stats, labels, values)


_TIER_COUNTERS = {  # TierStats field -> (metric, help)
    "hits": ("kv_tier_hits", "KV blocks loaded back from a KV tier on a prefix hit, instead of recomputed."),
    "stored": ("kv_tier_stored", "KV blocks written into a KV tier (evicted from the cache, or demoted)."),
    "demoted": ("kv_tier_demoted", "KV blocks moved on to the next tier when a tier was full."),
    "dropped": ("kv_tier_dropped", "KV blocks dropped from a tier (full, damaged, or moved up a tier)."),
    "checksum_failures": ("kv_tier_checksum_failures", "KV tier blocks whose bytes failed their checksum."),
    "load_seconds": ("kv_tier_load_seconds", "Time spent copying KV blocks from a tier into the cache."),
    "store_seconds": ("kv_tier_store_seconds", "Time spent copying KV blocks into a tier."),
}
_TIER_GAUGES = {
    "blocks": ("kv_tier_blocks", "KV blocks a tier holds."),
    "capacity": ("kv_tier_capacity_blocks", "KV blocks a tier can hold."),
}


def _tier_families(stats: EngineStats, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The KV tiers behind the cache (inferd/engine/kv_tier.py), per medium; nothing without tiers."""
    if not stats.kv_tiers:
        return
    for fields, kind in ((_TIER_COUNTERS, CounterMetricFamily), (_TIER_GAUGES, GaugeMetricFamily)):
        for attr, (name, doc) in fields.items():
            family = kind(P + name, doc, labels=[*labels, "medium"])
            for medium, tier in stats.kv_tiers.items():
                family.add_metric([*values, medium], getattr(tier, attr))
            yield family


def _lora_families(stats: EngineStats, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """vLLM's `lora_requests_info` (the adapters of running and waiting sequences, the slots; its value the
    time of the stats, as vLLM sets it), which llm-d's LoRA-affinity scorer reads, and per-adapter counters."""
    info = GaugeMetricFamily(
        P + "lora_requests_info",
        "Running stats on LoRA requests.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(sorted(stats.running_loras)), ",".join(sorted(stats.waiting_loras)),
                     str(stats.max_loras)], stats.taken)  # fmt: skip
    yield info
    loads = CounterMetricFamily(P + "lora_loads", "LoRA adapters loaded into a slot since start.", labels=labels)
    loads.add_metric(values, stats.lora_loads)
    yield loads
    load_time = CounterMetricFamily(P + "lora_load_seconds", "Time spent loading LoRA adapters.", labels=labels)
    load_time.add_metric(values, stats.lora_load_seconds)
    yield load_time
    for kind, counts in (("prompt", stats.lora_prompt_tokens), ("generation", stats.lora_generation_tokens)):
        family = CounterMetricFamily(
            P + f"lora_{kind}_tokens", f"{kind.capitalize()} tokens of finished requests, per LoRA adapter.",
            labels=[*labels, "lora_name"],
        )  # fmt: skip
        for name, n in sorted(counts.items()):
            family.add_metric([*values, name], n)
        yield family


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        ttft_buckets: list[float] | None = None,
        itl_buckets: list[float] | None = None,
        cache_config: dict[str, str] | None = None,
    ):
        """`ttft_buckets`/`itl_buckets` replace vLLM's: finer around an SLO, a quantile read from them is closer.
        `cache_config`: the KV cache's settings, exposed as `cache_config_info` labels (vLLM's info gauge)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(P + name, doc, lbl, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist(
            "time_to_first_token_seconds", "Time to first token (arrival to first token).", ttft_buckets or TTFT_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", itl_buckets or ITL_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled.", lbl, registry=r).labels(
            model_name
        )
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", lbl, registry=r).labels(
            model_name
        )
        self.success = Counter(
            P + "request_success", "Finished sequences by finish reason.", [*lbl, "finished_reason"], registry=r
        )
        if cache_config:
            names = sorted(cache_config)
            info = Gauge(P + "cache_config_info", "The KV cache's configuration (value 1).", names, registry=r)
            info.labels(*(cache_config[n] for n in names)).set(1)
        self._started: set[str] = set()  # requests whose prompt tokens are already counted
        self._snapshot: Callable[[], tuple[EngineStats, int]] | None = None
        r.register(_EngineStateCollector(model_name, lambda: self._snapshot()))

    def attach(self, snapshot: Callable[[], tuple[EngineStats, int]]) -> EngineHooks:
        """Bind to an engine: `snapshot` gives (latest stats, requests not yet queued in the engine)."""
        self._snapshot = snapshot
        return EngineHooks(on_step=self.on_step, on_abort=self.on_abort)

    # -- step-thread hooks -------------------------------------------------------------------------
    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self._started:
                self._started.add(out.request_id)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
            if new_tokens:
                self.generation_tokens.inc(new_tokens)
            if out.finished:
                self._started.discard(out.request_id)
                for c in out.outputs:
                    self.success.labels(self.model_name, c.finish_reason or "abort").inc()
                if out.metrics is not None:
                    self._observe(out.metrics)

    def on_abort(self, request_id: str) -> None:
        self._started.discard(request_id)
        self.success.labels(self.model_name, "abort").inc()

    def _observe(self, m: RequestMetrics) -> None:
        t = m.times
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        if t.first_scheduled is not None:
            self.queue.observe(t.first_scheduled - t.arrival)
        if t.first_token is None:
            return
        self.ttft.observe(t.first_token - t.arrival)
        if t.first_scheduled is not None:
            self.prefill.observe(t.first_token - t.first_scheduled)
        if t.last_token is not None:
            self.decode.observe(t.last_token - t.first_token)
            if t.first_scheduled is not None:
                self.inference.observe(t.last_token - t.first_scheduled)
        for gap in t.inter_token_latencies:
            self.itl.observe(gap)
