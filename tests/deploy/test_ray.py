"""`inferd deploy ray` (`inferd.deploy.ray`) and its app (`inferd.runtime.ray`): the Serve config and the
autoscaling policy without Ray running, then the app for real on a local Ray instance: OpenAI requests and
streams through it, prefix-affine routing seen in the replicas' own counters, and a replica killed under load
without a lost non-streaming request."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from inferd.cli import main
from inferd.deploy.ray import RayOptions, serve_config
from inferd.errors import ConfigError
from inferd.fleet.spec import AutoscalingPolicy, parse_fleet
from tests.net import free_port

FLEET = """\
models:
  - name: gemma
    aliases: [g]
    engine: {max_num_seqs: 8}
    pools:
      - name: gemma-both
        replicas: 1
        resources: {cpu: 2, memory: 2Gi, gpu: 1}
        autoscaling: {min_replicas: 0, max_replicas: 4, scale_to_zero_after_s: 300, cooldown_s: 90,
                      targets: {waiting: 2, kv_cache_usage: 0.5}}
      - name: gemma-fixed
        replicas: 2
"""


def test_the_serve_config_is_one_serve_accepts():
    from ray.serve.schema import ServeDeploySchema

    cfg = serve_config(parse_fleet(FLEET), RayOptions(port=8123))
    ServeDeploySchema.model_validate(cfg)  # Serve's own schema for `serve deploy`
    (app,) = cfg["applications"]
    deps = {d["name"]: d for d in app["deployments"]}
    auto = deps["engine-gemma-both"]["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (0, 4, 1)
    assert auto["downscale_delay_s"] == 90 and auto["downscale_to_zero_delay_s"] == 300
    assert auto["policy"]["policy_function"] == "inferd.runtime.ray:PoolAutoscalingPolicy"
    assert AutoscalingPolicy.model_validate(auto["policy"]["policy_kwargs"]).targets.waiting == 2
    assert deps["engine-gemma-both"]["ray_actor_options"] == {"num_cpus": 2.0, "memory": 2 << 30, "num_gpus": 1}
    assert deps["engine-gemma-fixed"]["num_replicas"] == 2 and deps["engine-gemma-fixed"]["max_ongoing_requests"] == 16
    assert app["import_path"] == "inferd.runtime.ray:build_app" and app["args"]["spec"]["models"][0]["name"] == "gemma"


def test_a_pool_without_engine_settings_takes_the_engines_defaults():
    """max_ongoing_requests is twice the engine's own max_num_seqs, and the prefix keys hash its own block size."""
    from inferd.config import engine_default
    from inferd.deploy.ray import deployment_options
    from inferd.runtime.ray import model_routes

    spec = parse_fleet("models:\n  - name: m\n    pools:\n      - name: m-both\n")
    ((model, pool),) = spec.pools()
    assert deployment_options(model, pool, RayOptions())["max_ongoing_requests"] == 2 * engine_default("max_num_seqs")
    assert model_routes(spec)["m"].block_sizes == {"m-both": engine_default("block_size")}


