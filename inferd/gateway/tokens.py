"""Count a request's prompt tokens exactly, and get its token ids for prefix affinity.

Per pool, `tokenizer` says how: `replica` asks a replica's `/tokenize` (inferd and vLLM have it; it
applies the chat template, so chat prompts are exact too), a path loads a `tokenizer.json` with the
`tokenizers` library (no torch; exact for completion prompts, chat still asks a replica), and
`estimate` counts UTF-8 bytes / 4 without ids (for servers with no `/tokenize`: budgets are then
approximate and there is no prefix affinity). Token-id prompts need no tokenizer at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


@dataclass
class PromptTokens:
    count: int  # all prompts of the request together
    ids: list[int] | None  # the first prompt's ids, for prefix affinity; None if unknown
    exact: bool = True


def _estimate(text: str) -> int:
    return max(1, (len(text.encode("utf-8")) + 3) // 4)


def _prompt_items(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (str, [str], [int], [[int]]) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return prompt
    return []


def _chat_text(messages: list) -> str:
    parts = []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts.extend(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


class PoolTokenizer:
    def __init__(self, mode: str, client: httpx.AsyncClient, api_key: str | None = None):
        self.mode = mode
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.local = None
        if mode not in ("replica", "estimate"):
            from tokenizers import Tokenizer

            path = Path(mode)
            self.local = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    async def count(self, kind: str, body: dict, model: str, replica_url: str | None) -> PromptTokens:
        if kind == "chat":
            return await self._chat(body, model, replica_url)
        items = _prompt_items(body.get("prompt"))
        ids_list = [p if isinstance(p, list) else await self._encode(p, model, replica_url) for p in items]
        if any(ids is None for ids in ids_list):
            count = sum(len(p) if isinstance(p, list) else _estimate(p) for p in items)
            first = ids_list[0] if ids_list else None
            return PromptTokens(count, first, exact=False)
        return PromptTokens(sum(len(ids) for ids in ids_list), ids_list[0] if ids_list else None)

    async def _encode(self, text: str, model: str, replica_url: str | None) -> list[int] | None:
        if self.local is not None:
            return self.local.encode(text, add_special_tokens=True).ids
        if self.mode == "replica" and replica_url:
            return await self._ask(replica_url, {"model": model, "prompt": text})
        return None

    async def _chat(self, body: dict, model: str, replica_url: str | None) -> PromptTokens:
        messages = body.get("messages") or []
        if self.mode != "estimate" and replica_url:
            payload = {"model": model, "messages": messages}
            if "add_generation_prompt" in body:
                payload["add_generation_prompt"] = body["add_generation_prompt"]
            ids = await self._ask(replica_url, payload)
            if ids is not None:
                return PromptTokens(len(ids), ids)
        return PromptTokens(_estimate(_chat_text(messages)), None, exact=False)

    async def _ask(self, replica_url: str, payload: dict) -> list[int] | None:
        """A replica's /tokenize; None when it cannot answer (then the count is estimated)."""
        try:
            r = await self.client.post(f"{replica_url}/tokenize", json=payload, headers=self.headers, timeout=5.0)
        except httpx.HTTPError as e:
            logger.warning("tokenize on %s failed: %s", replica_url, e)
            return None
        if r.status_code != 200:
            return None
        tokens = r.json().get("tokens")
        return tokens if isinstance(tokens, list) else None
