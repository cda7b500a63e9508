"""POST /v1/chat/completions.

`resume` and `return_token_ids` as in completions (inferd/server/completions.py); a resumed stream starts
with the role chunk, as every stream does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferd.outputs import RequestOutput
from inferd.sampling import RESUMED_HEADER
from inferd.server.errors import stream_error
from inferd.server.logprobs import chat_logprobs
from inferd.server.params import chat_params, usage_options
from inferd.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from inferd.server.sse import DONE, SSEResponse, event
from inferd.server.state import ServerState, new_id
from inferd.server.streams import ClientDisconnected, final_outputs, iterate, submit_request, unless_disconnected
from inferd.structured.tool_plan import ToolPlan


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    lora_name = state.check_model(req.model)
    tools = state.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    params = chat_params(req, tools)
    prompt = await state.chat_prompt(
        req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs, tools=tools
    )
    request_id = new_id("chatcmpl")
    streams = await submit_request(state, raw, req, request_id, [prompt], params, lora_name)
    headers = {"X-Request-Id": request_id}
    if params.resume_token_ids:
        headers[RESUMED_HEADER] = str(len(params.resume_token_ids))
    if req.stream:
        body = _stream(state, req, tools, request_id, streams, len(prompt))
        return SSEResponse(body, on_close=lambda: state.async_engine.abort(request_id), headers=headers)
    try:
        (final,) = await unless_disconnected(raw, final_outputs(state.async_engine, streams))
    except ClientDisconnected:
        return Response(status_code=499)
    body = _response(state, req, tools, request_id, final)
    return JSONResponse(
        body.model_dump(exclude=None if body.kv_transfer_params else {"kv_transfer_params"}), headers=headers
    )


def _top_k(req: ChatCompletionRequest) -> int:
    return req.top_logprobs or 0


def _response(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan, request_id: str, out: RequestOutput
) -> ChatCompletionResponse:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        logprobs = chat_logprobs(c.logprobs or [], state.token_text, _top_k(req)) if req.logprobs else None
        content, calls, finish_reason = tools.message(c.text, c.finish_reason)
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=calls),
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            )
        )
    usage = UsageInfo()
    usage.add_output(out)
    return ChatCompletionResponse(
        id=request_id,
        model=state.response_model(req.model),
        choices=choices,
        usage=usage.add_timing() if req.return_timing else usage,
        kv_transfer_params=out.kv_transfer_params,
    )


async def _stream(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan, request_id: str, streams, prompt_len: int
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous = usage_options(req)
    exclude = None if include_usage else {"usage"}
    generated: dict[int, int] = {}  # choice index -> tokens so far

    def chunk(choice: ChatChunkChoice) -> str:
        usage = None
        if continuous:  # vLLM's continuous_usage_stats: the choice's own counts so far on every chunk
            usage = UsageInfo()
            usage.add(prompt_len, generated.get(choice.index, 0))
        body = ChatCompletionChunk(
            id=request_id, created=created, model=state.response_model(req.model), choices=[choice], usage=usage
        )
        return event(body, exclude)

    try:
        # the role comes first, in a delta of its own, for every choice (as OpenAI sends it)
        for index in range(req.n):
            yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        usage = UsageInfo()
        choice_streams = [tools.stream() for _ in range(req.n)]
        pending: dict[int, list[int]] = {}  # return_token_ids: a choice's tokens not yet in a chunk

        def token_ids(index: int) -> list[int] | None:
            return pending.pop(index, []) if req.return_token_ids else None

        async for _, out in iterate(state.async_engine, streams):
            for c in out.outputs:
                generated[c.index] = len(c.token_ids)
                if req.return_token_ids:
                    pending.setdefault(c.index, []).extend(c.delta_token_ids)
                reader = choice_streams[c.index]
                content, calls = reader.feed(c.delta_text or "")
                if c.finish_reason is not None:  # a call a parser can only close once the text has ended
                    rest, more = reader.finish()
                    content, calls = content + rest, calls + more
                if content or calls or (req.logprobs and c.delta_logprobs):
                    logprobs = (
                        chat_logprobs(c.delta_logprobs or [], state.token_text, _top_k(req)) if req.logprobs else None
                    )
                    delta = DeltaMessage(content=content or None, tool_calls=calls or None)
                    if not (content or calls):  # logprobs alone: OpenAI still sends the (empty) content
                        delta = DeltaMessage(content="")
                    yield chunk(
                        ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, token_ids=token_ids(c.index))
                    )
                if c.finish_reason is not None:
                    yield chunk(
                        ChatChunkChoice(
                            index=c.index,
                            delta=DeltaMessage(),
                            finish_reason=tools.finish_reason(c.finish_reason, reader.called),
                            stop_reason=c.stop_reason,
                            token_ids=token_ids(c.index),
                        )
                    )
            if out.finished:
                usage.add_output(out)
        if include_usage:
            body = ChatCompletionChunk(
                id=request_id,
                created=created,
                model=state.response_model(req.model),
                choices=[],
                usage=usage.add_timing() if req.return_timing else usage,
            )
            yield event(body)
    except Exception as e:  # the stream has begun: the error goes in-band, as vLLM sends it
        yield stream_error(e, request_id)
    yield DONE
