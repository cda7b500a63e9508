"""What every handler needs: the engine, the tokenizer, the served names, the metrics."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from inferd.engine.async_engine import AsyncEngine
from inferd.errors import InvalidRequestError
from inferd.server.errors import APIError, model_not_found
from inferd.server.metrics import ServerMetrics
from inferd.server.protocol import ChatMessage


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_waiting_requests: int = 0
    model_root: str | None = None


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    ready: bool = False
    _token_text: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # a token's text is asked for again and again in logprobs; the vocabulary bounds the cache
        self._token_text = lru_cache(maxsize=1 << 16)(self._decode_one)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise model_not_found(name, self.model_name)

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        vocab = self.engine.engine.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return self.tokenizer.decode(token_ids)

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
    ) -> list[int]:
        """Render the conversation with the model's template and tokenize it (the template adds BOS)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing the last message means no new assistant turn
        conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(kwargs or {}),
            )
        except Exception as e:  # jinja raises for conversations the template rejects (e.g. roles out of turn)
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        return self.encode(text, add_special_tokens=False)


def _message_dict(m: ChatMessage, i: int) -> dict:
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, f"messages[{i}]: only text content parts are supported", param=f"messages.{i}.content"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    out = {"role": m.role, "content": content or ""}
    if m.name:
        out["name"] = m.name
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
