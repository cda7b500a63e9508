"""Replicas and pools: each replica's health, ejection, in-flight count and last scraped load.

`Replicas` is the one pool type of inferd's HTTP front doors: the gateway's `Pool` adds its config's DNS
name and reload, and the disaggregation proxy picks the least-loaded replica of one. Both follow a list
file (`ListFile`) that `inferd up` rewrites as it scales.

A replica's load comes from its Prometheus `/metrics` (inferd's `inferd:*` names, or vLLM's `vllm:*`),
scraped at a short interval by `monitor.py`. A load older than `stale_after_s` is unknown, never idle.
The in-flight count is the gateway's own and always fresh: it is raised when a replica is picked,
before the pick is returned, so a burst of requests sees each other.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from inferd.gateway.config import HealthConfig, PoolConfig, replica_url_problem
from inferd.measure.stats import DecayedRate

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
    # vLLM's lora_requests_info: adapters of running or waiting requests, and the slots (None: not published)
    lora_active: frozenset[str] = frozenset()
    max_loras: int | None = None


def parse_load(text: str, at: float) -> Load:
    """Sum the load gauges of a Prometheus text page (one replica may serve several model names)."""
    load = Load(at=at)
    values: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("inferd:lora_requests_info", "vllm:lora_requests_info"):
                _read_lora_info(load, sample.labels)
                continue
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


def _read_lora_info(load: Load, labels: dict[str, str]) -> None:
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    load.lora_active = load.lora_active | {n for n in names.split(",") if n}
    with contextlib.suppress(ValueError):  # a label that is no number: the slots stay unknown
        load.max_loras = max(load.max_loras or 0, int(labels.get("max_lora", "0")))


CACHE_HALF_LIFE_S = 300.0  # how fast a replica's cache value forgets the hits it served


@dataclass(eq=False)
class Replica:
    url: str
    pool: str
    in_flight: int = 0
    in_flight_tokens: int = 0  # prompt + expected output tokens of the requests in flight there
    picks: int = 0  # times a least-loaded pick chose it (its tie-break)
    load: Load | None = None
    healthy: bool = True  # until a probe or a request says otherwise
    failures: int = 0
    ejected_until: float = 0.0
    # prefix blocks its cache served to requests routed here, recently (as the prefix index predicted them):
    # what this replica's cache is worth, and so which replica a scale-down should stop first
    cache_hits: DecayedRate = field(default_factory=lambda: DecayedRate(CACHE_HALF_LIFE_S))
    # tokens of the prefixes asked for lately that only this replica holds (inferd/gateway/cache_worth.py): what
    # the traffic would compute again without it, and so the rank a scale-down stops replicas in
    cache_worth: int = 0

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


class ListFile:
    """A file of replica URLs, one a line (`#` starts a comment), read again when it changes.

    A change is a new inode, mtime or size, so a list renamed over or rewritten within one mtime tick is
    still seen. A missing file lists nothing until it appears; a line that is not a replica URL is logged
    and skipped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._key: tuple | None = ()  # (inode, mtime, size) when last read; None: missing; (): never read

    def _stat(self) -> tuple | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def changed(self) -> bool:
        return self._stat() != self._key

    def read(self) -> list[str]:
        key = self._stat()
        try:
            text = "" if key is None else self.path.read_text()
        except OSError:
            key, text = None, ""
        self._key = key
        urls = []
        for n, line in enumerate(text.splitlines(), 1):
            url = line.split("#", 1)[0].strip()
            problem = replica_url_problem(url) if url else None
            if problem is not None:
                logger.warning("%s:%d: %s; line skipped", self.path, n, problem)
            elif url:
                urls.append(url)
        return urls


class Replicas:
    """One pool's replicas by URL, the front doors' shared pool: static URLs plus those of a list file.

    The set changes only through `sync`: a replica still listed keeps its object (its in-flight count, load
    and health), a new one starts fresh, one no longer listed is dropped (the requests in flight there
    finish on it). `on_change(count)` hears of every change. A subclass may list more URLs (`_urls`)."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        file: str | Path | None = None,
        on_change: Callable[[int], object] | None = None,
    ):
        self.name = name
        self.static = list(urls)
        self.file = None if file is None else ListFile(file)
        self.on_change = on_change
        self.replicas: dict[str, Replica] = {}
        self._file_urls = [] if self.file is None else self.file.read()
        self._resync()

    def _urls(self) -> list[str]:
        return self.static + self._file_urls

    def _resync(self) -> bool:
        return self.sync(self._urls())

    def sync(self, urls: list[str]) -> bool:
        """Make `urls` the replicas, in that order; True if that changed them."""
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        if wanted == list(self.replicas):
            return False
        self.replicas = {u: self.replicas.get(u) or Replica(u, self.name) for u in wanted}
        if self.on_change is not None:
            self.on_change(len(self.replicas))
        return True

    def refresh_discovery(self) -> bool:
        """Re-read the list file if it changed (one `stat` when it did not); True if the replicas changed."""
        if self.file is None or not self.file.changed():
            return False
        self._file_urls = self.file.read()
        return self._resync()

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas.values())


class Pool(Replicas):
    """The gateway's pool: the replicas serving one upstream model, from its config's URLs, its
    `replicas_file` and the addresses its `replicas_dns` name resolves to."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self._dns_urls: list[str] = []
        self.dns_resolved_at = float("-inf")
        super().__init__(config.name, config.replicas, config.replicas_file)

    def _urls(self) -> list[str]:
        return super()._urls() + self._dns_urls

    def set_dns(self, urls: list[str]) -> bool:
        """The addresses the pool's DNS name resolved to; True if the replicas changed."""
        self._dns_urls = urls
        return self._resync()

    def adopt(self, old: Pool) -> None:
        """After a config reload: keep the live state (in-flight, load, health) of replicas still here."""
        self._dns_urls, self.dns_resolved_at = old._dns_urls, old.dns_resolved_at
        if self.config.replicas_dns != old.config.replicas_dns:
            self._dns_urls, self.dns_resolved_at = [], float("-inf")
        self._resync()
        for url in self.replicas:
            if url in old.replicas:  # the same object: requests in flight there decrement its count
                self.replicas[url] = old.replicas[url]
