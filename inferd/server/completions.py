"""POST /v1/completions.

With `resume` (docs/server.md) the request continues a stream another replica began: the prompt is not
echoed again, and the answer (headed `x-inferd-resumed`) holds only the tokens after the resumed ones. With
`return_token_ids` every choice carries its token ids; in a stream, each chunk those of its text (tokens whose
text is still held back, by a stop string's hold-back or an unfinished character, come with the next chunk).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferd.outputs import RequestOutput
from inferd.prompts import prompt_items
from inferd.sampling import RESUMED_HEADER
from inferd.server.errors import APIError, stream_error
from inferd.server.logprobs import completion_logprobs
from inferd.server.params import completion_params, usage_options
from inferd.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from inferd.server.sse import DONE, SSEResponse, event
from inferd.server.state import ServerState, new_id
from inferd.server.streams import ClientDisconnected, final_outputs, iterate, submit_request, unless_disconnected


async def _prompts(state: ServerState, prompt) -> tuple[list[list[int]], list[str | None]]:
    """OpenAI's four prompt shapes (str, [str], [int], [[int]]) -> token ids and texts, one per prompt.

    Every text's length is checked before any is tokenized, so a refused request costs no tokenizing."""
    items = prompt_items(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    texts = [p if isinstance(p, str) else None for p in items]
    for i, text in enumerate(texts):
        if text is not None:
            state.check_length(text, "prompt" if len(items) == 1 else f"prompt.{i}")
    ids = []
    for i, p in enumerate(items):
        ids.append(await state.encode_async(p) if isinstance(p, str) else p)
        state.check_prompt_tokens(ids[-1], "prompt" if len(items) == 1 else f"prompt.{i}")
    return ids, texts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    lora_name = state.check_model(req.model)
    params = completion_params(req)
    prompt_ids, prompt_texts = await _prompts(state, req.prompt)
    if params.resume_token_ids and len(prompt_ids) > 1:
        raise APIError(400, "resume continues one prompt's stream: send one prompt", param="resume")
    request_id = new_id("cmpl")
    streams = await submit_request(state, raw, req, request_id, prompt_ids, params, lora_name)
    try:
        echoes = [
            (t if t is not None else await state.decode_async(ids)) if req.echo and req.resume is None else ""
            for t, ids in zip(prompt_texts, prompt_ids, strict=True)
        ]
    except BaseException:
        for rid, _ in streams:
            state.async_engine.abort(rid)
        raise
    headers = {"X-Request-Id": request_id}
    if params.resume_token_ids:
        headers[RESUMED_HEADER] = str(len(params.resume_token_ids))
    if req.stream:
        body = _stream(state, req, request_id, streams, echoes, [len(ids) for ids in prompt_ids])
        return SSEResponse(
            body, on_close=lambda: [state.async_engine.abort(rid) for rid, _ in streams], headers=headers
        )
    try:
        finals = await unless_disconnected(raw, final_outputs(state.async_engine, streams))
    except ClientDisconnected:
        return Response(status_code=499)
    body = _response(state, req, request_id, finals, echoes)
    return JSONResponse(
        body.model_dump(exclude=None if body.kv_transfer_params else {"kv_transfer_params"}), headers=headers
    )


def _response(
    state: ServerState, req: CompletionRequest, request_id: str, finals: list[RequestOutput], echoes: list[str]
) -> CompletionResponse:
    choices, usage = [], UsageInfo()
    for i, out in enumerate(finals):
        usage.add_output(out)
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = completion_logprobs(c.logprobs or [], state.token_text, len(echoes[i]))
            choices.append(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=echoes[i] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
            )
    kv = finals[0].kv_transfer_params if len(finals) == 1 else None
    return CompletionResponse(
        id=request_id,
        model=state.response_model(req.model),
        choices=choices,
        usage=usage.add_timing() if req.return_timing else usage,
        kv_transfer_params=kv,
    )


async def _stream(
    state: ServerState,
    req: CompletionRequest,
    request_id: str,
    streams,
    echoes: list[str],
    prompt_lens: list[int],
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous = usage_options(req)
    exclude = {"kv_transfer_params"} if include_usage else {"usage", "kv_transfer_params"}
    generated: dict[int, int] = {}  # choice index -> tokens so far

    def chunk(choice: CompletionChoice) -> str:
        usage = None
        if continuous:  # vLLM's continuous_usage_stats: the choice's own counts so far on every chunk
            usage = UsageInfo()
            usage.add(prompt_lens[choice.index // req.n], generated.get(choice.index, 0))
        body = CompletionResponse(
            id=request_id, created=created, model=state.response_model(req.model), choices=[choice], usage=usage
        )
        return event(body, exclude)

    offsets: dict[int, int] = {}
    pending: dict[int, list[int]] = {}  # return_token_ids: a choice's tokens not yet in a chunk

    def token_ids(index: int) -> list[int] | None:
        return pending.pop(index, []) if req.return_token_ids else None

    usage = UsageInfo()
    try:
        for i, echo in enumerate(echoes):
            for j in range(req.n):
                offsets[i * req.n + j] = len(echo)
                if echo:
                    yield chunk(CompletionChoice(index=i * req.n + j, text=echo))
        async for i, out in iterate(state.async_engine, streams):
            for c in out.outputs:
                index = i * req.n + c.index
                generated[index] = len(c.token_ids)
                if req.return_token_ids:
                    pending.setdefault(index, []).extend(c.delta_token_ids)
                if c.delta_text or (req.logprobs is not None and c.delta_logprobs):
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs, offsets[index] = completion_logprobs(
                            c.delta_logprobs or [], state.token_text, offsets[index]
                        )
                    yield chunk(
                        CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs, token_ids=token_ids(index))
                    )
                if c.finish_reason is not None:
                    yield chunk(
                        CompletionChoice(
                            index=index,
                            text="",
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=token_ids(index),
                        )
                    )
            if out.finished:
                usage.add_output(out)
        if include_usage:
            body = CompletionResponse(
                id=request_id,
                created=created,
                model=state.response_model(req.model),
                choices=[],
                usage=usage.add_timing() if req.return_timing else usage,
            )
            yield event(body, {"kv_transfer_params"})
    except Exception as e:  # the stream has begun: the error goes in-band, as vLLM sends it
        yield stream_error(e, request_id)
    yield DONE
