"""Submitting a request's prompts to the AsyncEngine, merging their streams, and noticing disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

from inferd.engine.async_engine import AsyncEngine, RequestStream
from inferd.outputs import RequestOutput
from inferd.request import sub_request_id
from inferd.sampling import SamplingParams

if TYPE_CHECKING:
    from inferd.server.state import ServerState
    from inferd.tracing import TraceStart

T = TypeVar("T")


async def submit_request(
    state: ServerState, raw: Request, req, request_id: str, prompts: list[list[int]], params: SamplingParams,
    lora_name: str | None,
) -> list[tuple[str, RequestStream]]:  # fmt: skip
    """`submit` an OpenAI request's prompts with what every such request carries: its cache salt, priority and
    TTFT deadline (`req`'s fields) and its trace context (`raw`'s headers)."""
    return await submit(
        state.async_engine, request_id, prompts, params, req.cache_salt, lora_name, req.priority, req.ttft_deadline,
        trace=state.trace(raw.headers, params),
    )  # fmt: skip


class ClientDisconnected(Exception):
    pass


async def submit(
    engine: AsyncEngine,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    cache_salt: str | None,
    lora_name: str | None = None,
    priority: int = 0,
    ttft_deadline: float | None = None,
    trace: TraceStart | None = None,
) -> list[tuple[str, RequestStream]]:
    """Queue every prompt as one engine request; if any is refused, abort the others and raise its error.

    The whole request is admitted or refused at once: all its sequences (prompts times n) count against
    max_waiting_requests together, so a request that can never fit is a 400 and not a 503 to retry forever.
    """
    engine.check_admission(len(prompts) * params.n, "prompt" if len(prompts) > 1 else "n")
    ids = [base_id if len(prompts) == 1 else sub_request_id(base_id, i) for i in range(len(prompts))]
    if trace is not None:  # before the engine sees them: a request may end before add_request returns
        trace.start(ids)
    results = await asyncio.gather(
        *(
            engine.add_request(rid, p, params, cache_salt, lora_name, priority, ttft_deadline)
            for rid, p in zip(ids, prompts, strict=True)
        ),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for rid, r in zip(ids, results, strict=True):
            if not isinstance(r, BaseException):
                engine.abort(rid)
        if trace is not None:
            trace.forget(ids)
        raise errors[0]
    return list(zip(ids, results, strict=True))


async def iterate(
    engine: AsyncEngine, streams: list[tuple[str, RequestStream]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come; leaving early aborts the unfinished ones."""
    try:
        if len(streams) == 1:
            async for out in streams[0][1]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, (_, s) in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for rid, stream in streams:
            if not stream.finished:
                engine.abort(rid)


async def final_outputs(engine: AsyncEngine, streams: list[tuple[str, RequestStream]]) -> list[RequestOutput]:
    """The finished output of every prompt, in prompt order."""
    final: dict[int, RequestOutput] = {}
    async for i, out in iterate(engine, streams):
        if out.finished:
            final[i] = out
    return [final[i] for i in range(len(streams))]


async def _disconnected(request: Request) -> None:
    # the body is already read, so the next message the server sends is the disconnect
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()
