"""The dashboard's routes and event stream (inferd/server/dashboard.py) on a real server, without a browser."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from inferd.engine.events import CACHED, FREE, expand_runs
from inferd.server.dashboard import DashboardHub
from tests.server.conftest import start_server

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_models):
    srv = start_server(tiny_models["llama"], api_key=KEY, num_blocks=256, attention_backend="torch", drain_timeout=2)
    yield srv
    srv.stop()


class Reader:
    """The dashboard's event stream, read on a thread into a list of messages."""

    def __init__(self, url: str, headers: dict):
        self.messages: list[dict] = []
        self.status: int | None = None
        self.closed = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(30, read=30))
        self._thread = threading.Thread(target=self._read, args=(url, headers), daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict) -> None:
        try:
            with self._client.stream("GET", url + "/dashboard/events", headers=headers) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.messages.append(json.loads(line[5:]))
        except httpx.HTTPError:
            pass
        finally:
            self.closed.set()

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in list(self.messages) if predicate(m)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such message in {len(self.messages)}: {[m['type'] for m in self.messages][-20:]}")

    def steps(self) -> list[dict]:
        return [e for m in list(self.messages) if m["type"] == "events" for e in m["events"] if e["type"] == "step"]

    def close(self) -> None:
        self._client.close()
        self._thread.join(5)


def test_page_and_files_are_open_the_stream_needs_the_key(keyed):
    page = httpx.get(keyed.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/dashboard.js" in page.text and "http" not in page.text.replace("http-equiv", "")
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        r = httpx.get(f"{keyed.url}/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 1000
    missing = httpx.get(keyed.url + "/dashboard/static/..%2Fapp.py")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    assert httpx.get(keyed.url + "/dashboard/static/nope.js").status_code == 404
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(keyed.url + "/dashboard/events", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "/dashboard/events" not in httpx.get(keyed.url + "/openapi.json", headers=AUTH).text


def test_stream_shows_a_request_step_by_step_and_the_cache_settling(keyed):
    # the module's other tests may have cached this prompt's head: start from a cache with nothing cached
    keyed.wait_idle()
    keyed.engine.kv.reset_prefix_cache()
    reader = Reader(keyed.url, AUTH)
    try:
        (hello,) = reader.wait_for(lambda m: m["type"] == "hello")
        assert reader.status == 200
        assert hello["model"] == "tiny" and hello["num_blocks"] == 256 and hello["block_size"] == 16
        assert hello["budget"] == keyed.engine.config.scheduler.max_num_batched_tokens
        prompt = list(range(3, 3 + 40))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(keyed.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200
        rid = r.json()["id"]
        mine = lambda: [s for s in reader.steps() if any(q[0] == rid for q in s["reqs"])]  # noqa: E731
        reader.wait_for(lambda m: any(q[0] == rid and q[3] == "f" for s in mine() for q in s["reqs"]))
        steps = mine()
        chunks = [q for s in steps for q in s["reqs"] if q[0] == rid]
        assert chunks[0][2] == "p" and sum(q[1] for q in chunks if q[2] == "p") == 40
        assert [q[2] for q in chunks if q[2] == "d"] == ["d"] * 7 and chunks[-1][3] == "f"
        assert sum(len(s["ttft_ms"]) for s in steps) == 1 and sum(len(s["itl_ms"]) for s in steps) == 7
        # the cache after it: nobody owns a block, the prompt's two full blocks stay cached
        kv = [e["kv"] for m in reader.messages if m["type"] == "events" for e in m["events"] if "kv" in e][-1]
        codes = expand_runs(kv["runs"])
        assert kv["owners"] == [] and codes.count(CACHED) == 2 and codes.count(FREE) == 254
        summary = reader.wait_for(lambda m: m["type"] == "summary" and m["ttft_count"] >= 1)[-1]
        assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] > 0
        assert summary["output_tokens_per_s"] > 0 and summary["prefix_hit_rate"] is not None
        assert summary["dropped_events"] == 0
    finally:
        reader.close()
    keyed.wait_idle()


def test_an_abort_while_idle_shows_in_the_cache(keyed):
    """A streamed request cut by its client frees its blocks without a step; the hub still reports it."""
    reader = Reader(keyed.url, AUTH)
    try:
        reader.wait_for(lambda m: m["type"] == "hello")
        body = {"prompt": list(range(3, 60)), "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            rid = r.headers["x-request-id"]
            next(r.iter_lines())
        keyed.wait_idle()

        def settled_after_it() -> bool:
            """A snapshot with no owner, after a step of the request (the snapshots during its steps are
            throttled, so one need not show it holding blocks; any snapshot from before it does not count)."""
            events = [e for m in list(reader.messages) if m["type"] == "events" for e in m["events"]]
            ran = [i for i, e in enumerate(events) if e["type"] == "step" and any(q[0] == rid for q in e["reqs"])]
            return bool(ran) and any("kv" in e and e["kv"]["owners"] == [] for e in events[ran[-1] + 1 :])

        reader.wait_for(lambda m: settled_after_it())
    finally:
        reader.close()


def test_a_draining_server_ends_the_stream(tiny_models):
    srv = start_server(tiny_models["llama"], num_blocks=64, attention_backend="torch", drain_timeout=20)
    reader = Reader(srv.url, {})
    try:
        reader.wait_for(lambda m: m["type"] == "hello")
        srv.state.begin_drain()  # what SIGTERM does
        assert reader.closed.wait(5), "the dashboard stream kept a draining server open"
    finally:
        reader.close()
        t = time.monotonic()
        srv.stop()
        assert time.monotonic() - t < 10


def test_the_dashboards_percentiles_are_the_benchmarks():
    """One definition (tests/measure/test_stats.py): the page's p99 is the number `inferd bench` reports."""
    from inferd.bench import metrics
    from inferd.server import dashboard

    assert dashboard.percentile is metrics.percentile


def test_a_slow_page_loses_messages_not_steps(tiny_models):
    """The hub never waits on a subscriber: a full queue drops (and counts) what that page would get."""
    from inferd import LLM

    llm = LLM(str(tiny_models["llama"]), max_model_len=128, num_blocks=64, attention_backend="torch")

    class _Async:  # the two things the hub reads of an AsyncEngine
        stats = llm.engine.stats()
        num_waiting = 0
        accepting = True

    async def scenario() -> dict:
        hub = DashboardHub(llm.engine, _Async(), "tiny", max_queue=2)
        gen = hub.stream()
        await gen.__anext__()  # hello: subscribed now, and never reading again
        llm.generate([[5, 6, 7]] * 3, None)
        for _ in range(6):
            hub.pump(time.monotonic())
            hub._next_summary = 0.0
        summary = hub.summary(time.monotonic())
        await gen.aclose()
        assert hub.num_subscribers == 0
        return summary

    summary = asyncio.run(scenario())
    assert summary["dropped_events"] > 0


def test_no_dashboard_means_no_page_and_no_step_events(tiny_models):
    srv = start_server(tiny_models["llama"], num_blocks=64, attention_backend="torch", settings={"dashboard": False})
    try:
        assert httpx.get(srv.url + "/dashboard").status_code == 404
        assert httpx.get(srv.url + "/dashboard/events").status_code == 404
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and srv.engine.events is None
    finally:
        srv.stop()


def test_serve_flag_turns_the_dashboard_off():
    import argparse

    from inferd.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).dashboard is True
    assert parser.parse_args(["serve", "--no-dashboard"]).dashboard is False
