"""Exact prefix routing through a real gateway to real replicas that publish KV events: the gateway finds blocks
that traffic around it cached, and stops predicting hits on blocks a replica evicted, where the index of keys
it sent keeps predicting them (measured on the replicas' own prefix-cache counters)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.procs import metrics
from tests.gateway.conftest import base_config, healthy_replicas, wait_until

pytestmark = pytest.mark.timeout(180)
BLOCK = 16
ONLY_PREFIX = {"queue": 0, "kv_cache": 0, "in_flight": 0, "in_flight_tokens": 0, "prefix": 1}
PUBLISH = (
    "--enable-kv-cache-events",
    "--kv-events-endpoint",
    "tcp://127.0.0.1:*",
    "--kv-events-replay-endpoint",
    "tcp://127.0.0.1:*",
    "--num-blocks",
    "40",  # 640 tokens: a few prompts evict the oldest blocks
)


@pytest.fixture(scope="module")
def publishing(tiny_llama, logs) -> Iterator[list]:
    yield from healthy_replicas(tiny_llama, logs, 2, *PUBLISH)


def _sample(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _gateway(gateway, replicas, kv_events: bool):
    pool = {"name": "p", "replicas": [r.url for r in replicas], "model": "tiny"}
    cfg = base_config(
        [pool],
        [{"name": "tiny", "backends": [{"pool": "p"}]}],
        routing={"scorers": ONLY_PREFIX},
        prefix_index={"kv_events": kv_events},
    )
    gw = gateway(cfg)
    if kv_events:
        for r in replicas:
            wait_until(lambda r=r: _sample(gw.url, "inferd_gateway_kv_index_synced", replica=r.url) == 1, 20, "sync")
    return gw


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(blocks * BLOCK)]


def test_replica_says_where_it_publishes(publishing):
    info = httpx.get(publishing[0].url + "/kv_events", timeout=5).json()
    assert info["enabled"] and info["block_size"] == BLOCK and info["hash"] == "sha256-chain-int64le"
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and not info["endpoint"].endswith(":*")


def test_finds_prefixes_that_traffic_around_the_gateway_cached(publishing, gateway):
    """Prefixes sent straight to one replica or the other, before the gateway started: with prefix affinity as
    its only scorer, the gateway sends each follow-up to the replica holding it, every time."""
    rng = random.Random(11)
    prefixes = [_prompt(rng, 3) for _ in range(6)]
    for i, p in enumerate(prefixes):
        _complete(publishing[i % 2].url, p + [5])
    gw = _gateway(gateway, publishing, kv_events=True)
    for i, p in enumerate(prefixes):
        r = _complete(gw.url, p + [7, 8])
        assert r.headers["x-inferd-replica"] == publishing[i % 2].url, i
    assert _sample(gw.url, "inferd_gateway_prefix_affinity_source_total", source="events") >= 2 * len(prefixes)
    assert _sample(gw.url, "inferd_gateway_kv_index_blocks", replica=publishing[0].url) > 0
    # the prefix blocks each replica's cache served lately (3 a request here)
    rates = [_sample(gw.url, "inferd_gateway_replica_cache_hit_rate", replica=r.url) for r in publishing]
    assert all(rate > 0 for rate in rates), rates
    # what each cache is worth to a scale-down: the tokens of the 3 prefixes (3 blocks each) only it holds,
    # recomputed every few seconds
    worth = lambda: [_sample(gw.url, "inferd_gateway_replica_cache_worth_tokens", replica=r.url) for r in publishing]
    wait_until(lambda: worth() == [3 * 3 * BLOCK] * 2, timeout=20, what="the replicas' cache worth")


def test_evicted_blocks_are_no_longer_predicted(publishing, gateway):
    """Both gateways send a prefix; its replica then evicts it under other traffic. The gateway that remembers
    what it sent predicts 3 cached blocks the replica no longer has; the one that reads events predicts what
    the replica then really serves from its cache."""
    rng = random.Random(12)
    sent, events = _gateway(gateway, publishing, kv_events=False), _gateway(gateway, publishing, kv_events=True)
    prefix = _prompt(rng, 3)
    holder = _complete(sent.url, prefix + [5]).headers["x-inferd-replica"]
    for _ in range(10):  # 60 new full blocks through a 40-block pool, the prefix's the oldest: all evicted
        _complete(holder, _prompt(rng, 6) + [9])
    time.sleep(0.5)  # the evictions' events reach the gateway (milliseconds)

    def routed(gw) -> tuple[float, float]:
        """(blocks the gateway predicted cached on the replica it picked, blocks that replica served cached)"""
        hit = lambda: _sample(gw.url, "inferd_gateway_prefix_affinity_blocks_total", result="hit")
        before = {r.url: metrics(r.url)["inferd:prefix_cache_hits_total"] for r in publishing}
        predicted = hit()
        _complete(gw.url, prefix + [6])
        served = sum(metrics(r.url)["inferd:prefix_cache_hits_total"] - before[r.url] for r in publishing)
        return hit() - predicted, served / BLOCK

    predicted, served = routed(sent)
    assert (predicted, served) == (3, 0), "the index of keys sent predicts blocks the replica evicted"
    time.sleep(0.5)  # that request cached the prefix on `holder` again: its events reach the gateway
    predicted, served = routed(events)
    assert predicted == served == 3
