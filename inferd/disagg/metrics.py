"""Prometheus metrics of the KV handoff, on both roles, read from the connector's counters when scraped.

Names follow the server's `inferd:` prefix; the connector's `DisaggStats` is passed in as any object with
its fields, so this module needs nothing from the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

P = "inferd:"


class DisaggCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], Any], buckets: list[float], served: Callable[[], Any]):
        self.model_name = model_name
        self.stats = stats
        self.buckets = buckets
        self.served = served  # the prefill channel's ServerStats, or None

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        labels, values = ["model_name", "role"], [self.model_name, s.role]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        served = self.served()
        yield counter("kv_transfer_bytes", "KV bytes pulled by this decode instance.", s.bytes_transferred)
        yield counter("kv_transfer_blocks", "KV blocks pulled by this decode instance.", s.blocks_transferred)
        yield counter(
            "kv_transfer_blocks_prefix_hit",
            "Blocks a lease offered that this instance's prefix cache already held (not pulled).",
            s.blocks_prefix_hit,
        )
        yield counter(
            "kv_served_bytes", "KV bytes sent over TCP by this prefill instance.", served.bytes_served if served else 0
        )
        yield counter(
            "kv_served_blocks",
            "KV blocks sent over TCP by this prefill instance.",
            served.blocks_served if served else 0,
        )
        transfers = CounterMetricFamily(
            P + "kv_transfers", "Pulls by this decode instance, by transport.", labels=[*labels, "transport"]
        )
        for transport, n in sorted(s.transfers.items()):
            transfers.add_metric([*values, transport], n)
        yield transfers
        yield counter("remote_prefills", "Requests whose prompt K/V came from a prefill instance.", s.remote_prefills)
        local = CounterMetricFamily(
            P + "local_prefills", "Requests a decode instance prefilled itself, by reason.", labels=[*labels, "reason"]
        )
        for reason, n in sorted(s.local_prefills.items()):
            local.add_metric([*values, reason], n)
        yield local
        yield counter(
            "kv_transfer_failures", "Pulls that failed (the request was prefilled locally).", s.transfer_failures
        )
        yield counter(
            "kv_checksum_failures", "Pulled blocks whose checksum did not match the lease.", s.checksum_failures
        )
        yield counter("kv_leases_created", "Leases handed out by this prefill instance.", s.leases_created)
        yield counter("kv_leases_released", "Leases acknowledged by a decode instance.", s.leases_released)
        yield counter("kv_lease_expiries", "Leases that expired before an acknowledgement.", s.lease_expiries)
        rejected = CounterMetricFamily(
            P + "kv_transfer_params_rejected",
            "kv_transfer_params not used, by reason: a decode instance prefilled the request itself, "
            "a prefill instance refused it (400).",
            labels=[*labels, "reason"],
        )
        for reason, n in sorted(s.params_rejected.items()):
            rejected.add_metric([*values, reason], n)
        yield rejected
        yield gauge("kv_leases_active", "Leases holding blocks now.", s.leases_active)
        yield gauge("kv_blocks_leased", "Blocks pinned under leases now.", s.blocks_leased)
        hist = HistogramMetricFamily(P + "kv_transfer_seconds", "Time to pull one request's KV blocks.", labels=labels)
        cumulative = list(zip([str(b) for b in self.buckets], s.transfer_buckets, strict=True))
        hist.add_metric(values, [*cumulative, ("+Inf", s.transfer_count)], s.transfer_sum)
        yield hist
