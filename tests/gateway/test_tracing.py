"""One trace across the gateway and the replica: the client's traceparent, the gateway's span, a child per upstream
attempt, and the replica's llm_request under the attempt that carried it. Real processes exporting over OTLP/HTTP to
a loopback receiver; a gateway without tracing passes the client's traceparent on."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import base_config, healthy_replicas
from tests.gateway.procs import Proc
from tests.otlp import OTLPReceiver

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced_replica(tiny_llama, logs, receiver) -> Iterator[list[Proc]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # children inherit it: spans go out within 0.1 s
    try:
        yield from healthy_replicas(tiny_llama, logs, 1, "--otlp-traces-endpoint", receiver.url)
    finally:
        mp.undo()


def _config(urls: list[str], **extra) -> dict:
    pools = [{"name": "p", "replicas": urls, "model": "tiny", "tokenizer": "estimate"}]
    return base_config(pools, [{"name": "m", "backends": [{"pool": "p"}]}], **extra)


def _send(gw: Proc, stream: bool) -> tuple[str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "m", "prompt": "hello there", "max_tokens": 4, "temperature": 0, "stream": stream}
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200
    return trace_id, parent


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_replicas_span_hangs_under_the_gateways_attempt(traced_replica, receiver, gateway, monkeypatch, stream):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    gw = gateway(_config([traced_replica[0].url], tracing={"otlp_endpoint": receiver.url}))
    trace_id, parent = _send(gw, stream)
    (root,) = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "gateway_request")
    (attempt,) = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "upstream")
    (engine,) = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "llm_request")
    assert root.service == "inferd-gateway" and root.parent_span_id == parent and root.kind == 2  # SERVER
    assert attempt.parent_span_id == root.span_id and attempt.kind == 3  # CLIENT
    assert attempt.attributes["server.address"] == traced_replica[0].url
    assert attempt.attributes["http.response.status_code"] == 200
    assert engine.service == "inferd" and engine.parent_span_id == attempt.span_id
    assert root.attributes["gen_ai.usage.completion_tokens"] == engine.attributes["gen_ai.usage.completion_tokens"]
    assert root.start_ns <= attempt.start_ns <= engine.start_ns <= engine.end_ns <= root.end_ns
    assert root.attributes["http.response.status_code"] == 200 and root.status != 2


def test_a_retry_is_a_second_attempt_and_the_failed_one_says_why(traced_replica, receiver, gateway):
    from inferd.procs import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a connect error, then the live replica
    cfg = _config([dead, traced_replica[0].url], tracing={"otlp_endpoint": receiver.url})
    cfg["routing"] = {"picker": "round_robin"}
    cfg["health"] = {"interval_s": 30, "timeout_s": 0.5}  # not ejected before the requests below
    gw = gateway(cfg)
    for _ in range(2):  # round-robin: one of the two starts on the dead replica
        trace_id, _ = _send(gw, stream=False)
        attempts = receiver.wait_for(lambda s, t=trace_id: s.trace_id == t and s.name == "upstream")
        if len(attempts) == 2:
            break
    assert len(attempts) == 2
    failed, served = sorted(attempts, key=lambda s: s.start_ns)
    assert failed.attributes["server.address"] == dead and failed.status == 2  # ERROR
    assert served.attributes["server.address"] == traced_replica[0].url
    (engine,) = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "llm_request")
    assert engine.parent_span_id == served.span_id


def test_without_tracing_the_gateway_passes_the_clients_traceparent_on(traced_replica, receiver, gateway):
    gw = gateway(_config([traced_replica[0].url]))
    trace_id, parent = _send(gw, stream=False)
    (engine,) = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "llm_request")
    assert engine.parent_span_id == parent
    assert not [s for s in receiver.spans if s.trace_id == trace_id and s.service == "inferd-gateway"]
