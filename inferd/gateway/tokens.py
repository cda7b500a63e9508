"""Count a request's prompt tokens exactly, and get its token ids for prefix affinity.

Per pool, `tokenizer` says how:
- a model folder (with `tokenizer.json`, and `tokenizer_config.json` or `chat_template.jinja`): loaded
  with transformers' tokenizer classes, as the server loads it (no torch). Completion prompts and chat
  messages are both tokenized here: chats are rendered with the server's own renderer
  (`inferd.chat.chat_text`, the same template, options and message rules), so the ids, and the prefix
  cache keys the gateway hashes from them, are the engine's, without a request to a replica;
- a `tokenizer.json` file: the `tokenizers` library; exact for completion prompts, chat asks a replica;
- `replica`: a replica's `/tokenize` (inferd and vLLM have it; it renders chat templates too);
- `estimate`: UTF-8 bytes / 4 without ids (servers with no `/tokenize`: budgets are then approximate and
  there is no prefix affinity).
Token-id prompts need no tokenizer at all. A chat the local template cannot render (a message the
server would refuse) falls back to the replica or the estimate: the replica, not the gateway, refuses it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from inferd.chat import chat_text, message_dict, messages_text
from inferd.prompts import INT64_MAX, prompt_items
from inferd.structured.tool_plan import tool_plan

logger = logging.getLogger(__name__)

# text longer than this is tokenized (and chats rendered) on a worker thread, off the event loop
THREAD_CHARS = 16384


@dataclass
class PromptTokens:
    count: int  # all prompts of the request together
    ids: list[int] | None  # the first prompt's ids, for prefix affinity; None if unknown
    exact: bool = True


def _estimate(text: str) -> int:
    return max(1, (len(text.encode("utf-8")) + 3) // 4)


def _token_ids(value) -> bool:
    """Whether a server's /tokenize answer is token ids the prefix keys can hash (any other server may answer)."""
    return isinstance(value, list) and all(type(t) is int and 0 <= t <= INT64_MAX for t in value)


class LocalChat:
    """The model folder's transformers tokenizer: chat rendering and tokenization as the server does them."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.backend = self.tokenizer.backend_tokenizer  # with transformers' special-token settings applied

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def chat_ids(self, body: dict) -> list[int] | None:
        """The ids the server computes for this chat request; None where it would refuse the request
        (the replica answers it then)."""
        options = {k: body[k] for k in ("add_generation_prompt", "continue_final_message") if k in body}
        kwargs = body.get("chat_template_kwargs")
        if any(not isinstance(v, bool) for v in options.values()) or not isinstance(kwargs, dict | None):
            return None
        try:
            conversation = [_message(m, i) for i, m in enumerate(body["messages"])]
            # tools reach the template (or a system prompt) as the server puts them there
            plan = tool_plan(body.get("tools"), body.get("tool_choice"), None, self.tokenizer, "")
            conversation, tool_kwargs = plan.conversation(conversation)
            kwargs = {**tool_kwargs, **(kwargs or {})}
            text = chat_text(self.tokenizer, conversation, template_kwargs=kwargs, **options)
        except Exception:  # InvalidRequestError, or a message of the wrong shape
            return None
        return self.encode(text, add_special_tokens=False)


def _message(m: dict, i: int) -> dict:
    role, content, name = m.get("role"), m.get("content"), m.get("name")
    calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
    if not isinstance(role, str) or not isinstance(content, str | list | None) or not isinstance(name, str | None):
        raise ValueError("not a message the server reads")
    if not isinstance(calls, list | None) or not isinstance(call_id, str | None):
        raise ValueError("not a message the server reads")
    return message_dict(role, content, name, i, calls, call_id)


def _load(mode: str) -> tuple[object | None, LocalChat | None]:
    """(a `tokenizers.Tokenizer` for a bare tokenizer.json, or a LocalChat for a model folder)."""
    path = Path(mode)
    if path.is_dir():
        try:
            return None, LocalChat(path)
        except Exception as e:  # no tokenizer_config: the bare tokenizer.json still counts completions
            logger.warning("%s: no chat template loaded (%s); chat prompts ask a replica", path, e)
            path = path / "tokenizer.json"
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)), None


class PoolTokenizer:
    def __init__(self, mode: str, client: httpx.AsyncClient, api_key: str | None = None):
        self.mode = mode
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.local, self.chat = (None, None) if mode in ("replica", "estimate") else _load(mode)

    async def count(self, kind: str, body: dict, model: str, replica_url: str | None) -> PromptTokens:
        if kind == "chat":
            return await self._chat(body, model, replica_url)
        items = prompt_items(body["prompt"])  # checked by `inferd.prompts.check_prompt`
        ids_list = [p if isinstance(p, list) else await self._encode(p, model, replica_url) for p in items]
        if any(ids is None for ids in ids_list):
            count = sum(len(p) if isinstance(p, list) else _estimate(p) for p in items)
            first = ids_list[0] if ids_list else None
            return PromptTokens(count, first, exact=False)
        return PromptTokens(sum(len(ids) for ids in ids_list), ids_list[0] if ids_list else None)

    async def _encode(self, text: str, model: str, replica_url: str | None) -> list[int] | None:
        encode = self.chat.encode if self.chat is not None else None
        if encode is None and self.local is not None:
            encode = lambda t: self.local.encode(t, add_special_tokens=True).ids  # noqa: E731
        if encode is not None:
            return await asyncio.to_thread(encode, text) if len(text) > THREAD_CHARS else encode(text)
        if self.mode == "replica" and replica_url:
            return await self._ask(replica_url, {"model": model, "prompt": text})
        return None

    async def _chat(self, body: dict, model: str, replica_url: str | None) -> PromptTokens:
        messages = body.get("messages") or []
        if self.chat is not None:
            big = len(messages_text(messages)) > THREAD_CHARS
            ids = await asyncio.to_thread(self.chat.chat_ids, body) if big else self.chat.chat_ids(body)
            if ids is not None:
                return PromptTokens(len(ids), ids)
        if self.mode != "estimate" and replica_url:
            payload = {"model": model, "messages": messages}
            for key in ("add_generation_prompt", "tools", "tool_choice"):
                if key in body:
                    payload[key] = body[key]
            ids = await self._ask(replica_url, payload)
            if ids is not None:
                return PromptTokens(len(ids), ids)
        return PromptTokens(_estimate(messages_text(messages)), None, exact=False)

    async def _ask(self, replica_url: str, payload: dict) -> list[int] | None:
        """A replica's /tokenize; None when it cannot answer (then the count is estimated)."""
        try:
            r = await self.client.post(f"{replica_url}/tokenize", json=payload, headers=self.headers, timeout=5.0)
        except httpx.HTTPError as e:
            logger.warning("tokenize on %s failed: %s", replica_url, e)
            return None
        if r.status_code != 200:
            return None
        try:
            tokens = r.json().get("tokens")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return None
        return tokens if _token_ids(tokens) else None
