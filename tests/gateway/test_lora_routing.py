"""LoRA adapters through the gateway: a route lists the adapters its replicas serve, a request naming one goes
to the route's pools under the adapter's name, and the picker prefers replicas running the adapter, then those
with a free slot (read from each replica's `lora_requests_info`)."""

from __future__ import annotations

import random

import httpx
import pytest

from inferd.gateway.config import GatewayConfig
from inferd.gateway.picker import Candidate, Picker, score_lora_affinity
from inferd.gateway.replicas import Load, Pool, Replica, parse_load
from inferd.gateway.routes import ModelRouter
from tests.engine.lora_adapters import make_adapter
from tests.gateway.conftest import base_config, healthy_replicas, wait_until

pytestmark = pytest.mark.timeout(180)


def test_lora_requests_info_is_read_from_either_name():
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 1.7e9\n'
        "# TYPE inferd:num_requests_waiting gauge\n"
        'inferd:num_requests_waiting{model_name="m"} 3\n'
    )
    load = parse_load(text, at=0.0)
    assert load.lora_active == {"sql", "chat", "x"} and load.max_loras == 2 and load.waiting == 3
    assert parse_load("", at=0.0).max_loras is None  # a server that publishes nothing: unknown, not zero slots


def _candidate(active: set[str], slots: int | None, adapter: str | None) -> Candidate:
    load = Load(at=0.0, lora_active=frozenset(active), max_loras=slots)
    return Candidate(Replica("http://r", "p"), load, 0.0, adapter)


def test_lora_affinity_prefers_running_then_free_slots():
    assert score_lora_affinity(_candidate({"sql"}, 2, "sql")) == 1.0
    assert score_lora_affinity(_candidate({"chat"}, 2, "sql")) == 0.5  # a free slot
    assert score_lora_affinity(_candidate({"chat", "x"}, 2, "sql")) == 0.0  # every slot in use
    assert score_lora_affinity(_candidate(set(), None, "sql")) == 0.0  # serves no adapters (or unknown)
    assert score_lora_affinity(_candidate(set(), None, None)) == 1.0  # the base model: every replica alike
    config = GatewayConfig.model_validate(_config(["http://a", "http://b"], ["sql"]))
    picker = Picker(config.routing, stale_after_s=10.0, rng=random.Random(0))
    a, b = _candidate({"chat"}, 1, "sql"), _candidate({"sql"}, 1, "sql")
    assert picker.pick([a, b]).replica is b.replica  # same load otherwise: the one running the adapter


def _config(urls: list[str], adapters: list[str]) -> dict:
    pools = [{"name": n, "replicas": urls, "model": "tiny"} for n in ("p", "spare", "third")]
    models = [
        {"name": "tiny", "adapters": adapters, "backends": [{"pool": "p"}],
         "fallbacks": [{"pool": "spare"}, {"model": "other"}]},
        {"name": "other", "backends": [{"pool": "third"}]},
    ]  # fmt: skip
    return base_config(pools, models)


def test_adapters_route_under_their_own_name():
    config = GatewayConfig.model_validate(_config(["http://a"], ["sql", "chat"]))
    pools = {p.name: Pool(p) for p in config.pools}
    router = ModelRouter(config, pools)
    assert set(router.names()) == {"tiny", "sql", "chat", "other"}
    plan = router.plan("sql")
    assert [(t.pool.name, t.model, t.adapter) for t in plan] == [("p", "sql", "sql"), ("spare", "sql", "sql")]
    base = router.plan("tiny")  # the base model follows every fallback, another model's too
    assert [(t.pool.name, t.adapter) for t in base] == [("p", None), ("spare", None), ("third", None)]
    with pytest.raises(ValueError, match="adapter .other. is used twice"):
        GatewayConfig.model_validate(_config(["http://a"], ["other"]))


@pytest.fixture(scope="module")
def lora_replicas(tiny_llama, logs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gw-adapters")
    modules = [f"{n}={make_adapter(tiny_llama, root / n, seed=i)}" for i, n in enumerate(["sql", "chat"])]
    yield from healthy_replicas(tiny_llama, logs, 2, "--lora-modules", *modules, "--max-loras", "1")


def test_adapter_requests_through_a_gateway(lora_replicas, gateway):
    gw = gateway(_config([r.url for r in lora_replicas], ["sql", "chat"]))
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    direct = httpx.post(f"{lora_replicas[0].url}/v1/completions", json={**body, "model": "sql"}, timeout=30).json()
    r = httpx.post(f"{gw.url}/v1/completions", json={**body, "model": "sql"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql" and r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    base = httpx.post(f"{gw.url}/v1/completions", json={**body, "model": "tiny"}, timeout=30).json()
    assert base["choices"][0]["text"] != direct["choices"][0]["text"]
    assert {m["id"] for m in httpx.get(f"{gw.url}/v1/models").json()["data"]} == {"tiny", "sql", "chat", "other"}

    def slots_known() -> bool:
        text = httpx.get(f"{lora_replicas[1].url}/metrics", timeout=10).text
        return parse_load(text, at=0.0).max_loras == 1

    wait_until(slots_known, what="the replicas publish their LoRA slots")
