"""While huge or pathological requests are refused or tokenized, /health and a running stream keep answering.

A poller times /health every 10 ms and streaming requests (one after another) record when each chunk arrives,
while the main thread sends, one after another: a 20 MB body (413 from its Content-Length), a body just under
the cap whose prompt is too long to tokenize (400 before tokenizing), prompts and a chat long enough to take
most of a second to tokenize (on a worker thread), and a token-id list filling the body cap (parsed on the event
loop, which is what bounds the default --max-request-body). The event loop must never stall: the longest
/health answer and the longest gap between stream chunks stay under a bound.

The server freezes its start-up heap (gc.freeze): here it runs in the test's process, whose heap after the
suite's other tests made an oldest-generation collection take ~0.5 s, long enough to fail the bound on CI.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server

# The aim is 100 ms. On a loaded 2-core CI machine the step thread, the tokenizer thread, torch's threads and
# these test threads share two cores, so the bound is the aim plus room for the scheduler: see the measured
# numbers in docs/hardening.md. A stall (tokenizing on the event loop) is seconds, far above either.
HEALTH_BOUND_S = 0.2
STREAM_GAP_BOUND_S = 0.4
# the cap is max_model_len x the longest token: 2,560 characters for the tiny model, 254k for gemma3-270m at
# 8192 tokens; here it is raised, to just under the 2 MiB body cap, so that the longest prompts the server takes
# need a while to tokenize (0.9-1.0 s each on the Xeon with AMX; 600k characters took 0.22-0.26 s, near the
# /health bound, so a faster CPU would have hidden a stall)
MAX_PROMPT_CHARS = 1_800_000


@dataclass
class Timings:
    health: list[float] = field(default_factory=list)  # latency of each /health
    health_at: list[float] = field(default_factory=list)  # when each /health was sent
    health_errors: list[str] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)  # arrival time of each stream chunk


def poll_health(url: str, stop: threading.Event, out: Timings) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get(url + "/health")
            out.health.append(time.perf_counter() - t0)
            out.health_at.append(t0)
            if r.status_code != 200:
                out.health_errors.append(r.text)
            time.sleep(0.01)


def read_stream(url: str, started: threading.Event, stop: threading.Event, out: Timings) -> None:
    """Streams, one after another (a tiny model's 1000 tokens can end before the load does), until `stop`: then
    the stream is closed, which aborts it."""
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    while not stop.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    out.chunks.append(time.perf_counter())
                    started.set()
                if stop.is_set():
                    return


def pathological(url: str) -> list[tuple[str, int, float]]:
    """(what, status, seconds) of each request."""
    statuses = []
    with httpx.Client(base_url=url, timeout=60) as c:

        def send(what: str, path: str, payload: bytes) -> None:
            t0 = time.perf_counter()
            r = c.post(path, content=payload, headers={"Content-Type": "application/json"})
            statuses.append((what, r.status_code, time.perf_counter() - t0))
            print(f"{what}: {r.status_code} in {statuses[-1][2]:.2f} s")

        send("20 MB body", "/v1/completions", json.dumps({"prompt": "x" * (20 << 20)}).encode())
        send("prompt past the char cap", "/v1/completions", json.dumps({"prompt": "x" * ((2 << 20) - 64)}).encode())
        text = "The quick brown fox jumps over the lazy dog. " * (MAX_PROMPT_CHARS // 45)
        send("long prompt, tokenized", "/v1/completions", json.dumps({"prompt": text}).encode())
        send("long /tokenize", "/tokenize", json.dumps({"prompt": text}).encode())
        chat = {"messages": [{"role": "user", "content": text[:-100]}]}  # the template adds a little
        send("long chat", "/v1/chat/completions", json.dumps(chat).encode())
        ids = json.dumps({"prompt": [7] * ((2 << 20) // 3 - 100)}).encode()
        send("token list at the body cap", "/v1/completions", ids)
    return statuses


@pytest.mark.timeout(120)
def test_health_and_streams_keep_answering(tiny_models):
    srv = start_server(tiny_models["llama"], max_model_len=1024, settings={"max_prompt_chars": MAX_PROMPT_CHARS})
    out, stop, started = Timings(), threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=poll_health, args=(srv.url, stop, out), daemon=True),
        threading.Thread(target=read_stream, args=(srv.url, started, stop, out), daemon=True),
    ]
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.3)  # past the stream's first steps
        begin = time.perf_counter()
        requests = pathological(srv.url)
        end = time.perf_counter()
        stop.set()
        for t in threads:
            t.join(10)
        srv.wait_idle()  # the closed stream was aborted, the refused requests left nothing behind
    finally:
        stop.set()
        srv.stop()
    statuses = {what: s for what, s, _ in requests}
    assert all(400 <= s < 500 for what, s in statuses.items() if what != "long /tokenize"), statuses
    assert statuses["long /tokenize"] == 200  # /tokenize has no context to fit: it just counts
    assert statuses["20 MB body"] == 413
    assert out.chunks[-1] > end  # a stream ran all the while
    assert not out.health_errors
    # what happened while the pathological requests were in the server
    health = [lat for at, lat in zip(out.health_at, out.health, strict=True) if begin <= at <= end]
    gaps = [b - a for a, b in zip(out.chunks, out.chunks[1:], strict=False) if begin <= b <= end]
    print(
        f"pathological requests took {end - begin:.2f} s; /health: {len(health)} polls, max "
        f"{max(health) * 1e3:.0f} ms; stream: {len(gaps)} gaps, max {max(gaps) * 1e3:.0f} ms"
    )
    # we did measure under load, and each tokenized request took long enough that tokenizing it on the event
    # loop would have broken both bounds
    tokenized = [seconds for what, _, seconds in requests if what in ("long prompt, tokenized", "long /tokenize")]
    assert min(tokenized) > STREAM_GAP_BOUND_S, requests
    assert len(health) > 20 and len(gaps) > 20
    assert max(health) < HEALTH_BOUND_S, sorted(health)[-5:]
    assert max(gaps) < STREAM_GAP_BOUND_S, sorted(gaps)[-5:]


@pytest.mark.timeout(60)
def test_the_start_up_heap_is_frozen_while_serving(tiny_models):
    """What was alive at start-up stays out of the collector's walks while the server runs; stopping releases it."""
    assert gc.get_freeze_count() == 0
    srv = start_server(tiny_models["llama"])
    try:
        frozen = gc.get_freeze_count()
        r = httpx.get(srv.url + "/health", timeout=10)
    finally:
        srv.stop()
    assert r.status_code == 200
    assert frozen > 100_000  # torch, transformers and the model: far more than requests create
    assert gc.get_freeze_count() == 0
