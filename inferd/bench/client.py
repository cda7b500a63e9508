"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Always streams with `stream_options.include_usage`, so token counts can come from the server. Never raises
for a failed request: every failure (connection, HTTP status, error event mid-stream, timeout, cut stream)
comes back as a `RequestOutput` with `success=False` and an error whose text before the first colon is its
kind ("HTTP 404", "ConnectError", "Timeout", ...), which the report counts by. `send_all` sends a list of
requests at a concurrency or on a schedule (the labs' streamed requests), `ttfts` their times to a first token.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from inferd.bench.datasets import BenchRequest
from inferd.bench.metrics import ttft


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"

    @property
    def backend(self) -> str:
        """vLLM's name for this kind of endpoint in its result JSON."""
        return "openai" if self is Endpoint.COMPLETIONS else "openai-chat"


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: Endpoint = Endpoint.COMPLETIONS
    api_key: str | None = None
    ignore_eos: bool = False
    eos_logit_bias: tuple[int, ...] = ()  # llama-cpp-python has no ignore_eos: bias the eos ids away instead
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0


@dataclass
class RequestOutput:
    index: int
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str | None = None
    send_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    usage_timing: dict | None = None  # usage.timing: where the request's time went (inferd's `return_timing`)
    token_ids: list[int] = field(default_factory=list)  # the chunks' `token_ids` (vLLM's `return_token_ids`)
    finish_reason: str | None = None


def normalize_base_url(url: str) -> str:
    """Accept http://host:port, .../ and .../v1: the endpoints and /tokenize hang off the root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def build_body(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model or cfg.model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = req.prompt
    else:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.eos_logit_bias:
        body["logit_bias"] = {str(i): -100 for i in cfg.eos_logit_bias}
    body.update(cfg.extra_body)
    body.update(req.extra_body or {})
    return body


DONE = object()


def parse_sse_line(line: str) -> dict | object | None:
    """One SSE line -> the JSON event, DONE for `[DONE]`, or None for comments, blank and non-data lines."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return DONE
    if not payload:
        return None
    return json.loads(payload)


def chunk_text(event: dict, endpoint: Endpoint) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint is Endpoint.COMPLETIONS:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def error_message(status: int, body: bytes) -> str:
    """OpenAI's error body {"error": {"message": ...}} or FastAPI's {"detail": ...} -> 'HTTP 404: message'."""
    try:
        data = json.loads(body)
        err = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {str(msg)[:300]}"


class StreamingClient:
    """An httpx.AsyncClient shared by all requests of a run; use as `async with`."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s, pool=None)
        # no connection cap: with --request-rate inf a pool limit would queue requests inside the client
        # and show up as server TTFT
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            base_url=normalize_base_url(cfg.base_url), headers=headers, timeout=timeout, limits=limits
        )

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def send(
        self, index: int, req: BenchRequest, on_done: Callable[[RequestOutput], None] | None = None
    ) -> RequestOutput:
        out = RequestOutput(index=index, prompt_len=req.prompt_len, expected_output_len=req.output_len)
        out.send_time = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self._stream(build_body(self.cfg, req), out)
        except TimeoutError:
            out.error = f"Timeout: no complete response within {self.cfg.timeout_s:g} s"
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError) as e:  # a malformed event: the server broke the protocol
            out.error = f"BadResponse: {type(e).__name__}: {e}"
        out.end_time = time.perf_counter()
        out.success = out.error is None
        if on_done is not None:
            on_done(out)
        return out

    async def _stream(self, body: dict, out: RequestOutput) -> None:
        async with self._http.stream("POST", self.cfg.endpoint.path, json=body) as resp:
            if resp.status_code != 200:
                out.error = error_message(resp.status_code, await resp.aread())
                return
            done = False
            first_choice_time: float | None = None
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event is DONE:
                    done = True
                    break
                now = time.perf_counter()
                if "error" in event:  # vLLM and llama.cpp report errors after a 200 as an error event
                    err = event["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    out.error = f"StreamError: {str(msg)[:300]}"
                    return
                self._take_event(event, now, out)
                if event.get("choices") and first_choice_time is None:
                    first_choice_time = now
            if not out.chunk_times and first_choice_time is not None:
                # a reply whose only tokens decode to "" (e.g. EOS first): its first chunk is its first token
                out.chunk_times.append(first_choice_time)
            if not done and out.finish_reason is None:
                out.error = "IncompleteStream: the stream ended without [DONE] or a finish_reason"

    def _take_event(self, event: dict, now: float, out: RequestOutput) -> None:
        text = chunk_text(event, self.cfg.endpoint)
        if text:
            out.chunk_times.append(now)
            out.text += text
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
            out.token_ids += choice.get("token_ids") or []
        usage = event.get("usage")
        if usage:
            out.usage_prompt_tokens = usage.get("prompt_tokens", out.usage_prompt_tokens)
            out.usage_completion_tokens = usage.get("completion_tokens", out.usage_completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            out.usage_cached_tokens = details.get("cached_tokens", out.usage_cached_tokens)
            out.usage_timing = usage.get("timing", out.usage_timing)


def send_all(
    url: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    at: Sequence[float] | None = None,
    model: str = "m",
    api_key: str | None = None,
) -> list[RequestOutput]:
    """Stream `requests` (prompts as text or token ids) to `model` at `url`, exactly their output lengths (eos
    ignored), greedy: at most `concurrency` in flight, or each sent at its time in `at` (seconds from the start),
    else all at once (as the tenant of `api_key`, if given). The outputs, in request order; a failure is an output
    with `success` False."""
    cfg = ClientConfig(url, model, api_key=api_key, ignore_eos=True, timeout_s=300.0)

    async def go() -> list[RequestOutput]:
        sem = asyncio.Semaphore(concurrency or len(requests) or 1)
        async with StreamingClient(cfg) as client:

            async def one(i: int, req: BenchRequest) -> RequestOutput:
                async with sem:
                    return await client.send(i, req)

            start, tasks = time.perf_counter(), []
            for i, req in enumerate(requests):
                if at is not None:
                    await asyncio.sleep(max(0.0, start + at[i] - time.perf_counter()))
                tasks.append(asyncio.create_task(one(i, req)))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(go())


def ttfts(url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    """Streamed completions of 2 tokens, `concurrency` at a time: their TTFTs in seconds, in prompt order;
    raises on the first that failed."""
    outs = send_all(url, [BenchRequest(p, len(p), 2) for p in prompts], concurrency=concurrency)
    if failed := next((o for o in outs if not o.success), None):
        raise RuntimeError(f"{url}: {failed.error}")
    return [ttft(o) for o in outs]
