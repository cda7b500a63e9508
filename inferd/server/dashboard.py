"""The live dashboard: GET /dashboard (a static page), GET /dashboard/events (its server-sent event stream).

`DashboardHub` attaches a `StepEvents` sink to the engine (inferd/engine/events.py), drains its ring on
the event loop every `tick` seconds and fans the step events out to every open stream, together with a
summary once a second: TTFT and ITL percentiles over the last minute (`inferd.measure.stats`, as the
benchmarks take them), output tokens/s, the queue, KV usage and the prefix cache hit rate. Summaries of
the last `history` seconds are kept, so a page opened now draws its charts from the past minutes at once.
The step thread only ever appends to the ring; a slow page loses events (counted, and shown on the page),
it never holds a step up.

The page and its script are plain files in `inferd/server/static/` (no build step, nothing fetched from
the internet). They are open like /health; the event stream is behind `--api-key` like the API, and
the page sends the key it is given (`/dashboard?key=...` or a prompt) as a Bearer header.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.engine import Engine
from inferd.engine.events import StepEvents
from inferd.measure.stats import percentile
from inferd.server.errors import APIError

logger = logging.getLogger(__name__)

STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PERCENTILES = (50, 90, 99)


@dataclass
class Window:
    """(time, value) samples of the last `span` seconds, at most `cap` of them."""

    span: float
    cap: int = 100_000
    items: collections.deque = field(default_factory=collections.deque)

    def add(self, now: float, values: list[float]) -> None:
        for v in values:
            self.items.append((now, v))
        while len(self.items) > self.cap:
            self.items.popleft()

    def values(self, now: float) -> list[float]:
        while self.items and self.items[0][0] < now - self.span:
            self.items.popleft()
        return [v for _, v in self.items]


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue
    dropped: int = 0


class DashboardHub:
    """Owns the engine's step-event sink and the open event streams. Start and stop on the serving loop."""

    def __init__(
        self,
        engine: Engine,
        async_engine: AsyncEngine,
        model_name: str,
        tick: float = 0.1,
        history: float = 300.0,
        max_queue: int = 64,
    ):
        self.engine = engine
        self.async_engine = async_engine
        self.model_name = model_name
        self.tick = tick
        self.events = StepEvents()
        engine.events = self.events
        self.max_queue = max_queue
        self.ttft = Window(60.0)
        self.itl = Window(60.0)
        self.tokens = Window(10.0)
        self.step_ms = Window(10.0)
        self.summaries: collections.deque = collections.deque(maxlen=int(history))
        self.last_kv: dict | None = None
        self.last_step: dict | None = None
        self._subscribers: set[_Subscriber] = set()
        self._task: asyncio.Task | None = None
        self._next_summary = 0.0
        self._created = time.monotonic()
        self._idle_kv_at = 0.0
        self._prefix_marks: collections.deque = collections.deque(maxlen=64)  # (time, queries, hits)

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="inferd-dashboard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.engine.events = None

    # -- the pump ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                self.pump(time.monotonic())
            except Exception:  # a bug here must not end the dashboard for good, nor touch serving
                logger.exception("dashboard pump failed")
            await asyncio.sleep(self.tick)

    def pump(self, now: float) -> None:
        """Drain the engine's events, update the windows, send them on; a summary once a second."""
        if self._idle() and now >= self._idle_kv_at:  # an abort frees blocks without a step
            self._idle_kv_at = now + 1.0
            self.events.push_kv(self.engine.kv)
        batch = self.events.ring.drain()
        for e in batch:
            self._account(e, now)
        if batch:
            self._send({"type": "events", "events": batch})
        if now >= self._next_summary:
            self._next_summary = now + 1.0
            summary = self.summary(now)
            self.summaries.append(summary)
            self._send(summary)

    def _idle(self) -> bool:
        stats = self.async_engine.stats
        return stats.num_running == 0 and stats.num_waiting == 0

    def _account(self, e: dict, now: float) -> None:
        if "kv" in e:
            self.last_kv = e["kv"]
        if e["type"] != "step":
            return
        self.last_step = e
        self.ttft.add(now, e["ttft_ms"])
        self.itl.add(now, e["itl_ms"])
        self.tokens.add(now, [len(e["ttft_ms"]) + len(e["itl_ms"])])
        self.step_ms.add(now, [e["dur_ms"]])

    def summary(self, now: float) -> dict[str, Any]:
        stats = self.async_engine.stats
        # one array per window for its three percentiles (a list of thousands of floats converted once, not thrice:
        # the summary runs on the serving loop, which shares the GIL with the step thread)
        ttft, itl = np.asarray(self.ttft.values(now), dtype=float), np.asarray(self.itl.values(now), dtype=float)
        self._prefix_marks.append((now, stats.prefix_cache_queries, stats.prefix_cache_hits))
        t0, q0, h0 = next((m for m in self._prefix_marks if m[0] >= now - 60), self._prefix_marks[0])
        queries, hits = stats.prefix_cache_queries - q0, stats.prefix_cache_hits - h0
        span = min(self.tokens.span, max(1.0, now - self._created))
        return {
            "type": "summary",
            "ts": time.time(),
            "ttft_ms": {f"p{p}": percentile(ttft, p) for p in PERCENTILES},
            "itl_ms": {f"p{p}": percentile(itl, p) for p in PERCENTILES},
            "ttft_count": len(ttft),
            "output_tokens_per_s": round(sum(self.tokens.values(now)) / span, 2),
            "steps_per_s": round(len(self.step_ms.values(now)) / span, 2),
            "running": stats.num_running,
            "waiting": self.async_engine.num_waiting,
            "kv_usage": round(stats.kv_cache_usage, 4),
            "prefix_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4)
            if stats.prefix_cache_queries
            else None,
            "prefix_hit_rate_1m": round(hits / queries, 4) if queries else None,
            "preemptions": stats.num_preemptions,
            # speculative decoding: tokens per step that verified drafts, and drafts accepted / proposed
            "spec_tokens_per_step": round(1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts, 3)
            if stats.spec_num_drafts
            else None,
            "spec_acceptance": round(stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens, 4)
            if stats.spec_num_draft_tokens
            else None,
            "dropped_events": self.events.ring.dropped + sum(s.dropped for s in self._subscribers),
            "kv_snapshot_us": round(self.events.kv_cost_s * 1e6, 1),
        }

    # -- streams -----------------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        """What a new page needs before the first event: the engine's shape, the KV now, the history."""
        engine = self.engine
        return {
            "type": "hello",
            "model": self.model_name,
            "num_blocks": engine.kv.num_blocks,
            "block_size": engine.kv.block_size,
            "budget": engine.config.scheduler.max_num_batched_tokens,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "prefix_caching": engine.kv.enable_caching,
            "kv": self.last_kv,
            "last_step": self.last_step,
            "summaries": list(self.summaries),
        }

    def _send(self, message: dict) -> None:
        if not self._subscribers:
            return
        data = f"data: {json.dumps(message, separators=(',', ':'))}\n\n"
        for sub in self._subscribers:
            if sub.queue.full():
                sub.dropped += len(message.get("events", ())) or 1
                continue
            sub.queue.put_nowait(data)

    async def stream(self):
        """One page's event stream: hello, then events and summaries, until the client or the server goes."""
        sub = _Subscriber(asyncio.Queue(self.max_queue))
        self._subscribers.add(sub)
        try:
            yield f"retry: 2000\ndata: {json.dumps(self.hello(), separators=(',', ':'))}\n\n"
            while self.async_engine.accepting:  # a draining server must not wait on a dashboard
                try:
                    yield await asyncio.wait_for(sub.queue.get(), timeout=1.0)
                except TimeoutError:
                    yield ": keep-alive\n\n"
        finally:
            self._subscribers.discard(sub)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)


def _static(name: str) -> bytes:
    return resources.files("inferd.server").joinpath("static", name).read_bytes()


def install_dashboard(app: FastAPI, hub: DashboardHub) -> None:
    """The page, its two static files and the event stream."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC:
            raise APIError(404, f"no dashboard file {name!r}", "not_found_error", code="not_found")
        return Response(_static(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> Response:
        return StreamingResponse(
            hub.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
