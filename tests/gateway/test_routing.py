"""Routing through a real gateway process to real inferd replicas: by model and alias, weighted splits,
streams relayed event by event, and prefix affinity measured on the replicas' own prefix cache counters."""

from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from inferd.procs import Scrape
from tests.gateway.conftest import base_config, wait_until

pytestmark = pytest.mark.timeout(120)


def _pools(replicas, **extra) -> list[dict]:
    return [
        {"name": "a", "replicas": [replicas[0].url], "model": "tiny", **extra},
        {"name": "b", "replicas": [replicas[1].url], "model": "tiny", **extra},
    ]


def _complete(gw_url: str, model: str, **body) -> httpx.Response:
    payload = {"model": model, "prompt": "The quick brown fox", "max_tokens": 1, **body}
    return httpx.post(f"{gw_url}/v1/completions", json=payload, timeout=30)


def test_routes_by_model_and_alias(replicas, gateway):
    models = [
        {"name": "tiny-a", "aliases": ["tiny-latest"], "backends": [{"pool": "a"}]},
        {"name": "tiny-b", "backends": [{"pool": "b"}]},
    ]
    gw = gateway(base_config(_pools(replicas), models))
    for model, replica in [("tiny-a", replicas[0]), ("tiny-latest", replicas[0]), ("tiny-b", replicas[1])]:
        r = _complete(gw.url, model)
        assert r.status_code == 200, r.text
        assert r.headers["x-inferd-replica"] == replica.url
        body = r.json()
        assert body["model"] == "tiny"  # the replica's answer, untouched: the upstream name
        assert body["usage"]["completion_tokens"] == 1
    listed = httpx.get(f"{gw.url}/v1/models").json()
    assert {m["id"] for m in listed["data"]} == {"tiny-a", "tiny-latest", "tiny-b"}
    r = _complete(gw.url, "no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_weighted_split_within_5_percent(replicas, gateway):
    models = [{"name": "canary", "backends": [{"pool": "a", "weight": 3}, {"pool": "b", "weight": 1}]}]
    gw = gateway(base_config(_pools(replicas), models))
    n = 1000
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(8) as ex:

        def one(_):
            r = client.post(f"{gw.url}/v1/completions", json={"model": "canary", "prompt": [5, 6, 7], "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.headers["x-inferd-replica"]

        counts = Counter(ex.map(one, range(n)))
    share_a = counts[replicas[0].url] / n
    assert abs(share_a - 0.75) < 0.05, counts


def _events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def test_stream_relayed_untouched_and_usage_chunk_only_when_asked(replicas, gateway):
    models = [{"name": "tiny", "backends": [{"pool": "a"}]}]
    gw = gateway(base_config(_pools(replicas)[:1], models))
    body = {
        "model": "tiny",
        "prompt": "Paged attention",
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    plain = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/event-stream")
    events = _events(plain.text)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["choices"] for c in chunks), "the usage chunk the gateway forced on must not reach the client"
    assert not any("usage" in c for c in chunks), "the usage field the gateway forced on must not reach the client"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
    # same shape as the replica's own stream, event for event (ids and timestamps aside)
    strip = lambda c: {k: v for k, v in c.items() if k not in ("id", "created")}
    direct = httpx.post(f"{replicas[0].url}/v1/completions", json=body, timeout=30)
    assert [strip(json.loads(e[6:])) for e in _events(direct.text)[:-1]] == [strip(c) for c in chunks]

    asked = httpx.post(f"{gw.url}/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    chunks = [json.loads(e.removeprefix("data: ")) for e in _events(asked.text)[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

    direct = httpx.post(f"{replicas[0].url}/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    assert [strip(json.loads(e[6:])) for e in _events(direct.text)[:-1]] == [strip(c) for c in chunks]


def _prefix_workload(seed: int, prefixes: int, users: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "paged", "fox", "dog", "quick", "lazy", "12", "()"]
    systems = [" ".join(rng.choice(words) for _ in range(70)) for _ in range(prefixes)]
    prompts = [f"{s}\nUser {u}: {rng.choice(words)} {rng.choice(words)}?" for s in systems for u in range(users)]
    rng.shuffle(prompts)
    return prompts


def test_prefix_affinity_raises_replica_prefix_hit_rate_over_round_robin(replicas, gateway, tiny_llama):
    pool = {"name": "ab", "replicas": [r.url for r in replicas], "model": "tiny", "tokenizer": str(tiny_llama)}
    models = [{"name": "tiny", "backends": [{"pool": "ab"}]}]
    rates = {}
    for seed, picker in enumerate(["round_robin", "scored"]):
        cfg = base_config([pool], models, routing={"picker": picker})
        gw = gateway(cfg)
        with Scrape([r.url for r in replicas]) as scraped, httpx.Client(timeout=30) as client:
            for prompt in _prefix_workload(seed, prefixes=8, users=4):
                r = client.post(f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
        hits, queries = (scraped.rise(f"inferd:prefix_cache_{k}_total") for k in ("hits", "queries"))
        rates[picker] = hits / queries  # the prefix cache's hit rate (tokens) over both replicas
        gw.stop()
    print("prefix hit rates", rates)
    # each shared prefix is prefilled once with affinity, on both replicas with round-robin
    assert rates["scored"] > 0.6, rates
    assert rates["scored"] > rates["round_robin"] + 0.1, rates


def test_two_gateways_share_the_prefix_index_through_redis(replicas, gateway, redis_proc):
    """A prefix sent through one gateway is found by the other: both read the same index in redis-server."""
    pool = {"name": "ab", "replicas": [r.url for r in replicas], "model": "tiny"}
    only_prefix = {"queue": 0, "kv_cache": 0, "in_flight": 0, "in_flight_tokens": 0, "prefix": 1}
    cfg = base_config(
        [pool],
        [{"name": "tiny", "backends": [{"pool": "ab"}]}],
        routing={"scorers": only_prefix},
        prefix_index={"store": "redis"},
        redis_url=f"redis://127.0.0.1:{redis_proc.port}/0",
    )
    a, b = gateway(cfg), gateway(cfg)
    rng = random.Random(7)
    for _ in range(6):  # without the shared index, b would pick at random: all six right by luck is 1 in 64
        prefix = [rng.randrange(3, 300) for _ in range(48)]  # three full blocks of 16
        first = _complete(a.url, "tiny", prompt=prefix + [5])
        again = _complete(b.url, "tiny", prompt=prefix + [6, 7])
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.headers["x-inferd-replica"] == first.headers["x-inferd-replica"]


def test_replicas_discovered_from_a_list_file_reread_on_change(replicas, gateway, logs):
    listing = logs / "replicas.txt"
    listing.write_text(f"# the pool's replicas\n{replicas[0].url}\n")
    pools = [{"name": "d", "replicas_file": str(listing), "model": "tiny"}]
    gw = gateway(base_config(pools, [{"name": "tiny", "backends": [{"pool": "d"}]}]))
    assert _complete(gw.url, "tiny").headers["x-inferd-replica"] == replicas[0].url
    listing.write_text(f"{replicas[1].url}\n")
    wait_until(lambda: _complete(gw.url, "tiny").headers["x-inferd-replica"] == replicas[1].url, what="rediscovery")
    assert {_complete(gw.url, "tiny").headers["x-inferd-replica"] for _ in range(5)} == {replicas[1].url}


def test_gateway_metrics_use_gen_ai_names(replicas, gateway):
    gw = gateway(base_config(_pools(replicas)[:1], [{"name": "tiny", "backends": [{"pool": "a"}]}]))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{gw.url}/v1/completions", json={**body, "stream": True}).status_code == 200
    assert _complete(gw.url, "nope").status_code == 404
    text = httpx.get(f"{gw.url}/metrics").text
    rep = replicas[0].url
    expected = [
        f'gen_ai_client_token_usage_sum{{gen_ai_request_model="tiny",gen_ai_token_type="input",replica="{rep}",'
        'tenant="anonymous"} 3.0',
        f'gen_ai_client_token_usage_sum{{gen_ai_request_model="tiny",gen_ai_token_type="output",replica="{rep}",'
        'tenant="anonymous"} 3.0',
        f'gen_ai_server_time_to_first_token_seconds_count{{gen_ai_request_model="tiny",replica="{rep}"}} 1.0',
        f'gen_ai_server_time_per_output_token_seconds_count{{gen_ai_request_model="tiny",replica="{rep}"}} 1.0',
        f'inferd_gateway_requests_total{{model="tiny",replica="{rep}",status="200",tenant="anonymous"}} 1.0',
        'inferd_gateway_rejections_total{model="(unknown)",reason="model_not_found",tenant="anonymous"} 1.0',
        f'inferd_gateway_routing_decisions_total{{pool="a",replica="{rep}"}} 1.0',
    ]
    for line in expected:
        assert line in text, line


def test_fallbacks_to_another_pool_and_another_model(replicas, gateway):
    from tests.gateway.procs import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pools = [*_pools(replicas), {"name": "dead", "replicas": [dead], "model": "tiny"}]
    models = [
        {"name": "primary", "backends": [{"pool": "dead"}], "fallbacks": [{"pool": "b"}]},
        {"name": "chain", "backends": [{"pool": "dead"}], "fallbacks": [{"model": "tiny-a"}]},
        {"name": "tiny-a", "backends": [{"pool": "a"}]},
        {"name": "nowhere", "backends": [{"pool": "dead"}]},
    ]
    gw = gateway(base_config(pools, models))
    r = _complete(gw.url, "primary")
    assert r.status_code == 200 and r.headers["x-inferd-replica"] == replicas[1].url
    r = _complete(gw.url, "chain")
    assert r.status_code == 200 and r.headers["x-inferd-replica"] == replicas[0].url
    r = _complete(gw.url, "nowhere")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica" and "Retry-After" in r.headers


def test_replicas_discovered_from_a_dns_name(replicas, gateway):
    port = replicas[0].port
    pools = [{"name": "d", "replicas_dns": {"name": "localhost", "port": port, "interval_s": 0.5}, "model": "tiny"}]
    gw = gateway(base_config(pools, [{"name": "tiny", "backends": [{"pool": "d"}]}]))
    wait_until(lambda: httpx.get(f"{gw.url}/health").status_code == 200, what="the name resolved")
    for _ in range(3):  # localhost may also resolve to ::1, where nothing listens: that one is ejected or retried
        r = _complete(gw.url, "tiny")
        assert r.status_code == 200 and r.headers["x-inferd-replica"] == f"http://127.0.0.1:{port}"


_SYSTEM = "You are a careful assistant. Paged attention stores keys and values in fixed-size blocks. " * 2
_CHATS = [
    {"messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "What is paged attention?"}]},
    {
        "messages": [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
            {"role": "assistant", "content": "Blocks.", "name": "bot"},
            {"role": "user", "content": None},
        ],
        "add_generation_prompt": False,
    },
    {  # tools, a call and its result: the server teaches this template (which ignores tools) in a system prompt
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        "tool_choice": "auto",
    },
]


def test_chat_prefix_keys_rendered_locally_equal_the_replicas(replicas, tiny_llama):
    """A pool whose tokenizer is the model folder renders chats itself: the same ids, hence the same prefix
    cache keys, as the replica's own /tokenize and as the prompt it actually ran, with no replica asked."""
    import asyncio

    from inferd.gateway.tokens import PoolTokenizer
    from inferd.prefix_hash import block_hashes

    tok = PoolTokenizer(str(tiny_llama), client=None)  # no client: asking a replica would fail the test
    for body in _CHATS:
        local = asyncio.run(tok.count("chat", body, "tiny", replica_url=None))
        remote = httpx.post(f"{replicas[0].url}/tokenize", json={"model": "tiny", **body}, timeout=30).json()
        assert local.exact and local.ids == remote["tokens"]
        assert len(local.ids) >= 32  # full blocks to compare
        for salt in (None, "tenant-a"):
            assert block_hashes(local.ids, 16, salt) == block_hashes(remote["tokens"], 16, salt)
    # options /tokenize does not take: compared with the prompt the replica ran
    body = {**_CHATS[1], "continue_final_message": True, "chat_template_kwargs": {"unused": 1}}
    body["messages"] = body["messages"][:3]
    local = asyncio.run(tok.count("chat", body, "tiny", replica_url=None))
    done = httpx.post(f"{replicas[0].url}/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **body})
    assert done.status_code == 200, done.text
    assert local.count == done.json()["usage"]["prompt_tokens"]
    # a message the server refuses is not refused (or guessed) by the gateway: the replica answers it
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert not asyncio.run(tok.count("chat", bad, "tiny", replica_url=None)).exact


def test_chat_prefix_affinity_through_the_gateway(replicas, gateway, tiny_llama):
    pools = [{"name": "p", "replicas": [r.url for r in replicas], "model": "tiny", "tokenizer": str(tiny_llama)}]
    gw = gateway(base_config(pools, [{"name": "tiny", "backends": [{"pool": "p"}]}]))
    picked = []
    for i in range(4):
        body = {
            "model": "tiny",
            "max_tokens": 1,
            "messages": [*_CHATS[0]["messages"][:1], {"role": "user", "content": f"q{i}"}],
        }
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        picked.append(r.headers["x-inferd-replica"])
    assert len(set(picked)) == 1, picked  # the shared system prompt's blocks keep every turn on one replica
    text = httpx.get(f"{gw.url}/metrics").text
    hits = [
        line
        for line in text.splitlines()
        if line.startswith('inferd_gateway_prefix_affinity_blocks_total{pool="p",result="hit"}')
    ]
    assert hits and float(hits[0].split()[-1]) >= 3 * 2, hits  # 3 later turns, each >= 2 blocks matched


def test_structured_outputs_pass_through_the_gateway(replicas, gateway, tiny_llama):
    """The gateway relays a constraint untouched, whole and streamed, and counts the request's tokens."""
    pools = [{"name": "p", "replicas": [r.url for r in replicas], "model": "tiny", "tokenizer": str(tiny_llama)}]
    gw = gateway(base_config(pools, [{"name": "tiny", "backends": [{"pool": "p"}]}]))
    body = {"model": "tiny", "prompt": "Pick one:", "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}}
    for seed in range(3):
        r = httpx.post(f"{gw.url}/v1/completions", json={**body, "seed": seed}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no") and r.json()["usage"]["completion_tokens"] >= 1
    with httpx.stream("POST", f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in s.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
    assert text in ("yes", "no")
    bad = httpx.post(f"{gw.url}/v1/completions", json={**body, "structured_outputs": {"regex": "("}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex"
