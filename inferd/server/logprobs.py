"""Engine logprobs -> OpenAI's two formats (legacy completions and chat)."""

from __future__ import annotations

import math
from collections.abc import Callable

from inferd.outputs import TokenLogprobs
from inferd.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_FLOOR = -9999.0  # JSON has no -inf; vLLM uses the same floor


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


def completion_logprobs(
    entries: list[TokenLogprobs], token_text: Callable[[int], str], offset: int
) -> tuple[CompletionLogprobs, int]:
    """Legacy format; `offset` is where the first token starts in the choice's text. Returns the next offset."""
    out = CompletionLogprobs()
    for e in entries:
        text = token_text(e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_lp(e.logprob))
        # the top-k alternatives, and always the sampled token (so up to k + 1 entries, as OpenAI documents)
        top = {token_text(t): _lp(lp) for t, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(entries: list[TokenLogprobs], token_text: Callable[[int], str], top_k: int) -> ChatLogprobs:
    content = []
    for e in entries:
        text = token_text(e.token_id)
        top = [_top(token_text(t), lp) for t, lp in e.top[:top_k]]
        content.append(
            ChatTokenLogprob(token=text, logprob=_lp(e.logprob), bytes=list(text.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def _top(text: str, lp: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=_lp(lp), bytes=list(text.encode()))
