"""AsyncEngine: the Engine's step loop on a background thread, one asyncio stream of outputs per request.

The event loop and the step loop never wait on each other. Requests and aborts go to the step thread
through a thread-safe inbox that it drains between steps; each step's outputs come back to the event
loop in one `call_soon_threadsafe` and are fanned out to per-request queues there. torch releases the
GIL inside its kernels, so HTTP handling runs while a step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferd.engine.engine import Engine, EngineStats
from inferd.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError
from inferd.outputs import RequestOutput
from inferd.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    future: asyncio.Future
    lora_name: str | None = None
    priority: int = 0
    ttft_deadline: float | None = None


@dataclass
class _Call:
    """Something to do on the step thread between steps (loading a LoRA adapter), its result to the future."""

    fn: Callable[[], Any]
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


_STOP = object()


@dataclass
class RequestStream:
    """The outputs of one request, in order, as the step thread produces them."""

    request_id: str
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


@dataclass
class EngineHooks:
    """Called on the step thread; the metrics module plugs in here. Must be quick and never raise."""

    on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None
    on_abort: Callable[[str], None] | None = None


class AsyncEngine:
    """Runs `engine` on its own thread. Create and use it from one event loop."""

    def __init__(self, engine: Engine, max_waiting_requests: int = 0, hooks: EngineHooks | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.hooks = hooks or EngineHooks()
        self.stats: EngineStats = engine.stats()  # a snapshot, replaced (not mutated) after every step
        self.dead: BaseException | None = None
        self.accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._num_pending = 0  # sequences submitted, not yet taken in by the step thread (event-loop side only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # step-thread side: requests the engine holds

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        free_openmp_pool()  # before the step thread makes its own: see free_openmp_pool
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is left and end the step thread."""
        self.accepting = False
        self._fail_all(EngineDeadError("the server shut down"))
        self._inbox.put(_STOP)  # the step thread aborts whatever it still holds
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.engine.close()

    def start_drain(self) -> None:
        """Stop taking new requests; in-flight ones keep running. Safe to call from a signal handler."""
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait up to `timeout` s for in-flight ones; True if all finished."""
        self.start_drain()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_pending(self) -> int:
        """Sequences (each request's n) submitted but not yet taken in by the step thread."""
        return self._num_pending

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for the batch: the unit of max_waiting_requests, as of the metrics' gauge."""
        return self.stats.num_waiting + self._num_pending

    # -- requests (event loop) ---------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        ttft_deadline: float | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream once the engine has accepted it (`lora_name`: its adapter;
        `priority`: its class under the priority policy; `ttft_deadline`: seconds, under the deadline policy).

        Raises InvalidRequestError (as the engine does) for a request that cannot run, and
        EngineOverloadedError when the waiting queue is full or the server is draining.
        """
        self.check_admission(params.n)
        arrival = time.monotonic()
        if params.structured is not None:  # compiled here, off the event loop and the step loop
            await asyncio.to_thread(self.engine.grammars.compile, params.structured)
        future = self._loop.create_future()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._num_pending += params.n
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        self._inbox.put(
            _Add(request_id, prompt, params, cache_salt, arrival, future, lora_name, priority, ttft_deadline)
        )
        try:
            await future
        except BaseException:
            self._streams.pop(request_id, None)
            if future.cancelled():  # cancelled while queued: the engine may have taken it in already
                self._inbox.put(_Abort(request_id))
            raise
        finally:
            self._num_pending -= params.n
        return stream

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the step thread between two steps (what changes the engine's state outside a
        request: loading or unloading a LoRA adapter); its result, or its exception raised here."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead}")
        future = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary and free its blocks. Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._inbox.put(_Abort(request_id))

    def fail_all(self, error: BaseException) -> list[str]:
        """End every request now: its stream raises `error` and the engine frees its blocks. Returns their ids."""
        ids = list(self._streams)
        self._fail(ids, error)
        for rid in ids:
            self._inbox.put(_Abort(rid))
        return ids

    def check_admission(self, num_seqs: int, param: str = "n") -> None:
        """Raise unless `num_seqs` more sequences may wait now: InvalidRequestError if they never could
        (more than max_waiting_requests), EngineOverloadedError if the queue is too full for them now."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead}")
        if not self.accepting:
            raise EngineOverloadedError("the server is shutting down; send the request to another replica", 5)
        limit = self.max_waiting_requests
        if not limit:
            return
        if num_seqs > limit:
            raise InvalidRequestError(
                f"this request makes {num_seqs} sequences (prompts times n) but at most {limit} may wait "
                "(--max-waiting-requests); send fewer prompts or a lower n",
                param=param,
            )
        if self.num_waiting + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} sequences are waiting (limit {limit}); retry later"
            )

    # -- the step thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("inferd-engine")
        try:
            while True:
                # block only when there is nothing to step; otherwise take what came in and go on
                block = not self.engine.has_unfinished_requests()
                if not self._take_inbox(block, self.engine.idle_timeout()):
                    return
                if not self.engine.has_unfinished_requests():
                    self.engine.housekeeping()  # blocks lent to other processes expire even while idle
                    self._publish([])
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step fails the requests in it, not the server
                    logger.exception("engine step failed; aborting %d requests", len(self._live))
                    self._fail_live(e)
                    continue
                for out in outputs:
                    if out.finished:
                        self._live.discard(out.request_id)
                self._publish(outputs)
        except BaseException as e:  # the loop itself broke: nothing can be served any more
            logger.exception("engine loop died")
            self.dead = e
            error = EngineDeadError(f"the engine failed: {e}")
            self._call_loop(self._fail_all, error)
            self._reject_inbox(error)

    def _reject_inbox(self, error: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add | _Call):
                self._call_loop(_resolve, item.future, error)

    def _take_inbox(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        replies: list[tuple[asyncio.Future, BaseException | None]] = []
        while item is not _STOP:
            if isinstance(item, _Add):
                replies.append((item.future, self._add(item)))
            elif isinstance(item, _Call):
                self._call_loop(_settle, item.future, *_outcome(item.fn))
            else:
                self._abort(item.request_id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        # the stats must count an accepted request as waiting before its submitter hears back,
        # or the overload check could miss it in between
        self.stats = self.engine.stats()
        if replies:
            self._call_loop(_resolve_all, replies)
        if item is _STOP:
            for rid in list(self._live):
                self.engine.abort(rid)
            self._live.clear()
            return False
        return True

    def _add(self, item: _Add) -> BaseException | None:
        if item.future.cancelled():
            return None
        try:
            self.engine.add_request(
                item.request_id, item.prompt, item.params, item.cache_salt, item.arrival_time, item.lora_name,
                item.priority, item.ttft_deadline,
            )  # fmt: skip
        except Exception as e:
            return e
        self._live.add(item.request_id)
        return None

    def _abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self.engine.abort(request_id)
            if self.hooks.on_abort:
                self.hooks.on_abort(request_id)

    def _fail_live(self, error: Exception) -> None:
        failed = list(self._live)
        for rid in failed:
            self.engine.abort(rid)
        self._live.clear()
        err = RequestFailedError(f"the engine failed while running this request: {error}")
        self._call_loop(self._fail, failed, err)
        self.stats = self.engine.stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.stats = stats = self.engine.stats()
        if self.hooks.on_step:
            self.hooks.on_step(stats, outputs)
        if outputs:
            self._call_loop(self._dispatch, outputs)

    def _call_loop(self, fn: Callable, *args) -> None:
        # a closed event loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop --------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its client while this step ran
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._streams), error)


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS too (Linux: `top -H`, /proc/PID/task/*/comm, py-spy), so the
    step thread's CPU time can be told from the event loop's. Elsewhere, or if it fails, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: at most 15 bytes and a NUL


def free_openmp_pool() -> bool:
    """End the calling thread's OpenMP worker pool (libgomp's `omp_pause_resource_all`); True if it did.

    libgomp gives every thread that starts parallel work its own pool of workers, and when it counts more of
    its threads than CPUs it stops spin-waiting between parallel regions, so each of the thousands of ops in
    a step waits for a worker to wake up. The model is loaded on the event loop's thread, whose pool would
    then idle beside the step thread's: on 2 cores an engine stepping on a new thread after the main thread
    had generated ran measurably slower than on the main thread, and as fast once the main thread's pool was
    freed (docs/performance.md). A thread that runs torch's parallel ops again later gets a new
    pool. Without libgomp (another OpenMP runtime, no OpenMP) nothing happens."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the runtime torch already loaded
        return gomp.omp_pause_resource_all(2) == 0  # omp_pause_hard: the pool's threads end
    except (OSError, AttributeError):
        return False


def _outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


def _resolve_all(replies: list[tuple[asyncio.Future, BaseException | None]]) -> None:
    for future, error in replies:
        _resolve(future, error)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    _settle(future, None, error)
