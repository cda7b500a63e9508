"""Bad input at the gateway: an OpenAI error body with a 4xx, never a 5xx, and nothing reaches a replica."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from tests.gateway.conftest import base_config
from tests.gateway.procs import replica_metrics

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-bad-input"


@pytest.fixture(scope="module")
def gw(replicas, logs):
    from tests.gateway.procs import start_gateway

    tenants = [{"id": "t1", "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}]
    cfg = base_config(
        [{"name": "a", "replicas": [replicas[0].url], "model": "tiny"}],
        [{"name": "tiny", "backends": [{"pool": "a"}]}],
        tenants=tenants,
        max_body_bytes=4096,
    )
    proc, _ = start_gateway(cfg, logs)
    yield proc
    proc.stop()


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

CASES = [
    ("malformed json", b'{"model": "tiny", "prompt": ', AUTH, 400, None),
    ("not an object", b'["tiny"]', AUTH, 400, None),
    ("not utf-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', AUTH, 400, None),
    ("lone surrogate", b'{"model": "tiny", "prompt": "a\\ud800b"}', AUTH, 400, "prompt"),
    ("lone surrogate in a key", b'{"model": "tiny", "prompt": "x", "\\udfff": 1}', AUTH, 400, None),
    ("NaN", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', AUTH, 400, None),
    ("Infinity", b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', AUTH, 400, None),
    ("huge exponent", b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', AUTH, 400, "temperature"),
    ("unknown model", b'{"model": "gpt-17", "prompt": "x"}', AUTH, 404, "model"),
    ("model not a string", b'{"model": 3, "prompt": "x"}', AUTH, 400, "model"),
    ("no prompt", b'{"model": "tiny"}', AUTH, 400, "prompt"),
    ("max_tokens negative", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', AUTH, 400, "max_tokens"),
    ("stream not bool", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', AUTH, 400, "stream"),
    ("missing key", b'{"model": "tiny", "prompt": "x"}', {"Content-Type": "application/json"}, 401, None),
    ("wrong key", b'{"model": "tiny", "prompt": "x"}', {"Authorization": "Bearer sk-nope"}, 401, None),
    ("oversized body", b'{"model": "tiny", "prompt": "' + b"x" * 8000 + b'"}', AUTH, 413, None),
]


@pytest.mark.parametrize("name,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clean_4xx_and_reaches_no_replica(gw, replicas, name, body, headers, status, param):
    before = replica_metrics(replicas[0].url)["inferd:e2e_request_latency_seconds_count"]
    r = httpx.post(f"{gw.url}/v1/completions", content=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    after = replica_metrics(replicas[0].url)["inferd:e2e_request_latency_seconds_count"]
    assert after == before, "a refused request reached the replica"


def test_oversized_body_without_content_length_is_413(gw):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(f"{gw.url}/v1/completions", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_unknown_path_and_method_are_openai_errors(gw):
    r = httpx.get(f"{gw.url}/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{gw.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_models_needs_the_key(gw):
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401
    r = httpx.get(f"{gw.url}/v1/models", headers=AUTH)
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert httpx.get(f"{gw.url}/health").json()["status"] == "ok"


BLOCK = [5] * 15  # with one more id, a full block: the gateway hashes it for prefix affinity

PROMPTS = [
    ("int then string", [1, "a"], "prompt.1"),
    ("null", [None], "prompt.0"),
    ("float", [1.5], "prompt.0"),
    ("object in a list", [{}], "prompt.0"),
    ("string then int", ["a", 5], "prompt.1"),
    ("true", True, "prompt"),
    ("a number", 5, "prompt"),
    ("an object", {"a": 1}, "prompt"),
    ("empty list", [], "prompt"),
    ("nested floats", [[1.5, 2.5]], "prompt.0.0"),
    ("nested strings", [["a"]], "prompt.0.0"),
    ("nested empty", [[]], "prompt.0"),
    ("nested then string", [[5], "a"], "prompt.1"),
    ("past 64 bits", [2**64], "prompt.0"),
    ("past 64 bits in a full block", [*BLOCK, 2**64], "prompt.15"),
    ("past int64 in a nested full block", [[*BLOCK, 5], [*BLOCK, 2**63]], "prompt.1.15"),
    ("negative", [-1], "prompt.0"),
    ("negative in a full block", [*BLOCK, -1], "prompt.15"),
    ("huge negative", [-(2**70)], "prompt.0"),
]


@pytest.mark.parametrize("name,prompt,param", PROMPTS, ids=[c[0] for c in PROMPTS])
def test_every_bad_prompt_shape_is_a_400_naming_the_element(gw, replicas, name, prompt, param):
    before = replica_metrics(replicas[0].url)["inferd:e2e_request_latency_seconds_count"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err
    assert replica_metrics(replicas[0].url)["inferd:e2e_request_latency_seconds_count"] == before


GOOD_PROMPTS = ["hello", ["a", "b"], [5, 6], [[5, 6], [7]], [*BLOCK, 7, 8], [1.0, 2], [5, "6"]]


@pytest.mark.parametrize("prompt", GOOD_PROMPTS, ids=[repr(p)[:30] for p in GOOD_PROMPTS])
def test_every_prompt_shape_the_server_reads_is_served(gw, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == (
        len(prompt) if isinstance(prompt, list) and type(prompt[0]) in (str, list) else 1
    )


MESSAGES = [
    [{}],
    [{"role": 5, "content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": {"a": 1}}],
    [{"role": "user", "content": [5]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": "x", "name": 5}],
    [{"role": "user", "content": None}],
]


@pytest.mark.parametrize("messages", MESSAGES, ids=[repr(m)[:40] for m in MESSAGES])
def test_odd_messages_are_served_or_a_4xx(gw, messages):
    body = {"model": "tiny", "messages": messages, "max_tokens": 1}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
