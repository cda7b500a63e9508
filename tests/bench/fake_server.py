"""A small OpenAI-compatible streaming server for testing the benchmark end to end, in a thread.

Character-level tokenizer (one token per character, plus a BOS), so token counts are known exactly.
The model name picks the behaviour:
  fake      streams max_tokens one-character tokens, a usage chunk, then [DONE]
  no-usage  the same without the usage chunk (the benchmark must count tokens itself)
  flaky     request 3, 6, 9 ... answer HTTP 500; request 5, 10 ... break off with an error event mid-stream
  slow      waits 30 s before the first token (for per-request timeouts)
anything else answers 404 with OpenAI's error body.
`FakeServer(constant_tokens=True)` answers every /tokenize with the same tokens (a broken tokenizer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.net import free_port

MODELS = ("fake", "no-usage", "flaky", "slow")
BOS = 2


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def _not_found(model) -> JSONResponse:
    body = {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}}
    return JSONResponse(body, status_code=404)


def create_app(token_delay: float, constant_tokens: bool = False) -> FastAPI:
    app = FastAPI()
    counter = itertools.count(1)
    app.state.tokenize_calls = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        app.state.tokenize_calls += 1
        ids = encode("abc" if constant_tokens else body["prompt"])
        return {"tokens": ([BOS] if body.get("add_special_tokens", True) else []) + ids, "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        return {"prompt": "".join(chr(i) for i in body["tokens"] if i != BOS)}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        model = body.get("model")
        if model not in MODELS:
            return _not_found(model)
        n = next(counter)
        if model == "flaky" and n % 3 == 0:
            return JSONResponse({"error": {"message": "engine exploded", "code": 500}}, status_code=500)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        stream = _stream(body, model, n, len(encode(prompt)) + 1, chat, token_delay)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _chunk(chat: bool, text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return "data: " + json.dumps({"id": "x", "object": "chunk", "choices": [choice], "usage": None}) + "\n\n"


async def _stream(body: dict, model: str, n: int, prompt_tokens: int, chat: bool, delay: float):
    max_tokens = int(body.get("max_tokens", 16))
    if model == "slow":
        await asyncio.sleep(30)
    if chat:
        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
    for i in range(max_tokens):
        await asyncio.sleep(delay)
        if model == "flaky" and n % 5 == 0 and i == 2:
            yield "data: " + json.dumps({"error": {"message": "out of blocks", "code": 500}}) + "\n\n"
            return
        yield _chunk(chat, "ab"[i % 2], "length" if i == max_tokens - 1 else None)
    if model != "no-usage" and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
        usage["total_tokens"] = prompt_tokens + max_tokens
        yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


class FakeServer:
    """`with FakeServer() as url:` serves on a free port until the block ends."""

    def __init__(self, token_delay: float = 0.002, constant_tokens: bool = False):
        self.port = free_port()
        self.app = create_app(token_delay, constant_tokens)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
