"""OpenAI request fields -> SamplingParams; fields inferd cannot honour are refused, not ignored."""

from __future__ import annotations

from inferd.sampling import SamplingParams
from inferd.server.errors import APIError
from inferd.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def usage_options(req: SamplingFields) -> tuple[bool, bool]:
    """(usage chunk at the end, usage on every chunk) of a stream, as vLLM reads stream_options."""
    opts = req.stream_options
    return (bool(opts and opts.include_usage), bool(opts and opts.include_usage and opts.continuous_usage_stats))


def _check_stream_options(req: SamplingFields) -> None:
    opts = req.stream_options
    if opts is None:
        return
    if not req.stream:
        raise APIError(400, "stream_options needs stream=true", param="stream_options")
    if opts.continuous_usage_stats and not opts.include_usage:
        raise APIError(
            400,
            "stream_options.continuous_usage_stats needs include_usage=true (as in vLLM)",
            param="stream_options.continuous_usage_stats",
        )


def _common(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    _check_stream_options(req)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,  # SamplingParams takes a string, a list or None
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        kv_transfer_params=req.kv_transfer_params,
    )


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported", param="echo")
    return _common(req, req.max_tokens, req.logprobs)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tool calling is not supported", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(400, "only response_format type 'text' is supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _common(req, max_tokens, logprobs)
