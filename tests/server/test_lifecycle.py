"""Disconnects, metrics, overload, auth, engine failures, draining, and the `inferd serve` command."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, start_server

PROMPT = "The quick brown fox"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items()))), 0.0)


def test_metrics_move(server):
    before = scrape(server)
    ids = server.engine.tokenizer.encode(PROMPT)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    after = scrape(server)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("inferd:prompt_tokens_total") == len(ids)
    assert delta("inferd:generation_tokens_total") == 8
    assert delta("inferd:request_success_total", finished_reason="length") == 1
    for hist in ["time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"]:
        assert delta(f"inferd:{hist}_seconds_count") == 1, hist
    assert delta("inferd:request_decode_time_seconds_count") == 1
    assert delta("inferd:inter_token_latency_seconds_count") == 7
    assert value(after, "inferd:e2e_request_latency_seconds_sum") > value(
        before, "inferd:e2e_request_latency_seconds_sum"
    )
    assert delta("inferd:prefix_cache_queries_total") > 0
    for gauge in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]:
        assert (f"inferd:{gauge}", (("model_name", MODEL_NAME),)) in after
    assert ("inferd:num_preemptions_total", (("model_name", MODEL_NAME),)) in after
    assert ("inferd:prefix_cache_hits_total", (("model_name", MODEL_NAME),)) in after


def test_stream_disconnect_aborts(server):
    before = scrape(server)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        assert server.state.async_engine.num_in_flight == 1
    # closing the response closed the connection: the request is aborted and its blocks are free
    server.wait_idle(timeout=5)
    after = scrape(server)
    assert value(after, "inferd:request_success_total", finished_reason="abort") == (
        value(before, "inferd:request_success_total", finished_reason="abort") + 1
    )
    assert value(after, "inferd:num_requests_running") == 0
    assert server.engine.stats().kv_cache_usage == 0


def test_non_stream_disconnect_aborts(server):
    before = scrape(server)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.2))
    server.wait_idle(timeout=5)
    after = scrape(server)
    assert value(after, "inferd:request_success_total", finished_reason="abort") == (
        value(before, "inferd:request_success_total", finished_reason="abort") + 1
    )


def test_engine_failure_fails_requests_not_server(server, monkeypatch):
    real_step = server.engine.step

    def broken_step():
        monkeypatch.setattr(server.engine, "step", real_step)  # fail once
        raise RuntimeError("boom")

    monkeypatch.setattr(server.engine, "step", broken_step)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    server.wait_idle()
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200  # the server serves on
    assert httpx.get(server.url + "/health").status_code == 200

    monkeypatch.setattr(server.engine, "step", broken_step)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert '"error"' in events[0] and "boom" in events[0] and events[-1] == "data: [DONE]"
    server.wait_idle()


@pytest.fixture(scope="module")
def strict_server(tiny_models):
    srv = start_server(tiny_models["qwen2"], api_key="secret", max_num_seqs=1, max_waiting_requests=1)
    yield srv
    srv.stop()


def test_api_key(strict_server):
    url = strict_server.url
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}]:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/v1/completions", content=b"{bad").status_code == 401  # auth before parsing
    ok = {"Authorization": "Bearer secret"}
    assert httpx.post(url + "/v1/completions", json=body, headers=ok).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(url + "/metrics").status_code == 200


def test_overload_503(strict_server):
    url, auth = strict_server.url, {"Authorization": "Bearer secret"}
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(headers=auth, timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as running:
        lines = running.iter_lines()  # keep a reference: a dropped line iterator closes the response
        next(line for line in lines if line)  # running: the only batch slot is taken
        with c.stream("POST", url + "/v1/completions", json=body) as waiting:
            assert waiting.status_code == 200  # accepted into the waiting queue (limit 1)
            assert strict_server.state.async_engine.num_waiting == 1
            r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=auth)
            assert r.status_code == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "overloaded"
    strict_server.wait_idle()
    assert (
        httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=auth).status_code
        == 200
    )


def test_sigterm_drains_in_flight(tiny_models):
    srv = start_server(tiny_models["llama"], drain_timeout=20)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
        srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        assert not srv.state.async_engine.accepting
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    srv.thread.join(10)
    assert not srv.thread.is_alive()
    srv.engine.check_idle()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


class _Records(logging.Handler):
    """Every record of the loggers it is attached to, whatever their propagation (uvicorn's do not reach root)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(f"{r.name} {r.getMessage()} {r.exc_info!r}" for r in self.records)


@pytest.mark.timeout(60)
def test_drain_timeout_ends_streams_with_an_error_event(tiny_models, caplog):
    srv = start_server(tiny_models["llama"], drain_timeout=0.6, max_model_len=1024, kv_cache_memory=64 << 20)
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "inferd")]
    for lg in loggers:
        lg.addHandler(records)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            paths = ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
            streams = [
                stack.enter_context(httpx.stream("POST", srv.url + path, json=b, timeout=30))
                for path, b in zip(paths, [body, chat, {**body, "prompt": [PROMPT, "Hello"]}], strict=True)
            ]
            assert [s.status_code for s in streams] == [200, 200, 200]
            lines = [s.iter_lines() for s in streams]
            for it in lines:
                next(line for line in it if line)
            srv.server.handle_exit(signal.SIGTERM, None)
            rests = [[line for line in it if line] for it in lines]  # each ends by itself, cleanly
        for rest in rests:
            assert rest and rest[-1] == "data: [DONE]", [r[-2:] for r in rests]
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert error["code"] == "drain_timeout" and error["type"] == "server_error"
            assert not any('"finish_reason":"length"' in line for line in rest)  # cut, not finished
        srv.thread.join(10)
        assert not srv.thread.is_alive() and time.monotonic() - start < 8
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    srv.engine.check_idle()
    cut = [r for r in records.records if "drain deadline" in r.getMessage()]
    assert len(cut) == 3, records.text()  # one line per stream
    assert not [r for r in records.records if r.exc_info], records.text()  # no tracebacks
    assert "CancelledError" not in records.text() and "Cancel" not in records.text()


def test_serve_command_defaults():
    from inferd.cli import build_parser
    from inferd.config import DEFAULT_MODEL
    from inferd.server.cli import run_serve

    args = build_parser().parse_args(["serve"])
    assert args.func is run_serve and args.model == DEFAULT_MODEL
    assert (args.host, args.port, args.api_key, args.max_waiting_requests) == ("127.0.0.1", 8000, None, 0)
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--max-num-seqs", "4"])
    assert args.served_model_name == ["a", "b"] and args.max_num_seqs == 4
