"""The `priority` request field, as vLLM takes it: used under `--scheduling-policy priority`, a 400 naming the
flag otherwise."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, start_server


def test_priority_field(server, tiny_models):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "priority": 3}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    server.wait_idle()
    srv = start_server(tiny_models["llama"], scheduling_policy="priority")
    try:
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        srv.wait_idle()
    finally:
        srv.stop()


def test_ttft_deadline_field(server, tiny_models):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "ttft_deadline_ms": 250}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttft_deadline_ms", r.text
    assert "--scheduling-policy deadline" in r.json()["error"]["message"]
    server.wait_idle()
    srv = start_server(tiny_models["llama"], scheduling_policy="deadline")
    try:
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "ttft_deadline_ms": 1000}  # fmt: skip
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "ttft_deadline_ms": -5}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_deadline_ms", bad.text
        srv.wait_idle()
    finally:
        srv.stop()
