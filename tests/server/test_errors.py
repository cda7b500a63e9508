"""Every bad input gets its status code and OpenAI's error body; none is a 500 and none leaves a request behind."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

CHAT = [{"role": "user", "content": "hi"}]
LONG = "The quick brown fox jumps over the lazy dog. " * 120  # far beyond max_model_len=512

CASES = [
    # (path, body (dict) or raw bytes, status, param)
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, 400, "n"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": [], "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100_000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, 400, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "temperature": -2}, 400, "temperature"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(server, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_no_request_left_behind(server):
    for path, body, *_ in CASES:
        if isinstance(body, dict):
            httpx.post(server.url + path, json=body)
    server.wait_idle()


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