def test_the_cli_writes_the_config_and_refuses_a_disaggregated_model(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    assert main(["deploy", "ray", "--config", str(fleet), "--out", str(tmp_path / "ray")]) == 0
    assert yaml.safe_load((tmp_path / "ray" / "serve_config.yaml").read_text())["http_options"]["port"] == 8000
    split = "models:\n  - name: s\n    pools:\n      - {name: p, role: prefill}\n      - {name: d, role: decode}\n"
    with pytest.raises(ConfigError, match="models.0: model 's' is disaggregated"):
        serve_config(parse_fleet(split))


def test_the_config_names_the_runtimes_builder_router_and_policy():
    """What the rendered config names by import path is what Serve finds in `inferd.runtime.ray`."""
    import importlib

    from inferd.runtime import ray as runtime

    cfg = serve_config(parse_fleet(FLEET))
    (app,) = cfg["applications"]
    engine = next(d for d in app["deployments"] if d["name"] == "engine-gemma-both")
    paths = [
        app["import_path"],
        engine["request_router_config"]["request_router_class"],
        engine["autoscaling_config"]["policy"]["policy_function"],
    ]
    found = [getattr(importlib.import_module(m), name) for m, name in (p.split(":") for p in paths)]
    assert found == [runtime.build_app, runtime.InferdRequestRouter, runtime.PoolAutoscalingPolicy]


def test_rendering_the_config_loads_neither_ray_nor_the_engine():
    code = (
        "import sys; import inferd.deploy.ray; "
        "print(sorted(m for m in ('ray', 'torch', 'inferd.engine', 'inferd.runtime') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_policy_takes_the_largest_target_within_the_steps():
    from inferd.runtime.ray import desired_replicas

    p = AutoscalingPolicy(targets={"waiting": 2, "kv_cache_usage": 0.5}, max_scale_up_step=2, max_scale_down_step=1)
    assert desired_replicas(p, 2, {"waiting": 5.0, "kv_cache_usage": 0.4}) == 3  # ceil(5 / 2)
    assert desired_replicas(p, 2, {"waiting": 0.0, "kv_cache_usage": 1.9}) == 4  # ceil(1.9 / 0.5)
    assert desired_replicas(p, 2, {"waiting": 40.0}) == 4  # at most 2 more at once
    assert desired_replicas(p, 4, {"waiting": 0.0, "kv_cache_usage": 0.0}) == 3  # at most 1 fewer at once
    assert desired_replicas(p, 3, {"waiting": 6.0}) == 3  # exactly at target: hold
    assert desired_replicas(p, 3, {}) == 3  # nothing reported: hold


def test_the_prompt_that_routes_each_openai_shape():
    from inferd.runtime.ray import routing_prompt

    assert routing_prompt("completion", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert routing_prompt("completion", {"prompt": [[4, 5], [6]]}) == [4, 5]
    assert routing_prompt("completion", {"prompt": ["a", "b"]}) == "a"
    assert routing_prompt("completion", {"prompt": 5}) is None
    assert routing_prompt("completion", {"prompt": [1, "x"]}) is None  # the replica refuses it
    assert routing_prompt("completion", {"prompt": [1.0, 2]}) == [1, 2]  # as the server reads it
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "yo"}]}]
    assert routing_prompt("chat", {"messages": messages}) == "hi\nyo"


# -- the app on a local Ray instance ------------------------------------------------------------------------
MODEL = "tiny"
PREFIX = " ".join(f"word{i}" for i in range(60))  # several full blocks of 16 tokens


def test_the_router_scores_a_publishing_replica_on_its_kv_events(monkeypatch):
    """Serve's router without Serve: replica A publishes KV events (a real publisher), B does not. A block A's
    events say it holds wins it the request; once A's events say the block left, the keys the router sent decide."""
    import asyncio
    from types import SimpleNamespace

    from inferd.config import KVEventsConfig
    from inferd.engine.kv_publisher import ZmqEventPublisher
    from inferd.kv_events import BlockRemoved, BlockStored
    from inferd.prefix_hash import block_hashes
    from inferd.runtime.ray import InferdRequestRouter
    from tests.gateway.conftest import wait_until

    config = KVEventsConfig(True, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    pub = ZmqEventPublisher(config, 16, "CPU")
    router = InferdRequestRouter.__new__(InferdRequestRouter)
    router.initialize_state(scorers={"prefix": 1.0, "queue": 0.0, "kv_cache": 0.0, "in_flight": 0.0})
    router._replica_queue_len_cache = {}  # noqa: SLF001
    try:
        events = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": ""}

        class Id(str):  # a ReplicaID as the router uses it: hashable, with its full id
            def to_full_id_str(self) -> str:
                return str(self)

        replica = lambda rid, stats: SimpleNamespace(replica_id=Id(rid), routing_stats=stats)  # noqa: E731
        a, b = replica("a", {"kv_events": events}), replica("b", {})
        tokens = list(range(100, 164))
        hashes = block_hashes(tokens, 16)
        pending = SimpleNamespace(args=[SimpleNamespace(block_hashes=hashes, adapter=None)])
        choose = lambda: asyncio.run(router.choose_replicas([a, b], pending))[0][0].replica_id.to_full_id_str()  # noqa: E731

        pub.publish([BlockStored(hashes, None, tokens, 16, None, "CPU")])
        choose()  # the first pick subscribes
        wait_until(lambda: router.events.synced("a"), what="the router's subscription")
        assert {choose() for _ in range(8)} == {"a"}
        asyncio.run(router.index.insert("b", hashes))  # keys sent to B earlier
        pub.publish([BlockRemoved(hashes[:1], "CPU")])  # A evicted the prefix's first block
        wait_until(lambda: router.events.match(["a"], hashes) == {"a": 0}, what="the eviction's event")
        assert {choose() for _ in range(8)} == {"b"}
    finally:
        router.events.close()
        pub.close()


@pytest.fixture(scope="module")
def ray_app(tiny_models, tmp_path_factory):
    import ray
    from ray import serve

    from inferd.runtime.ray import build
    from tests.engine.lora_adapters import make_adapter

    adapter = make_adapter(tiny_models["llama"], tmp_path_factory.mktemp("ray-adapter") / "sql")
    fleet = f"""\
models:
  - name: {MODEL}
    model: {tiny_models["llama"]}
    engine: {{max_model_len: 512, kv_cache_memory: 32MiB, num_threads: 1, max_num_seqs: 8, attention_backend: torch,
              lora_modules: ["sql={adapter}"], enable_kv_cache_events: true}}
    pools:
      - name: tiny-both
        replicas: 2
        resources: {{cpu: 1, memory: 512Mi}}
"""
    port = free_port()
    for attempt in range(2):  # Ray gives its raylet a fixed 30 s to register: a loaded machine can miss it once
        try:  # address="local": a fresh instance of our own, never a cluster someone started on this machine
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    try:
        for attempt in range(2):  # Serve kills an HTTP proxy slow to report healthy: a loaded machine can miss it once
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                serve.run(build(parse_fleet(fleet)), name="inferd", route_prefix="/")
                break
            except ray.exceptions.RayActorError:
                serve.shutdown()
                if attempt:
                    raise
                port = free_port()
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_actors() -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "engine-tiny-both" in a["name"]
    )


