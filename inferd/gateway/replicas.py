"""Replicas and pools: each replica's health, ejection, in-flight count and last scraped load.

A replica's load comes from its Prometheus `/metrics` (inferd's `inferd:*` names, or vLLM's `vllm:*`),
scraped at a short interval by `monitor.py`. A load older than `stale_after_s` is unknown, never idle.
The in-flight count is the gateway's own and always fresh: it is raised when a replica is picked,
before the pick is returned, so a burst of requests sees each other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from inferd.gateway.config import HealthConfig, PoolConfig, replica_url_problem

logger = logging.getLogger(__name__)

# sample name without prefix and `_total` -> Load field
_LOAD_NAMES = {
    "num_requests_waiting": "waiting",
    "num_requests_running": "running",
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
}


@dataclass
class Load:
    """What a replica's `/metrics` said at `at` (monotonic seconds)."""

    at: float
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def parse_load(text: str, at: float) -> Load:
    """Sum the load gauges of a Prometheus text page (one replica may serve several model names)."""
    load = Load(at=at)
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1].removesuffix("_total")
            attr = _LOAD_NAMES.get(name)
            if attr is None or not sample.name.startswith(("inferd:", "vllm:")):
                continue
            # one value under several names (inferd: and vllm: with `--metrics-names vllm`, or vLLM's
            # kv_cache_usage_perc next to its older gpu_cache_usage_perc) counts once, inferd's first
            key = (attr, tuple(sorted(sample.labels.items())))
            if key not in values or sample.name.startswith("inferd:"):
                values[key] = sample.value
    for (attr, _), value in values.items():
        setattr(load, attr, getattr(load, attr) + value)
    return load


@dataclass(eq=False)
class Replica:
    url: str
    pool: str
    in_flight: int = 0
    in_flight_tokens: int = 0  # prompt + expected output tokens of the requests in flight there
    load: Load | None = None
    healthy: bool = True  # until a probe or a request says otherwise
    failures: int = 0
    ejected_until: float = 0.0

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def fresh_load(self, now: float, stale_after: float) -> Load | None:
        if self.load is None or now - self.load.at > stale_after:
            return None
        return self.load

    def record_failure(self, health: HealthConfig, now: float | None = None) -> None:
        """A failed probe or a request that could not connect: eject after enough in a row."""
        self.failures += 1
        if self.failures >= health.failures_to_eject:
            self.healthy = False
            self.ejected_until = (now if now is not None else time.monotonic()) + health.ejection_s

    def record_success(self) -> None:
        self.failures = 0
        self.healthy = True


@dataclass(eq=False)
class Pool:
    """The replicas serving one upstream model; static URLs plus those listed in `replicas_file`."""

    config: PoolConfig
    replicas: dict[str, Replica] = field(default_factory=dict)
    _file_mtime: float | None = None
    _file_urls: list[str] = field(default_factory=list)
    _dns_urls: list[str] = field(default_factory=list)
    dns_resolved_at: float = float("-inf")

    def __post_init__(self) -> None:
        self._file_urls = self._read_file()
        self._resync()

    def _resync(self) -> None:
        self.sync(self.config.replicas + self._file_urls + self._dns_urls)

    @property
    def name(self) -> str:
        return self.config.name

    def sync(self, urls: list[str]) -> None:
        """Keep the state of replicas still listed, add new ones, drop the rest (in-flight requests finish)."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        self.replicas = {u: self.replicas.get(u) or Replica(u, self.name) for u in wanted}

    def _read_file(self) -> list[str]:
        path = self.config.replicas_file
        if path is None:
            return []
        try:
            self._file_mtime = path.stat().st_mtime
            text = Path(path).read_text()
        except OSError:
            return []  # a missing list file is an empty list until it appears
        urls = []
        for n, line in enumerate(text.splitlines(), 1):
            url = line.split("#", 1)[0].strip()
            problem = replica_url_problem(url) if url else None
            if problem is not None:
                logger.warning("%s:%d: %s; line skipped", path, n, problem)
            elif url:
                urls.append(url)
        return urls

    def refresh_discovery(self) -> bool:
        """Re-read the list file if it changed; True if the replica set changed."""
        path = self.config.replicas_file
        if path is None:
            return False
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = None
        if mtime == self._file_mtime:
            return False
        before = set(self.replicas)
        self._file_urls = self._read_file()
        self._resync()
        return set(self.replicas) != before

    def set_dns(self, urls: list[str]) -> bool:
        """The addresses the pool's DNS name resolved to; True if the replica set changed."""
        before = set(self.replicas)
        self._dns_urls = urls
        self._resync()
        return set(self.replicas) != before

    def adopt(self, old: Pool) -> None:
        """After a config reload: keep the live state (in-flight, load, health) of replicas still here."""
        self._dns_urls, self.dns_resolved_at = old._dns_urls, old.dns_resolved_at
        if self.config.replicas_dns != old.config.replicas_dns:
            self._dns_urls, self.dns_resolved_at = [], float("-inf")
        self._resync()
        for url in self.replicas:
            if url in old.replicas:  # the same object: requests in flight there decrement its count
                self.replicas[url] = old.replicas[url]
