"""OpenAI request fields -> SamplingParams; fields inferd cannot honour are refused, not ignored."""

from __future__ import annotations

from inferd.sampling import SamplingParams
from inferd.server.errors import APIError
from inferd.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from inferd.structured.spec import Constraint, constraint_from_request
from inferd.structured.tool_plan import ToolPlan


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


def _constraint(req: SamplingFields) -> Constraint | None:
    """The output constraint of response_format, structured_outputs or the guided_* fields (one at most)."""
    return constraint_from_request(
        req.response_format,
        req.structured_outputs.model_dump(exclude_none=True, by_alias=True) if req.structured_outputs else None,
        guided_json=req.guided_json,
        guided_regex=req.guided_regex,
        guided_choice=req.guided_choice,
        guided_grammar=req.guided_grammar,
        guided_json_object=req.guided_json_object,
    )


def resume_token_ids(req: SamplingFields) -> list[int] | None:
    """The token ids `resume` says were sent (n=1: one choice's), checked against the request's shape."""
    if req.resume is None:
        return None
    if req.n != 1:
        raise APIError(400, f"resume continues one choice: it needs n=1, got n={req.n}", param="resume")
    if len(req.resume.token_ids) != 1:
        raise APIError(
            400,
            f"resume.token_ids holds one list of token ids per choice: 1 for n=1, got {len(req.resume.token_ids)}",
            param="resume.token_ids",
        )
    return list(req.resume.token_ids[0])


def _common(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, structured: Constraint | None
) -> SamplingParams:
    _check_stream_options(req)
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
        structured=structured,
        logit_bias=req.logit_bias or None,
        resume_token_ids=resume_token_ids(req),
    )


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported", param="echo")
    return _common(req, req.max_tokens, req.logprobs, _constraint(req))


def chat_params(req: ChatCompletionRequest, tools: ToolPlan) -> SamplingParams:
    """`tools`: the request's tool plan, whose "required" or named choice is a constraint of its own."""
    structured, forced = _constraint(req), tools.constraint()
    if structured is not None and forced is not None:
        raise APIError(
            400,
            f"tool_choice {tools.mode!r} and {structured.param} each constrain the output; send only one",
            param="tool_choice",
        )
    if req.resume is not None and tools.mode != "none":
        raise APIError(
            400,
            "resume cannot continue a request with tools: the tool-call reader's state over the text already sent "
            "is not replayed; send it without resume",
            param="resume",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _common(req, max_tokens, logprobs, structured or forced)
    if tools.needs_special_tokens:
        params.skip_special_tokens = False
    return params
