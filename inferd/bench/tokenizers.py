"""The tokenizer a benchmark measures prompts with: the server's own where it exposes one, else a local one.

Servers differ in how they expose it; we try, in order:
- vLLM and inferd: POST /tokenize {"model", "prompt", "add_special_tokens"} and POST /detokenize {"model", "tokens"}
- llama.cpp llama-server: POST /tokenize {"content", "add_special"} and POST /detokenize {"tokens"}
- llama-cpp-python: POST /extras/tokenize {"input"} and POST /extras/detokenize {"tokens"}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import httpx

from inferd.errors import InferdError

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def num_special_tokens(self) -> int:
        """Tokens the server adds around a prompt (a BOS, usually)."""
        ...


class LocalTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # missing folder, hub id offline: all need the same fix
            raise InferdError(f"cannot load tokenizer {path!r} ({type(e).__name__}); pass --tokenizer FOLDER") from e
        self.name = f"local:{path}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def num_special_tokens(self) -> int:
        with_special = self._tok.encode("a", add_special_tokens=True)
        return len(with_special) - len(self._tok.encode("a", add_special_tokens=False))


@dataclass(frozen=True)
class _Dialect:
    name: str
    encode_path: str
    decode_path: str
    encode_key: str  # where the text goes
    special_key: str | None  # the flag for special tokens, where the server has one
    decode_key: str  # where the text comes back
    sends_model: bool


_DIALECTS = (
    _Dialect("vllm", "/tokenize", "/detokenize", "prompt", "add_special_tokens", "prompt", True),
    _Dialect("llama.cpp", "/tokenize", "/detokenize", "content", "add_special", "content", False),
    _Dialect("llama-cpp-python", "/extras/tokenize", "/extras/detokenize", "input", None, "text", False),
)


class ServerTokenizer:
    """Synchronous calls: datasets are built before the run starts, so no timing is affected."""

    def __init__(self, http: httpx.Client, model: str, dialect: _Dialect):
        self._http, self._model, self._d = http, model, dialect
        self.name = f"server:{dialect.name}"

    def _encode(self, text: str, special: bool) -> list[int]:
        body: dict = {self._d.encode_key: text}
        if self._d.special_key:
            body[self._d.special_key] = special
        if self._d.sends_model:
            body["model"] = self._model
        resp = self._http.post(self._d.encode_path, json=body)
        resp.raise_for_status()
        tokens = resp.json()["tokens"]
        # llama.cpp may return [{"id": .., "piece": ..}] when asked for pieces; plain ids otherwise
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    def encode(self, text: str) -> list[int]:
        return self._encode(text, special=False)

    def decode(self, ids: list[int]) -> str:
        body: dict = {"tokens": ids}
        if self._d.sends_model:
            body["model"] = self._model
        resp = self._http.post(self._d.decode_path, json=body)
        resp.raise_for_status()
        return resp.json()[self._d.decode_key]

    def num_special_tokens(self) -> int:
        if not self._d.special_key:
            return 0
        try:
            return len(self._encode("a", special=True)) - len(self._encode("a", special=False))
        except (httpx.HTTPError, KeyError, ValueError):
            return 0


def probe_server_tokenizer(base_url: str, model: str, api_key: str | None = None) -> ServerTokenizer | None:
    """The first dialect whose encode and decode both work on this server, or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.Client(base_url=base_url, headers=headers, timeout=30.0)
    for dialect in _DIALECTS:
        tok = ServerTokenizer(http, model, dialect)
        try:
            ids = tok.encode("hello world")
            if ids and isinstance(tok.decode(ids), str):
                logger.info("using the server's tokenizer (%s API)", dialect.name)
                return tok
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            continue
    http.close()
    return None


def resolve_tokenizer(source: str, base_url: str, model: str, local_path: str | None, api_key: str | None) -> Tokenizer:
    """source: auto (server, then local), server, or local. Local falls back to --model when it is a folder."""
    if source in ("auto", "server"):
        tok = probe_server_tokenizer(base_url, model, api_key)
        if tok is not None:
            return tok
        if source == "server":
            raise InferdError(f"{base_url} exposes no /tokenize and /detokenize; use --tokenizer-source local")
    path = local_path or model
    if not path:
        raise InferdError("no tokenizer: the server has none to read; pass --tokenizer FOLDER")
    logger.info("using the local tokenizer %s", path)
    return LocalTokenizer(path)
