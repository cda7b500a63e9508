"""What every handler needs: the engine, the tokenizer, the served names, the metrics, the limits.

Tokenizing and rendering chat templates can take a while for long inputs, so they run on a worker thread
(the tokenizer releases the GIL) and the event loop keeps serving /health and running streams meanwhile.
Text longer than `max_prompt_chars` is refused before any of that: it could never fit the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from inferd.chat import chat_text, message_dict
from inferd.engine.async_engine import AsyncEngine
from inferd.errors import ConfigError, DrainTimeoutError, InvalidRequestError
from inferd.sampling import SamplingParams
from inferd.server.errors import APIError, model_not_found
from inferd.server.metrics import ServerMetrics
from inferd.server.protocol import ChatMessage
from inferd.structured.tool_plan import TOOL_PARSERS, ToolPlan, tool_plan
from inferd.tracing import RequestTracer, TraceStart

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY = 2 << 20  # a token-id list this long parses in ~30 ms
_THREAD_CHARS = 2048  # shorter texts tokenize in microseconds: a thread hop would cost more than it saves


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    #: most sequences (prompts x n) waiting for the batch; beyond it 503, and a request with more is a 400
    max_waiting_requests: int = 0
    #: what /v1/models shows as `root`: a model name, never a local path (see public_root)
    model_root: str | None = None
    #: bytes; a larger body gets 413 before it is read (0: no limit)
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    #: characters of one prompt (or rendered chat); None: max_model_len x the tokenizer's longest token
    max_prompt_chars: int | None = None
    #: seconds after SIGTERM when streams still running are ended with an error event (None: never)
    drain_timeout: float | None = None
    #: upper bounds (seconds) of the TTFT and ITL histograms; None: vLLM's
    ttft_buckets: list[float] | None = None
    itl_buckets: list[float] | None = None
    #: "vllm": /metrics also exposes every metric under vLLM's `vllm:` names (see vllm_metrics.py)
    metrics_names: str = "inferd"
    #: serve /dashboard and record the engine's step events for it (docs/dashboard.md)
    dashboard: bool = True
    #: how tool_choice "auto" reads calls out of the text (inferd.structured.tool_plan.TOOL_PARSERS)
    tool_call_parser: str = "auto"
    #: an OTLP/HTTP collector: a span per request, parented on its traceparent (inferd/tracing.py); None: off
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        # the server's setting, checked once at start-up: a request never meets an unknown parser
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, not {self.tool_call_parser!r}"
            )


def public_root(model: str | None) -> str | None:
    """The model as /v1/models may show it: an alias or hub id as given, a local path by its last part only."""
    if not model:
        return None
    path = Path(model).expanduser()
    if path.is_absolute() or model.startswith((".", "~")) or path.exists():
        return path.name or None
    return model


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more text, so a prompt of more than
    max_model_len times this many characters can never fit the context."""
    try:
        return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    except Exception:  # a tokenizer without a vocabulary to list: no cap from it
        logger.warning("cannot list the tokenizer's vocabulary; prompts are not capped by length")
        return 0


