"""Tenant budgets through real gateways and replicas: 429 exactly at the budget, accurate headers, settling to
the real usage (streams included, with the usage chunk stripped), concurrency limits, and one budget shared
by two gateway processes through a real redis-server."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.conftest import base_config, wait_until
from tests.gateway.procs import start_redis

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # token ids: the count is exact without a tokenizer
M = 4  # max_tokens; with ignore_eos every request uses exactly len(PROMPT) + M tokens
COST = len(PROMPT) + M


def _key(name: str) -> str:
    return f"sk-{name}"


def _tenant(name: str, **limits) -> dict:
    return {"id": name, "api_key_sha256": [hashlib.sha256(_key(name).encode()).hexdigest()], "limits": limits}


def _config(replicas, tenants: list[dict], **extra) -> dict:
    return base_config(
        [{"name": "a", "replicas": [r.url for r in replicas], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        tenants=tenants,
        **extra,
    )


def _post(gw_url: str, tenant: str, **body) -> httpx.Response:
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": M, "ignore_eos": True, "temperature": 0, **body}
    headers = {"Authorization": f"Bearer {_key(tenant)}"}
    return httpx.post(f"{gw_url}/v1/completions", json=payload, headers=headers, timeout=60)


def test_429_exactly_at_the_token_budget(replicas, gateway):
    text = "The quick brown fox jumps"
    n_text = httpx.post(f"{replicas[0].url}/tokenize", json={"prompt": text}).json()["count"]
    limit = (n_text + M) + 2 * COST + (COST - 1)  # room for three requests and one token short of a fourth
    gw = gateway(_config(replicas, [_tenant("t", tokens={"total": limit})]))

    r = _post(gw.url, "t", prompt=text)  # a text prompt: the gateway counts it exactly with the replica's tokenizer
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == n_text + M
    assert r.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert r.headers["x-ratelimit-remaining-tokens"] == str(limit - n_text - M)
    for i in (1, 2):
        r = _post(gw.url, "t")
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-remaining-tokens"] == str(limit - n_text - M - i * COST)

    r = _post(gw.url, "t")  # needs COST, COST - 1 remain
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert r.headers["x-ratelimit-remaining-tokens"] == str(COST - 1)
    assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-ratelimit-reset-tokens"].endswith("s")

    r = _post(gw.url, "t", max_tokens=M - 1)  # exactly what remains
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    assert _post(gw.url, "t", prompt=[5], max_tokens=1).status_code == 429


def test_chat_prompts_are_counted_exactly_with_the_chat_template(replicas, gateway):
    limit = 10_000
    gw = gateway(_config(replicas, [_tenant("chat", tokens={"input": limit})]))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {_key('chat')}"}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert r.headers["x-ratelimit-remaining-input-tokens"] == str(limit - prompt_tokens)  # reserved = real
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert r.headers["x-ratelimit-remaining-input-tokens"] == str(limit - 2 * prompt_tokens)


def test_settles_to_real_usage_and_strips_the_forced_usage_chunk(replicas, gateway):
    limit = 1000
    gw = gateway(_config(replicas, [_tenant("s", tokens={"total": limit})]))
    stop_at_once = list(range(384))  # every token stops: the request ends after one of its 200 reserved tokens
    body = {"stream": True, "max_tokens": 200, "ignore_eos": False, "stop_token_ids": stop_at_once}
    r = _post(gw.url, "s", **body)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-remaining-tokens"] == str(limit - len(PROMPT) - 200)  # reserved
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["choices"] for e in events[:-1]), "usage chunk leaked to a client that did not ask"
    r = _post(gw.url, "s")
    used_before = len(PROMPT) + 1  # settled: the first request cost its prompt and its one token
    assert r.headers["x-ratelimit-remaining-tokens"] == str(limit - used_before - COST)


def test_request_and_concurrency_limits(replicas, gateway):
    gw = gateway(_config(replicas, [_tenant("r", requests=2), _tenant("c", max_concurrent=1)]))
    assert _post(gw.url, "r").headers["x-ratelimit-remaining-requests"] == "1"
    assert _post(gw.url, "r").status_code == 200
    r = _post(gw.url, "r")
    assert r.status_code == 429 and r.headers["x-ratelimit-remaining-requests"] == "0"

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {_key('c')}"}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, headers=headers, timeout=60) as long:
        assert long.status_code == 200
        chunks = long.iter_raw()
        next(chunks)  # the stream has begun: the tenant's one slot is taken
        r = _post(gw.url, "c")
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert _post(gw.url, "c").status_code == 200


def test_two_gateways_share_one_budget_through_redis(replicas, gateway, redis_proc):
    tenants = [_tenant("seq", tokens={"total": 3 * COST + COST - 1}), _tenant("par", tokens={"total": 5 * COST})]
    cfg = _config(replicas, tenants, budget_store="redis", redis_url=f"redis://127.0.0.1:{redis_proc.port}/0")
    a, b = gateway(cfg), gateway(cfg)

    for gw in (a, b, a):
        assert _post(gw.url, "seq").status_code == 200
    r = _post(b.url, "seq")
    assert r.status_code == 429 and r.headers["x-ratelimit-remaining-tokens"] == str(COST - 1)
    assert _post(a.url, "seq", max_tokens=M - 1).status_code == 200  # exactly the rest
    assert _post(b.url, "seq", prompt=[5], max_tokens=1).status_code == 429

    # twelve at once over both gateways against a budget of five: exactly five pass
    with ThreadPoolExecutor(12) as ex:
        codes = list(ex.map(lambda i: _post((a, b)[i % 2].url, "par").status_code, range(12)))
    assert sorted(codes) == [200] * 5 + [429] * 7, codes


def _usage(r: httpx.Response) -> dict:
    if not r.headers["content-type"].startswith("text/event-stream"):
        return r.json()["usage"]
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    return next(e["usage"] for e in reversed(events) if e.get("usage"))


def test_a_request_without_max_tokens_is_capped_upstream_at_its_reservation(replicas, gateway):
    cap, limit = 24, 300
    tenants = [{**_tenant("cap", tokens={"total": limit}), "default_max_tokens": cap}, _tenant("mct")]
    gw = gateway(_config(replicas, tenants))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True}
    bodies = [
        {"model": "tiny", "prompt": PROMPT, "ignore_eos": True},  # a replica's default would be 16
        chat,  # no default at all: up to the context length
        {**chat, "stream": True, "stream_options": {"include_usage": True}},
    ]

    def send(i: int) -> httpx.Response:
        path = "/v1/completions" if "prompt" in bodies[i % 3] else "/v1/chat/completions"
        return httpx.post(gw.url + path, json=bodies[i % 3], headers={"Authorization": f"Bearer {_key('cap')}"})

    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(send, range(8)))
    served = [_usage(r) for r in answers if r.status_code == 200]
    assert {r.status_code for r in answers} == {200, 429}, [r.text for r in answers]
    assert [u["completion_tokens"] for u in served] == [cap] * len(served)
    assert sum(u["total_tokens"] for u in served) <= limit

    # a chat's max_completion_tokens is its cap (the server reads it before max_tokens)
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={**chat, "max_completion_tokens": 5, "max_tokens": 50},
        headers={"Authorization": f"Bearer {_key('mct')}"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_a_budget_store_that_is_down_or_frozen_is_a_503_that_names_it(replicas, gateway, redis_proc, logs):
    timeout = 0.5
    port = redis_proc.port
    redis = {"redis_url": f"redis://127.0.0.1:{port}/0", "redis_timeout_s": timeout}
    cfg = _config(replicas, [_tenant("down", tokens={"total": 10**6})], budget_store="redis", **redis)
    gw = gateway(cfg)
    assert _post(gw.url, "down").status_code == 200
    # a prefix index in Redis is only a hint: without it requests are still routed
    hint = gateway({**_config(replicas, []), "prefix_index": {"store": "redis"}, **redis})
    long_prompt = {"model": "tiny", "prompt": list(range(5, 37)), "max_tokens": 1}  # two full blocks

    def routed() -> float:
        t = time.monotonic()
        r = httpx.post(f"{hint.url}/v1/completions", json=long_prompt, timeout=30)
        assert r.status_code == 200, r.text
        return time.monotonic() - t

    routed()

    def refused() -> float:
        t = time.monotonic()
        r = _post(gw.url, "down")
        took = time.monotonic() - t
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "budget_store_unavailable" and err["type"] == "server_error"
        assert f"Redis at redis://127.0.0.1:{port}/0" in err["message"] and r.headers["Retry-After"] == "1"
        return took

    os.kill(redis_proc.popen.pid, signal.SIGSTOP)  # frozen: connections open, no answer
    try:
        took = [refused() for _ in range(3)]
        hinted = [routed() for _ in range(3)]
    finally:
        os.kill(redis_proc.popen.pid, signal.SIGCONT)
    assert max(took) < timeout + 1.0, took
    assert max(hinted) < timeout + 1.0, hinted
    wait_until(lambda: _post(gw.url, "down").status_code == 200, what="served again after SIGCONT")
    # the reservations Redis ran after the thaw, past their deadline, took nothing: no slot is left held
    import redis as redis_py

    held = redis_py.Redis(port=port).get("inferd-gw:budget:{down}:concurrent")
    assert int(held or 0) == 0, held

    redis_proc.kill()  # gone: connections refused
    took = [refused() for _ in range(3)]
    assert max(took) < timeout + 1.0, took
    routed()
    again = start_redis(logs, port)
    try:
        wait_until(lambda: _post(gw.url, "down").status_code == 200, what="served again after a restart")
    finally:
        again.stop()

    log = gw.log.read_text()
    assert log.count(f"budget store redis://127.0.0.1:{port}/0 unreachable") == 2, log  # once per outage
    assert log.count(f"budget store redis://127.0.0.1:{port}/0 reachable again") == 2, log
    assert "Traceback" not in log, log
    hint_log = hint.log.read_text()
    assert hint_log.count(f"prefix index redis://127.0.0.1:{port}/0 unreachable") >= 1, hint_log
    assert "Traceback" not in hint_log, hint_log
