"""Chat templates: one function renders a conversation to prompt token ids, for `LLM.chat` and the server."""

from __future__ import annotations

from inferd.errors import InvalidRequestError


def render_chat(
    tokenizer,
    conversation: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Render `conversation` ({"role", "content"} dicts) with the model's template and tokenize it.

    The template writes BOS itself, so the text is tokenized without special tokens. Continuing the
    last message means no new assistant turn, so it turns `add_generation_prompt` off.
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
    except Exception as e:  # jinja raises for conversations the template rejects (e.g. roles out of turn)
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)