@dataclass
class ServerState:
    async_engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    tokenizer: Any  # the engine's Hugging Face tokenizer
    max_model_len: int
    vocab_size: int
    model_type: str = ""  # the Hugging Face model_type: which format tool calls are written in
    ready: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app, once it runs
    tracer: RequestTracer | None = None  # with otlp_traces_endpoint
    _token_text: object = field(init=False, repr=False)
    _draining: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        # a token's text is asked for again and again in logprobs; the vocabulary bounds the cache
        self._token_text = lru_cache(maxsize=1 << 16)(self._decode_one)
        if self.settings.max_prompt_chars is None:
            self.settings.max_prompt_chars = self.max_model_len * longest_token_chars(self.tokenizer)

    def begin_drain(self) -> None:
        """On SIGTERM: take no new requests; streams still running at the drain deadline end with an error
        event (so they close cleanly before uvicorn would cancel them). Safe from a signal handler or thread."""
        self.async_engine.start_drain()
        timeout = self.settings.drain_timeout
        if self._draining or timeout is None or self.loop is None:
            return
        self._draining = True
        # just before uvicorn's own deadline (which starts a little after the signal, see docs/hardening.md)
        cut_after = max(timeout - 0.5, timeout * 0.75)
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing is left to cut
            self.loop.call_soon_threadsafe(self.loop.call_later, cut_after, self._cut_streams, timeout)

    def _cut_streams(self, timeout: float) -> None:
        error = DrainTimeoutError(f"the server shut down; this request outlived the drain timeout ({timeout:g} s)")
        cut = self.async_engine.fail_all(error)  # each stream logs its own line as it sends the error event
        if cut:
            logger.info("drain timeout: ending %d engine requests still running", len(cut))

    def trace(self, headers: Mapping[str, str], params: SamplingParams) -> TraceStart | None:
        """How a request's spans start (its trace context and vLLM's request attributes); None without tracing."""
        if self.tracer is None:
            return None
        attributes = {
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.n": params.n,
        }
        return TraceStart(self.tracer, headers, {k: v for k, v in attributes.items() if v is not None})

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name not served."""
        if name is None or name in self.settings.served_model_names:
            return None
        if self.adapter(name) is not None:
            return name
        raise model_not_found(name, self.model_name)

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the LoRA adapter the request asked for, else the served model."""
        return name if name is not None and name not in self.settings.served_model_names else self.model_name

    def adapter(self, name: str):
        """The LoRA adapter served as `name` now (a `LoRAAdapter`), or None. It is read from the step thread's
        registry, whose dict changes entry by entry there; a name removed between this check and the request
        is a 404 from the engine."""
        lora = self.async_engine.engine.lora
        return lora.adapters.get(name) if lora is not None else None

    def adapter_names(self) -> list[str]:
        lora = self.async_engine.engine.lora
        return sorted(lora.adapters) if lora is not None else []

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_length(self, text: str, param: str = "prompt") -> None:
        limit = self.settings.max_prompt_chars
        if limit and len(text) > limit:
            raise APIError(
                400,
                f"the prompt has {len(text)} characters; this server takes at most {limit} "
                f"(max_model_len {self.max_model_len} times the longest token; --max-prompt-chars)",
                param=param,
                code="prompt_too_long",
            )

    def check_prompt_tokens(self, token_ids: list[int], param: str = "prompt") -> None:
        """The engine's own length check, done here too so that a long prompt is refused before it is copied
        to the engine (whose step thread would hold the GIL while it looks through it)."""
        if len(token_ids) >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(token_ids)} tokens but the context is {self.max_model_len} tokens and must "
                "leave room for at least one output token; shorten the prompt or raise --max-model-len",
                param=param,
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_length(text, param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # the tokenizer refuses text it cannot read: that is the input's fault
            raise APIError(400, f"the tokenizer cannot read this text: {type(e).__name__}", param=param) from None

    async def encode_async(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """encode, on a worker thread when the text is long."""
        self.check_length(text, param)
        if len(text) < _THREAD_CHARS:
            return self.encode(text, add_special_tokens, param)
        return await asyncio.to_thread(self.encode, text, add_special_tokens, param)

    def decode(self, token_ids: list[int]) -> str:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return self.tokenizer.decode(token_ids)

    async def decode_async(self, token_ids: list[int]) -> str:
        if len(token_ids) < _THREAD_CHARS:
            return self.decode(token_ids)
        return await asyncio.to_thread(self.decode, token_ids)

    def tool_plan(self, tools=None, tool_choice=None, parallel_tool_calls: bool | None = None) -> ToolPlan:
        """A chat request's tools as this model's template and tool call format take them."""
        return tool_plan(
            tools, tool_choice, parallel_tool_calls, self.tokenizer, self.model_type, self.settings.tool_call_parser
        )

    async def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        tools: ToolPlan | None = None,
    ) -> list[int]:
        """Render the conversation with the model's template (`inferd.chat`) and tokenize it; `tools` says
        how tool definitions, calls and results reach the template (no tools: calls and results in history)."""
        conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
        # the template only adds text: contents already too long need no rendering to be refused
        self.check_length("".join(m["content"] for m in conversation), "messages")
        conversation, tool_kwargs = (tools or self.tool_plan()).conversation(conversation)
        kwargs = {**tool_kwargs, **(kwargs or {})}
        render = functools.partial(
            chat_text, self.tokenizer, conversation, add_generation_prompt, continue_final_message, kwargs
        )
        big = sum(len(m.get("content") or "") for m in conversation) >= _THREAD_CHARS
        text = await asyncio.to_thread(render) if big else render()
        return await self.encode_async(text, add_special_tokens=False, param="messages")

    async def chat_prompt(self, messages: list[ChatMessage], *args, **kwargs) -> list[int]:
        """apply_chat_template, refused here already when it cannot fit the context."""
        ids = await self.apply_chat_template(messages, *args, **kwargs)
        self.check_prompt_tokens(ids, "messages")
        return ids


def _message_dict(m: ChatMessage, i: int) -> dict:
    return message_dict(m.role, m.content, m.name, i, m.tool_calls, m.tool_call_id)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