def _replica_stats() -> dict[str, dict]:
    """Each engine replica's own counters by replica id, as Serve's router reads them."""
    from inferd.runtime.ray import replica_stats

    return replica_stats("engine-tiny-both")


def _complete(url: str, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_openai_requests_and_streams_through_ray_serve(ray_app):
    models = httpx.get(ray_app + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "sql"]
    r = _complete(ray_app, "hello there")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 4
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", ray_app + "/v1/chat/completions", json=body, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    missing = httpx.post(ray_app + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    bad = httpx.post(ray_app + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()
    invalid = httpx.post(
        ray_app + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=60
    )
    assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lora_adapter_is_served_through_ray_under_its_name(ray_app):
    """The ingress routes an adapter's requests to its base model's pool; the replica runs them under it."""
    greedy = {"temperature": 0, "ignore_eos": True}
    adapted = httpx.post(ray_app + "/v1/completions", json={"model": "sql", "prompt": "hello there", "max_tokens": 6}
                         | greedy, timeout=120)  # fmt: skip
    assert adapted.status_code == 200, adapted.text
    assert adapted.json()["model"] == "sql"
    base = _complete(ray_app, "hello there", max_tokens=6, ignore_eos=True)
    assert base.json()["choices"][0]["text"] != adapted.json()["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(ray_app):
    before = _replica_stats()
    assert len(before) == 2, before
    replicas = set()
    for i in range(6):
        r = _complete(ray_app, f"{PREFIX} question {i}", max_tokens=2)
        assert r.status_code == 200, r.text
        replicas.add(r.headers["x-inferd-replica"])
    assert len(replicas) == 1, replicas  # all on the replica that cached the prefix first
    (holder,) = replicas
    time.sleep(1.5)  # routing stats are read every second
    after = _replica_stats()
    hits = {rid: after[rid]["prefix_cache_hits"] - before[rid]["prefix_cache_hits"] for rid in after}
    assert hits[holder] >= 5 * 48, hits  # five requests found ~60 prefix tokens cached there
    assert all(h == 0 for rid, h in hits.items() if rid != holder), hits
    # each replica publishes its KV events on ports of its own, at its node's address, for the router
    endpoints = [s["kv_events"]["endpoint"] for s in after.values()]
    assert len(set(endpoints)) == 2 and all(e.startswith("tcp://") and "0.0.0.0" not in e for e in endpoints)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_replica_is_replaced_without_losing_a_request(ray_app):
    import ray

    stop = threading.Event()
    results: list[httpx.Response] = []

    def client(i: int) -> None:  # back-to-back requests long enough to be in flight at the kill
        n = 0
        while not stop.is_set():
            results.append(_complete(ray_app, f"client {i} request {n}", 96, min_tokens=96))
            n += 1

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client, i) for i in range(6)]
        busy: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(busy.values()):  # the router may keep both idle at first
            time.sleep(0.5)
            busy = {st["actor"]: st["running"] + st["waiting"] for st in _replica_stats().values()}
        victim = max(busy, key=busy.get)  # a replica with requests on it: the kill must cut some
        assert busy[victim] > 0, busy
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        time.sleep(3)
        stop.set()
        for f in futures:
            f.result()
    assert [r.status_code for r in results] == [200] * len(results), [r.text for r in results if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 96 for r in results)
    retried = [r for r in results if r.headers["x-inferd-attempts"] != "1"]
    assert retried, "no request was in flight on the killed replica"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        names = _replica_actors()
        if len(names) == 2 and victim not in names and len(_replica_stats()) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {_replica_actors()}")
    assert _complete(ray_app, "after the replacement").status_code == 200
