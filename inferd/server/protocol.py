"""OpenAI API request and response bodies (plus vLLM's extra sampling fields), as pydantic models.

The fields carry their types, ranges and enums, so the OpenAPI schema the server publishes is the contract
clients (and the fuzzer in tests/server/test_fuzz.py) are held to. Rules that need the model or the
tokenizer (context length, vocabulary size) are checked later, with the same 400 error body.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer
from pydantic.json_schema import SkipJsonSchema

from inferd.outputs import RequestMetrics, RequestTiming
from inferd.prompts import INT64_MAX, INT64_MIN, Prompt, TokenId

MAX_N = 128  # each of n is a sequence in the batch; more than this is a mistake, not a workload
MAX_LOGPROBS = 20

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Request(BaseModel):
    # unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working;
    # JSON has no Infinity or NaN, and a number too large for a double is no number either
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    #: usage on every chunk, as vLLM sends it (needs include_usage)
    continuous_usage_stats: bool = False


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of the constraint fields."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    structural_tag: str | None = Field(None, min_length=1)
    #: false: JSON may take any whitespace between tokens (default: compact)
    disable_any_whitespace: bool | None = None


class Resume(_Request):
    """inferd's `resume`: continue a stream that another replica began and that broke (docs/server.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a misspelt key must not pass as no resume
    #: the token ids already sent to the client, one list per choice (n=1: one list)
    token_ids: list[Annotated[list[TokenId], Field(min_length=1)]] = Field(min_length=1)


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra fields
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    #: the request's class under `--scheduling-policy priority` (lower first); other than 0 a 400 under fcfs
    priority: Int64 = 0
    #: inferd's: where the request's time went (queue, prefill, decode, chunks, preemptions, cached and loaded
    #: KV), in `usage.timing` (a stream's usage chunk: stream_options.include_usage)
    return_timing: bool = False
    #: under `--scheduling-policy deadline`: the first token is due this many ms after arrival (earliest first)
    ttft_deadline_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    #: inferd's: the tokens a broken stream already sent; they become the output's first tokens (max_tokens,
    #: min_tokens, stops and penalties count them) and only the tokens after them come back
    resume: Resume | None = None
    #: vLLM's: each choice carries its token ids (`token_ids`; in a stream, those of the chunk's text)
    return_token_ids: bool = False

    @property
    def ttft_deadline(self) -> float | None:
        return None if self.ttft_deadline_ms is None else self.ttft_deadline_ms / 1000

    #: disaggregated prefill/decode (docs/disaggregation.md), as vLLM names it
    kv_transfer_params: dict[str, Any] | None = None
    # structured outputs (docs/structured.md): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* names (accepted, left out of the published schema as vLLM deprecates them);
    # inferd.structured.spec reads whichever is set (more than one is a 400)
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SkipJsonSchema[dict[str, Any] | bool | str | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[list[str] | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None
    guided_json_object: SkipJsonSchema[bool | None] = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: an assistant turn's calls, and a tool turn's answer to one (docs/structured.md)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    #: a chat's tools, rendered as /v1/chat/completions renders them (as vLLM's /tokenize takes them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    #: replace the weights of an adapter already served under this name (vLLM's flag)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)


# -- responses ---------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # as OpenAI's: prompt tokens served from the prefix cache (for a final usage; per-chunk counts leave it out)
    # (both appear where they were asked for, never as null)
    prompt_tokens_details: PromptTokensDetails | None = Field(None, exclude_if=lambda v: v is None)
    timing: RequestTiming | None = Field(None, exclude_if=lambda v: v is None)  # with `return_timing`
    _metrics: list = PrivateAttr(default_factory=list)  # the finished requests' RequestMetrics

    def add(self, prompt: int, completion: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens = self.prompt_tokens + self.completion_tokens

    def add_output(self, out) -> None:
        """A finished request's counts (a RequestOutput): its prompt, every choice's tokens, its cached prompt."""
        self.add(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        details = self.prompt_tokens_details or PromptTokensDetails()
        details.cached_tokens += out.metrics.num_cached_tokens if out.metrics is not None else 0
        self.prompt_tokens_details = details
        if out.metrics is not None:
            self._metrics.append(out.metrics)

    def add_timing(self) -> UsageInfo:
        """Say where the time of the requests added went (`return_timing`)."""
        if self._metrics:
            self.timing = RequestMetrics.merge(self._metrics).timing()
        return self


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # with `return_token_ids`


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # with `return_token_ids`


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        # OpenAI leaves absent fields out of a delta: {"role": ..., "content": ""} first, then {"content": ...}, then {}
        fields = (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
        return {k: v for k, v in fields if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # with `return_token_ids`


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "inferd"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)
    max_model_len: int | None = None
    dtype: str | None = None  # what the engine runs in (after --dtype auto)
    quantization: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class KVEventsInfo(BaseModel):
    """`GET /kv_events`: where this replica publishes its KV cache events and how its block keys are made."""

    enabled: bool
    publisher: str | None = None
    endpoint: str | None = Field(None, description="the PUB socket's address (a wildcard host: this server's)")
    replay_endpoint: str | None = None
    topic: str | None = None
    block_size: int
    medium: str | None = None
    hash: str = Field(description="how a block key is computed (inferd.prefix_hash)")
    hash_root: str = Field(description="the first block's parent")
    sequence: int | None = Field(None, description="the last batch sent")
    sent: int = 0
    dropped: int = 0
    replays: int = 0


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "draining", "error"]
    error: str | None = None
