"""Pools that change while running: the decode side's peers file and the proxy's list files (no processes)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx

from inferd.disagg.params import Peers
from inferd.disagg.proxy import Pool, ProxySettings, create_app


def write(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in lines))
    tmp.replace(path)


def test_a_peers_file_admits_what_it_lists_now(tmp_path):
    f = tmp_path / "peers"
    peers = Peers([], file=f)
    assert peers and "127.0.0.1:9100" not in peers  # a missing file admits nothing
    write(f, ["127.0.0.1:9100", "# a comment", "", "127.0.0.1:9101  # and one after"])
    assert "127.0.0.1:9100" in peers and "127.0.0.1:9101" in peers and "127.0.0.1:9102" not in peers
    write(f, ["127.0.0.1:9102"])  # a prefill replica left, another joined: seen on the next lookup
    assert "127.0.0.1:9100" not in peers and "127.0.0.1:9102" in peers
    static = Peers(["10.0.0.1:1"], file=f)
    assert "10.0.0.1:1" in static and "127.0.0.1:9102" in static
    f.unlink()
    assert "127.0.0.1:9102" not in static and "10.0.0.1:1" in static


def test_a_pool_follows_its_list_file_and_keeps_the_counters_of_who_stays(tmp_path):
    f = tmp_path / "decode.replicas"
    counts = []
    pool = Pool([], f, counts.append)
    assert pool.pick() is None
    write(f, ["http://a", "http://b/"])
    a = pool.pick()
    assert a.url == "http://a" and counts == [2]
    a.in_flight += 1
    assert pool.pick().url == "http://b"
    write(f, ["http://a", "http://c"])
    assert pool.pick().url == "http://c" and [i.url for i in pool.instances] == ["http://a", "http://c"]
    assert pool.instances[0] is a and a.in_flight == 1
    os.unlink(f)
    assert pool.pick() is None and counts[-1] == 0


def _run(app, coro):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://p") as c:
            return await coro(c)

    return asyncio.run(main())


def test_no_prefill_instance_prefills_on_the_decode_instance_and_no_decode_instance_is_a_503(tmp_path):
    prefill, decode = tmp_path / "prefill", tmp_path / "decode"
    write(prefill, [])
    write(decode, ["http://decode-1"])
    app = create_app(ProxySettings([], [], prefill_file=str(prefill), decode_file=str(decode), decode_wait=0.3))
    seen: list[tuple[str, dict]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((str(request.url), body))
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def calls(c: httpx.AsyncClient):
        app.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        first = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        write(decode, [])
        second = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        metrics = (await c.get("/metrics")).text
        return first, second, metrics

    first, second, metrics = _run(app, calls)
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "ok"
    assert seen == [("http://decode-1/v1/completions", {"prompt": "hi", "max_tokens": 3})]  # no kv_transfer_params
    assert 'inferd:disagg_proxy_prefills_total{reason="no_prefill_instance",where="local"} 1.0' in metrics
    assert second.status_code == 503 and second.headers["Retry-After"] == "1"
    assert second.json()["error"]["type"] == "server_error" and second.json()["error"]["code"] == "no_replica"
    assert len(seen) == 1  # and the 503 came before any prefill
    assert 'inferd:disagg_proxy_instances{pool="decode"} 0.0' in metrics


def test_a_decode_stream_is_relayed_whole_and_a_break_ends_it_with_one_error_event(tmp_path):
    decode = tmp_path / "decode"
    write(decode, ["http://decode-1"])
    app = create_app(ProxySettings([], [], prefill_file=str(tmp_path / "none"), decode_file=str(decode)))
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']

    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield events[0]
            raise httpx.ReadError("gone")

    class Whole(httpx.AsyncByteStream):
        async def __aiter__(self):
            for e in events:  # one event cut across two chunks
                yield e[:10]
                yield e[10:]
            yield b"data: [DONE]\n\n"

    def upstream(request: httpx.Request) -> httpx.Response:
        broken = json.loads(request.content)["prompt"] == "break"
        headers = {"content-type": "text/event-stream", "x-request-id": "r1", "server": "upstream"}
        return httpx.Response(200, headers=headers, stream=Broken() if broken else Whole())

    async def calls(c: httpx.AsyncClient):
        app.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        whole = await c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        broken = await c.post("/v1/completions", json={"prompt": "break", "stream": True})
        return whole, broken

    whole, broken = _run(app, calls)
    assert whole.status_code == 200 and whole.content == b"".join(events) + b"data: [DONE]\n\n"
    assert whole.headers["x-request-id"] == "r1" and whole.headers.get("server") != "upstream"
    assert whole.headers["content-type"].startswith("text/event-stream")
    assert broken.content.startswith(events[0]) and b"[DONE]" not in broken.content
    last = json.loads(broken.content.decode().strip().split("\n\n")[-1][6:])
    assert last["error"]["code"] == "stream_broken" and last["error"]["type"] == "server_error"
    assert app.state.proxy.decode.in_flight == 0
