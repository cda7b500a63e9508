"""Chat templates: one place renders a conversation to prompt text, for `LLM.chat`, the server, and the
gateway (which renders locally to predict the engine's prefix cache keys for chat requests)."""

from __future__ import annotations

from inferd.errors import InvalidRequestError

_MAX_QUOTED = 200  # characters of a template's own error message quoted back


def message_dict(
    role: str,
    content: str | list | None,
    name: str | None,
    index: int,
    tool_calls: list | None = None,
    tool_call_id: str | None = None,
) -> dict:
    """One OpenAI chat message as the template gets it: text parts joined by newlines, other parts refused;
    an assistant's `tool_calls` and a tool result's `tool_call_id` kept for `inferd.structured.tool_plan`."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}]: only text content parts are supported", param=f"messages.{index}.content"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    out = {"role": role, "content": content or ""}
    if name:
        out["name"] = name
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def messages_text(messages: list) -> str:
    """The text of chat messages (string contents and text parts) joined by newlines, read leniently: what is
    not text is skipped. What a router tokenizes for prefix affinity without the template, and what a token
    estimate counts; the template renders the real prompt (`chat_text`)."""
    parts = []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts.extend(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def chat_text(
    tokenizer,
    conversation: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """Render `conversation` ({"role", "content"} dicts) with the model's chat template.

    Continuing the last message means no new assistant turn, so it turns `add_generation_prompt` off.
    A conversation the template refuses (roles out of turn, say) is the request's fault: InvalidRequestError.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; send a plain prompt instead", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja raises for conversations the template rejects
        reason = str(e)[:_MAX_QUOTED]
        raise InvalidRequestError(f"the chat template rejected these messages: {reason}", param="messages") from None
    if not isinstance(text, str):  # template kwargs can ask it for other things than text
        raise InvalidRequestError("chat_template_kwargs must leave the template rendering text", param="messages")
    return text


def render_chat(tokenizer, conversation: list[dict], **options) -> list[int]:
    """`chat_text`, tokenized; the template writes BOS itself, so no special tokens are added."""
    return tokenizer.encode(chat_text(tokenizer, conversation, **options), add_special_tokens=False)
