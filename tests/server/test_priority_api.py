"""The scheduling fields of a request: `priority` (vLLM's), used under `--scheduling-policy priority`, and
`ttft_deadline_ms` (inferd's), under `--scheduling-policy deadline`; a 400 naming the flag otherwise."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server


@pytest.mark.parametrize(
    ("field", "value", "chat_value", "bad", "policy"),
    [("priority", 3, -1, None, "priority"), ("ttft_deadline_ms", 250, 1000, -5, "deadline")],
)
def test_scheduling_field(server, tiny_models, field, value, chat_value, bad, policy):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, field: value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert f"--scheduling-policy {policy}" in r.json()["error"]["message"]
    server.wait_idle()
    srv = start_server(tiny_models["llama"], scheduling_policy=policy)
    try:
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                field: chat_value}  # fmt: skip
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
        if bad is not None:
            r = httpx.post(srv.url + "/v1/completions", json={**body, field: bad}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        srv.wait_idle()
    finally:
        srv.stop()
