"""A pool's signals, read from its replicas' `/metrics` directly or from a Prometheus server's HTTP API.

Both sources give the same `Measured` numbers over the policy's window: gauges summed over the pool's
replicas (waiting, running, KV cache usage), rates from counter increases (requests, prompt and
generated tokens), and the TTFT/ITL p95 estimated from the histograms' bucket increases exactly as
PromQL's `histogram_quantile(0.95, sum by (le) (rate(..._bucket[w])))` does: linear within the bucket
that holds the rank, so the estimate is only as fine as the buckets (see `buckets_around` and
docs/autoscaling.md).

The predicted TTFT reacts before any histogram can: (requests queued ahead per ready replica + 1) x the
mean prompt / the measured prefill speed (prompt tokens per second of prefill time, from
`inferd:prompt_tokens` and `inferd:request_prefill_time_seconds`). A request that has not got its first
token yet is in no histogram; this counts it the moment it queues.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferd.autoscale.policy import Signals

QUANTILE = 0.95
# the names read (inferd's; vLLM's `vllm:` prefix is read the same), without the prefix
GAUGES = {"num_requests_waiting": "waiting", "num_requests_running": "running", "kv_cache_usage_perc": "kv"}
COUNTERS = {
    "request_success_total": "requests",
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": "generation_tokens",
    "request_prefill_time_seconds_sum": "prefill_s",
    "request_prefill_time_seconds_count": "prefills",
}
HISTOGRAMS = {"time_to_first_token_seconds_bucket": "ttft", "inter_token_latency_seconds_bucket": "itl"}


@dataclass
class Measured:
    """What the replicas of one pool report over a window."""

    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    request_rate: float = 0.0
    prompt_token_rate: float = 0.0
    generation_token_rate: float = 0.0
    prefill_tokens_per_s: float | None = None  # per replica, while prefilling
    mean_prompt_tokens: float | None = None

    def signals(self, at: float, ready: int, loading: int = 0, gateway_waiting: float = 0.0) -> Signals:
        return Signals(
            at=at,
            ready=ready,
            loading=loading,
            waiting=self.waiting,
            gateway_waiting=gateway_waiting,
            running=self.running,
            kv_cache_usage=self.kv_cache_usage,
            ttft_p95_s=self.ttft_p95_s,
            itl_p95_s=self.itl_p95_s,
            predicted_ttft_s=self.predicted_ttft(ready, gateway_waiting),
            request_rate=self.request_rate,
            token_rate=self.prompt_token_rate + self.generation_token_rate,
        )

    def predicted_ttft(self, ready: int, gateway_waiting: float = 0.0) -> float | None:
        """(queued per ready replica + 1) x mean prompt / prefill speed; None before any prefill is measured."""
        if ready == 0 or not self.prefill_tokens_per_s or self.mean_prompt_tokens is None:
            return None
        ahead = (self.waiting + gateway_waiting) / ready
        return (ahead + 1) * self.mean_prompt_tokens / self.prefill_tokens_per_s


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's estimate from cumulative bucket counts {upper bound: count}; None with no observation."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for i, b in enumerate(bounds):
        c = buckets[b]
        if c >= rank:
            if b == math.inf:
                return bounds[-2] if len(bounds) > 1 else None
            if i == 0 and b <= 0:
                return b
            in_bucket = c - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / in_bucket if in_bucket else 1.0)
        prev_bound, prev_count = b, c
    return None


def buckets_around(targets: Iterable[float], base: Iterable[float]) -> list[float]:
    """`base` plus bounds at 50% to 200% of each target, 5% apart near it, so a p95 near a target reads to
    within a few percent (a bucket's width bounds the error of a quantile that falls in it)."""
    fractions = [0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 1.75, 2.0]
    out = set(base)
    for t in targets:
        out.update(round(t * f, 6) for f in fractions)
    return sorted(b for b in out if b > 0)


# -- straight from the replicas ------------------------------------------------------------------------


@dataclass
class Scrape:
    """One replica's `/metrics` page at `at`, the names above summed over their label sets."""

    at: float
    values: dict[str, float] = field(default_factory=dict)
    hist: dict[str, dict[float, float]] = field(default_factory=dict)


def parse_scrape(text: str, at: float) -> Scrape:
    s = Scrape(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix, _, name = sample.name.partition(":")
            if prefix not in ("inferd", "vllm"):
                continue
            key = GAUGES.get(name) or COUNTERS.get(name)
            if key is not None:
                s.values[key] = s.values.get(key, 0.0) + sample.value
            elif name in HISTOGRAMS:
                h = s.hist.setdefault(HISTOGRAMS[name], {})
                le = float(sample.labels["le"])
                h[le] = h.get(le, 0.0) + sample.value
    return s


def _increase(new: float, old: float) -> float:
    return new if new < old else new - old  # a counter that went down restarted from zero


class DirectSource:
    """Scrapes each replica's `/metrics` when asked and keeps a window of scrapes per replica.

    A replica contributes to rates and quantiles from its second scrape (as `rate()` needs two points).
    """

    def __init__(self, window_s: float, timeout_s: float = 2.0, client: httpx.Client | None = None):
        self.window_s = window_s
        self.client = client or httpx.Client(timeout=timeout_s)
        self.history: dict[str, dict[str, deque[Scrape]]] = {}  # pool -> replica URL -> its scrapes

    def close(self) -> None:
        self.client.close()

    def read(self, pool: str, urls: list[str], at: float) -> Measured:
        scrapes = []
        for url in urls:
            try:
                r = self.client.get(url.rstrip("/") + "/metrics")
                r.raise_for_status()
                scrapes.append((url, parse_scrape(r.text, at)))
            except (httpx.HTTPError, ValueError):
                continue  # a replica that does not answer adds nothing this round
        return self.add(scrapes, at, pool)

    def add(self, scrapes: list[tuple[str, Scrape]], at: float, pool: str = "") -> Measured:
        """Fold in this round's scrapes of `pool` (also how tests feed synthetic pages), measure the window.
        Each pool keeps its own history: reading one pool forgets none of another's."""
        history = self.history.setdefault(pool, {})
        seen = {url for url, _ in scrapes}
        for url, s in scrapes:
            h = history.setdefault(url, deque())
            h.append(s)
            while len(h) > 2 and h[1].at <= at - self.window_s:
                h.popleft()
        m = Measured()
        incs: dict[str, float] = {}
        per_s: dict[str, float] = {}
        hists: dict[str, dict[float, float]] = {}
        for url in seen:
            h = history[url]
            last = h[-1]
            m.waiting += last.values.get("waiting", 0.0)
            m.running += last.values.get("running", 0.0)
            m.kv_cache_usage += last.values.get("kv", 0.0)
            if len(h) < 2 or last.at <= h[0].at:
                continue
            first, dt = h[0], last.at - h[0].at
            for key in COUNTERS.values():
                inc = _increase(last.values.get(key, 0.0), first.values.get(key, 0.0))
                incs[key] = incs.get(key, 0.0) + inc
                per_s[key] = per_s.get(key, 0.0) + inc / dt
            for name, buckets in last.hist.items():
                merged = hists.setdefault(name, {})
                old = first.hist.get(name, {})
                for le, c in buckets.items():
                    merged[le] = merged.get(le, 0.0) + _increase(c, old.get(le, 0.0))
        for url in set(history) - seen:
            del history[url]
        m.request_rate = per_s.get("requests", 0.0)
        m.prompt_token_rate = per_s.get("prompt_tokens", 0.0)
        m.generation_token_rate = per_s.get("generation_tokens", 0.0)
        m.ttft_p95_s = histogram_quantile(QUANTILE, hists.get("ttft", {}))
        m.itl_p95_s = histogram_quantile(QUANTILE, hists.get("itl", {}))
        if incs.get("prefill_s", 0.0) > 0 and incs.get("prefills", 0.0) > 0:
            m.prefill_tokens_per_s = incs["prompt_tokens"] / incs["prefill_s"]
            m.mean_prompt_tokens = incs["prompt_tokens"] / incs["prefills"]
        return m


# -- from Prometheus ----------------------------------------------------------------------------------


def pool_queries(pool: str, window_s: float, label: str = "pool") -> dict[str, str]:
    """The PromQL behind each signal of `pool` (replicas carry `label="<pool>"`); one value each."""
    sel = f'{{{label}="{pool}"}}'
    w = f"[{max(1, round(window_s))}s]"

    def rate(name: str) -> str:
        return f"sum(rate(inferd:{name}{sel}{w}))"

    def quantile(name: str) -> str:
        return f"histogram_quantile({QUANTILE}, sum by (le) (rate(inferd:{name}_bucket{sel}{w})))"

    return {
        "waiting": f"sum(inferd:num_requests_waiting{sel})",
        "running": f"sum(inferd:num_requests_running{sel})",
        "kv_cache_usage": f"sum(inferd:kv_cache_usage_perc{sel})",
        "ttft_p95_s": quantile("time_to_first_token_seconds"),
        "itl_p95_s": quantile("inter_token_latency_seconds"),
        "request_rate": rate("request_success_total"),
        "prompt_token_rate": rate("prompt_tokens_total"),
        "generation_token_rate": rate("generation_tokens_total"),
        "prefill_tokens_per_s": f"{rate('prompt_tokens_total')} / {rate('request_prefill_time_seconds_sum')}",
        "mean_prompt_tokens": f"{rate('prompt_tokens_total')} / {rate('request_prefill_time_seconds_count')}",
    }


class PrometheusError(RuntimeError):
    pass


class PrometheusSource:
    """Reads the signals from a Prometheus server that scrapes the replicas with a `pool` label."""

    def __init__(self, url: str, window_s: float, timeout_s: float = 5.0, client: httpx.Client | None = None):
        self.url = url.rstrip("/")
        self.window_s = window_s
        self.client = client or httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def query(self, promql: str) -> float | None:
        """One instant query's single value; None when it has none (no series, or NaN from 0/0)."""
        try:
            r = self.client.get(f"{self.url}/api/v1/query", params={"query": promql})
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise PrometheusError(f"querying {self.url}: {e}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{promql}: {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) or math.isinf(value) else value

    def read(self, pool: str, urls: list[str], at: float) -> Measured:
        m = Measured()
        for name, promql in pool_queries(pool, self.window_s).items():
            v = self.query(promql)
            if v is not None or name in ("ttft_p95_s", "itl_p95_s", "prefill_tokens_per_s", "mean_prompt_tokens"):
                setattr(m, name, v)
        return m
