from __future__ import annotations

import pytest

from inferd.bench.client import (
    DONE,
    ClientConfig,
    Endpoint,
    build_body,
    chunk_text,
    error_message,
    normalize_base_url,
    parse_sse_line,
)
from inferd.bench.datasets import BenchRequest

REQ = BenchRequest("hello there", 3, 16)


def test_body_always_streams_with_usage():
    body = build_body(ClientConfig("http://x", "m"), REQ)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hello there" and body["max_tokens"] == 16 and body["model"] == "m"
    assert "ignore_eos" not in body and "logit_bias" not in body


def test_body_fixed_length_options_and_extra_body():
    cfg = ClientConfig("http://x", "m", Endpoint.CHAT, ignore_eos=True, eos_logit_bias=(1, 106),
                       extra_body={"repeat_penalty": 1.0, "temperature": 0.7})  # fmt: skip
    body = build_body(cfg, REQ)
    assert body["messages"] == [{"role": "user", "content": "hello there"}] and "prompt" not in body
    assert body["ignore_eos"] is True
    assert body["logit_bias"] == {"1": -100, "106": -100}
    assert body["repeat_penalty"] == 1.0 and body["temperature"] == 0.7  # extra body wins


def test_sse_parsing():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data:[DONE]") is DONE
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {broken")


def test_chunk_text_for_both_endpoints():
    assert chunk_text({"choices": [{"text": "ab"}]}, Endpoint.COMPLETIONS) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, Endpoint.CHAT) == ""
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}, Endpoint.CHAT) == "x"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, Endpoint.CHAT) == ""


def test_error_messages_from_openai_and_fastapi_bodies():
    assert error_message(404, b'{"error": {"message": "no such model"}}') == "HTTP 404: no such model"
    assert error_message(422, b'{"detail": "bad field"}') == "HTTP 422: bad field"
    assert error_message(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"


def test_base_url_normalization():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"


def test_send_all_streams_in_order_at_a_concurrency_or_on_a_schedule():
    import time

    from inferd.bench.client import send_all
    from inferd.bench.metrics import itls, ttft
    from tests.bench.fake_server import FakeServer

    reqs = [BenchRequest("hello", 5, 4), BenchRequest("hi", 2, 6), BenchRequest("hey", 3, 2)]
    with FakeServer() as url:
        outs = send_all(url, reqs, concurrency=2, model="fake")
        assert [o.index for o in outs] == [0, 1, 2] and all(o.success for o in outs)
        assert [len(o.chunk_times) for o in outs] == [4, 6, 2] and len(itls(outs[1])) == 5 and ttft(outs[0]) > 0
        t0 = time.perf_counter()
        late = send_all(url, reqs[:2], at=[0.0, 0.3], model="fake")
        assert late[1].send_time - t0 >= 0.3 > late[0].send_time - t0
        assert not send_all(url, reqs[:1], model="no-such-model")[0].success  # a failure is an output
