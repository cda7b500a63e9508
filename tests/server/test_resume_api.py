"""`resume` and `return_token_ids` over HTTP: a stream's token ids per chunk, a resumed request that continues
it exactly, and a 400 with an OpenAI error body for every resume the server cannot honour."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_hardening import assert_error

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7, 8, 9]
SEEDED = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 9, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _events(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def _stream(client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return _events(r.text)


def test_a_stream_carries_its_token_ids_per_chunk(client):
    whole = client.post("/v1/completions", json={**SEEDED, "return_token_ids": True}).json()["choices"][0]
    events = _stream(client, "/v1/completions", {**SEEDED, "return_token_ids": True})
    ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert ids == whole["token_ids"] and len(ids) == 24
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["text"]
    plain = _stream(client, "/v1/completions", SEEDED)  # not asked: no field at all
    assert all("token_ids" not in c for e in plain for c in e["choices"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 9}], ids=["greedy", "seeded"])
def test_a_resumed_stream_continues_exactly(client, path, sampling):
    body = {**SEEDED, **sampling, "return_token_ids": True}
    if path.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    events = _stream(client, path, body)
    chunks = [c for e in events for c in e["choices"] if c.get("token_ids")]
    cut = len(chunks) // 2
    sent = [t for c in chunks[:cut] for t in c["token_ids"]]
    r = client.post(path, json={**body, "stream": True, "resume": {"token_ids": [sent]}})
    assert r.status_code == 200 and r.headers["x-inferd-resumed"] == str(len(sent))
    rest = _events(r.text)
    assert [c for e in rest for c in e["choices"] if c.get("token_ids")] == chunks[cut:]
    # not streamed: the tokens after the resumed ones, and usage counts only them
    r = client.post(path, json={**body, "resume": {"token_ids": [sent]}})
    assert r.json()["choices"][0]["token_ids"] == [t for c in chunks[cut:] for t in c["token_ids"]]
    assert r.json()["usage"]["completion_tokens"] == 24 - len(sent)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"resume": {"token_ids": [[1, 2]]}, "n": 2}, "resume"),
        ({"resume": {"token_ids": [[1], [2]]}}, "resume.token_ids"),
        ({"resume": {"token_ids": [[]]}}, "resume.token_ids.0"),
        ({"resume": {"token_ids": []}}, "resume.token_ids"),
        ({"resume": {"token_ids": [[1, -3]]}}, "resume.token_ids.0.1"),
        ({"resume": {"token_ids": [[1]], "text": "x"}}, "resume.text"),
        ({"resume": [1, 2]}, "resume"),
        ({"resume": {"token_ids": [[10**6]]}}, "resume"),
        ({"resume": {"token_ids": [[1] * 24]}}, "resume"),
        ({"resume": {"token_ids": [[1]]}, "prompt": [PROMPT, PROMPT]}, "resume"),
    ],
    ids=[
        "n2",
        "two-lists",
        "empty-list",
        "no-lists",
        "negative",
        "unknown-key",
        "not-an-object",
        "vocab",
        "max",
        "two-prompts",
    ],  # fmt: skip
)
def test_a_resume_the_server_cannot_honour_is_a_400(client, extra, param):
    assert_error(client.post("/v1/completions", json={**SEEDED, **extra}), 400, param)


def test_resume_with_tools_is_a_400_naming_why(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    error = assert_error(client.post("/v1/chat/completions", json={**body, "resume": {"token_ids": [[1]]}}), 400)
    assert error["param"] == "resume" and "tool" in error["message"]
