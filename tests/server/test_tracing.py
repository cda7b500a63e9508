"""OpenTelemetry: a span per request, exported over OTLP/HTTP to a real receiver, parented on the request's
traceparent, with children that say where its time went."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.otlp import OTLPReceiver
from tests.server.conftest import MODEL_NAME, start_server


@pytest.fixture(scope="module")
def traced(tiny_models):
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the batch processor exports every 0.1 s, not every 5 s
    receiver = OTLPReceiver()
    server = start_server(tiny_models["llama"], settings={"otlp_traces_endpoint": receiver.url})
    yield server, receiver
    server.stop()
    receiver.close()
    mp.undo()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_a_request_span_hangs_under_the_callers_traceparent(traced):
    server, receiver = traced
    header, trace_id, parent = _traceparent()
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.5, "seed": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"traceparent": header}, timeout=30)
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]
    (span,) = receiver.wait_for(lambda s: s.name == "llm_request" and s.trace_id == trace_id)
    assert span.parent_span_id == parent and span.service == "inferd" and span.kind == 2  # SERVER
    a = span.attributes
    assert a["gen_ai.request.id"] == request_id and a["gen_ai.response.model"] == MODEL_NAME
    assert a["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == 6 and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["inferd.decode_steps"] == 5 and a["inferd.prefill_chunks"] >= 1
    children = receiver.wait_for(lambda s: s.parent_span_id == span.span_id)
    by_name = {c.name: c for c in children}
    assert set(by_name) == {"queue", "prefill", "decode"}
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert span.start_ns == queue.start_ns <= queue.end_ns == prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns <= span.end_ns
    assert all(c.trace_id == trace_id for c in children)


def test_a_streamed_chat_without_traceparent_starts_a_trace_and_an_abort_is_an_error(traced):
    server, receiver = traced
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        request_id = r.headers["x-request-id"]
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    (span,) = receiver.wait_for(lambda s: s.attributes.get("gen_ai.request.id") == request_id)
    assert span.parent_span_id == "" and span.attributes["gen_ai.usage.completion_tokens"] == 4

    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        request_id = r.headers["x-request-id"]
        next(line for line in r.iter_lines() if line)  # then the client goes away
    (span,) = receiver.wait_for(lambda s: s.attributes.get("gen_ai.request.id") == request_id)
    assert span.status == 2  # ERROR: aborted
    server.wait_idle(timeout=5)


def test_a_request_the_engine_refuses_leaves_no_pending_trace(traced, monkeypatch):
    server, _ = traced
    tracer = server.state.tracer
    started = []
    real = tracer.started
    monkeypatch.setattr(tracer, "started", lambda rid, *a: (started.append(rid), real(rid, *a)))
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100_000}  # beyond the context: the engine says
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert started and not tracer._pending  # noqa: SLF001
