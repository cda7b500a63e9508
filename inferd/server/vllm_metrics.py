"""`--metrics-names vllm`: /metrics also carries every `inferd:` metric under vLLM's `vllm:` name.

inferd's metrics already follow vLLM's names and buckets with its own prefix; tools written for vLLM
look for `vllm:` (llm-d's endpoint picker reads `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`, KEDA queries and vLLM's Grafana dashboards use the rest). With this on,
the same samples are exposed twice, under both prefixes, plus the names older vLLM versions used
(`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`); `vllm:lora_requests_info`, which
the picker's LoRA scorer reads, is `inferd:lora_requests_info` renamed like the rest. The aliases are computed at scrape
time from the same collectors, so they can never disagree with the `inferd:` values.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

CHOICES = ("inferd", "vllm")
SOURCE_PREFIX = "inferd:"
VLLM_PREFIX = "vllm:"
# names older vLLM versions (and the dashboards written for them) use for the same metric
LEGACY = {"kv_cache_usage_perc": "gpu_cache_usage_perc", "inter_token_latency_seconds": "time_per_output_token_seconds"}


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    old = family.name
    for s in family.samples:
        out.samples.append(s._replace(name=name + s.name[len(old) :]))
    return out


class VllmAliases(Collector):
    """The `inferd:` families of `source` again, under `vllm:` (and legacy vLLM) names."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(SOURCE_PREFIX):
                continue
            base = family.name[len(SOURCE_PREFIX) :]
            yield _renamed(family, VLLM_PREFIX + base)
            if base in LEGACY:
                yield _renamed(family, VLLM_PREFIX + LEGACY[base])


def exposition_registry(source: CollectorRegistry, names: str) -> CollectorRegistry:
    """What /metrics serves: `source` itself, or with `vllm` also its aliases."""
    if names not in CHOICES:
        raise ValueError(f"metrics names must be one of {CHOICES}, got {names!r}")
    if names == "inferd":
        return source
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(source)
    exposed.register(VllmAliases(source))
    return exposed
