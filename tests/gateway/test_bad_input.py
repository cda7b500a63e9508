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
