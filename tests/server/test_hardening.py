"""The hardening contract (docs/hardening.md), row by row: each kind of bad input (and each drain or auth
edge) gets its 4xx, with OpenAI's error body, on a keep-alive connection that goes on serving, and leaves no
request behind."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from inferd.errors import InvalidRequestError
from inferd.sampling import SamplingParams
from inferd.server.state import public_root
from tests.server.conftest import MODEL_NAME, start_server

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "hi"}]
OK = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}


def post_raw(client: httpx.Client, path: str, body: dict | str) -> httpx.Response:
    """`body` as JSON the way Python writes it: NaN and Infinity bare, lone surrogates as \\ud800 escapes."""
    text = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def client_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# -- row 1: seeds outside int64 ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**70), 2**63, -(2**63) - 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_seed_out_of_int64_is_400_and_the_connection_lives(server, client, seed, path, stream):
    body = {"seed": seed, "n": 2, "stream": stream, "max_tokens": 2}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    first = assert_error(post_raw(client, path, body), 400, "seed")
    assert "seed" in first["message"]
    again = client.post("/v1/completions", json=OK)  # the same keep-alive connection serves on
    assert again.status_code == 200
    server.wait_idle()


def test_seed_at_the_int64_edges_with_n_copies(server, client):
    for seed in (2**63 - 1, -(2**63)):  # copy i takes seed + i: past int64 for the top seed, still a torch seed
        r = client.post("/v1/completions", json={**OK, "seed": seed, "n": 3, "temperature": 1.0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    server.wait_idle()


def test_sampling_params_refuse_seeds_torch_cannot_take():
    for seed in (2**64, -(2**63) - 1, 2**70):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(seed=seed)
        assert e.value.param == "seed"


def test_engine_registers_no_copy_when_one_fails(tiny_models):
    """The offline path takes seeds up to torch's 2**64 - 1: the second copy's seed then overflows, and the
    engine must refuse the request whole, leaving no first copy behind."""
    from inferd.engine.engine import LLM

    llm = LLM(str(tiny_models["llama"]), max_model_len=128, kv_cache_memory=8 << 20, num_threads=1)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(n=3, seed=2**64 - 2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_idle()
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(n=2, seed=2**64 - 2, max_tokens=2))
    assert len(out.outputs) == 2  # both copies' seeds fit


# -- row 2: lone surrogates --------------------------------------------------------------------------------
SURROGATE_BODIES = [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt.1"),
    ("/v1/completions", {"prompt": PROMPT, "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["\udc00"]}, "stop.0"),
    ("/v1/completions", {"prompt": PROMPT, "unknown_field": {"\ud800": 1}}, "unknown_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "messages.0.content.0.text",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "\udbff"}, "model"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "x", "model": "\ud800"}, "model"),
    ("/detokenize", {"tokens": [1], "model": "\ud800"}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES, ids=[b[2] for b in SURROGATE_BODIES])
def test_lone_surrogate_is_400(server, client, path, body, param):
    assert_error(post_raw(client, path, body), 400, param)
    assert client.post("/v1/completions", json=OK).status_code == 200


def test_surrogate_pairs_are_text(client):
    r = post_raw(client, "/v1/completions", {**OK, "prompt": "smile \U0001f642"})  # written as \\ud83d\\ude42
    assert r.status_code == 200, r.text
    assert client.post("/tokenize", json={"prompt": "\U0001f642"}).json()["count"] >= 1


def test_bad_utf8_and_surrogates_in_paths_never_500(client):
    bad = b'{"prompt": "\xed\xa0\x80"}'  # a surrogate in (CESU-style) raw UTF-8: not UTF-8 at all
    r = client.post("/v1/completions", content=bad, headers={"Content-Type": "application/json"})
    assert_error(r, 400)
    r = client.get("/v1/models/%ED%A0%80")
    assert_error(r, 404, "model")
    r = client.get("/v1/models/" + "x" * 5000)
    assert len(assert_error(r, 404, "model")["message"]) < 400  # input is quoted short


# -- row 4: non-finite numbers -----------------------------------------------------------------------------
NON_FINITE = ["Infinity", "-Infinity", "NaN", "1e309", "-1e309", "1" + "0" * 400 + ".0"]
FIELDS = [
    ("/v1/completions", "temperature"),
    ("/v1/completions", "top_p"),
    ("/v1/completions", "presence_penalty"),
    ("/v1/completions", "max_tokens"),
    ("/v1/completions", "seed"),
    ("/v1/completions", "whatever_unknown"),
    ("/v1/chat/completions", "repetition_penalty"),
    ("/v1/chat/completions", "min_p"),
    ("/tokenize", "add_special_tokens"),
]


@pytest.mark.parametrize("number", NON_FINITE)
@pytest.mark.parametrize(("path", "field"), FIELDS, ids=[f"{p}-{f}" for p, f in FIELDS])
def test_non_finite_numbers_are_400(client, path, field, number):
    body = {"prompt": PROMPT} if path != "/v1/chat/completions" else {"messages": CHAT}
    text = json.dumps(body)[:-1] + f', "{field}": {number}}}'
    assert_error(post_raw(client, path, text), 400, field)


def test_non_finite_inside_nested_values(client):
    text = '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": [1, NaN]}}'
    assert_error(post_raw(client, "/v1/chat/completions", text), 400, "chat_template_kwargs.a.1")
    text = '{"prompt": "x", "logit_bias": {"5": -Infinity}}'
    assert_error(post_raw(client, "/v1/completions", text), 400, "logit_bias.5")


# -- row 3: huge bodies and prompts ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_huge_body_is_413_at_once(server, client):
    t0 = time.monotonic()
    r = post_raw(client, "/v1/completions", {"prompt": "x" * (20 << 20)})
    assert_error(r, 413, code="request_too_large")
    assert "--max-request-body" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5  # the 20 MB travel over loopback; nothing of them is parsed

    def chunked():  # no Content-Length: the cap applies as the body arrives
        for _ in range(20):
            yield b"x" * (1 << 20)

    r = client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    assert client.post("/v1/completions", json=OK).status_code == 200
    server.wait_idle()


def test_prompt_longer_than_any_context_is_refused_untokenized(server, client, monkeypatch):
    limit = server.state.settings.max_prompt_chars
    longest = max(len(t) for t in server.engine.tokenizer.get_vocab())
    assert limit == server.engine.max_model_len * longest
    calls = []
    monkeypatch.setattr(server.state, "encode", lambda *a, **k: calls.append(a) or [])  # must not be reached
    for path, body, param in [
        ("/v1/completions", {"prompt": "y" * (limit + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "y" * (limit + 1)]}, "prompt.1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * (limit + 1)}]}, "messages"),
        ("/tokenize", {"prompt": "y" * (limit + 1)}, "prompt"),
    ]:
        err = assert_error(client.post(path, json=body), 400, param, "prompt_too_long")
        assert "--max-prompt-chars" in err["message"]
    assert not calls


# -- row 7: HEAD /health, continuous usage ------------------------------------------------------------------
def test_head_health(client):
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""


def sse(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, client, path):
    base = {"max_tokens": 6, "ignore_eos": True, "stream": True, "temperature": 0}
    base |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse(client, path, {**base, "stream_options": opts})
    *per_token, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt_tokens = final["usage"]["prompt_tokens"]
    seen = [c["usage"]["completion_tokens"] for c in per_token]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in per_token)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in per_token)
    assert seen == sorted(seen) and seen[-1] == 6 and len(set(seen)) >= 2  # counts grow chunk by chunk
    # without continuous_usage_stats the usage comes once, at the end
    plain = sse(client, path, {**base, "stream_options": {"include_usage": True}})
    assert all(c.get("usage") is None for c in plain[:-1])
    counts = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}
    assert counts(plain[-1]["usage"]) == counts(final["usage"])
    # the same prompt again: its full blocks come from the prefix cache, and the usage says how many tokens
    cached = plain[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (
        cached == (prompt_tokens - 1) // 16 * 16 and final["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached
    )
    server.wait_idle()


def test_stream_options_that_would_be_ignored_are_refused(client):
    r = client.post("/v1/completions", json={**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert_error(r, 400, "stream_options.continuous_usage_stats")
    r = client.post("/v1/completions", json={**OK, "stream_options": {"include_usage": True}})
    assert_error(r, 400, "stream_options")


# -- rows 5, 7 (auth), 8 on a server with a waiting limit, an API key and a model path ---------------------
@pytest.fixture(scope="module")
def limited(tiny_models):
    srv = start_server(
        tiny_models["llama"],
        api_key="secret",
        max_waiting_requests=2,
        settings={"model_root": str(tiny_models["llama"])},
    )
    yield srv
    srv.stop()


def test_request_larger_than_the_waiting_limit_is_400_not_503(limited):
    auth = {"Authorization": "Bearer secret"}
    with httpx.Client(base_url=limited.url, headers=auth, timeout=30) as c:
        err = assert_error(c.post("/v1/completions", json={**OK, "prompt": ["a", "b", "c"]}), 400, "prompt")
        assert "--max-waiting-requests" in err["message"]
        assert_error(c.post("/v1/completions", json={**OK, "n": 3}), 400, "n")
        assert_error(c.post("/v1/completions", json={**OK, "prompt": ["a", "b"], "n": 2}), 400, "prompt")
        chat = {"messages": CHAT, "max_tokens": 2, "n": 3}
        assert_error(c.post("/v1/chat/completions", json=chat), 400, "n")
        # the limit counts sequences: two prompts, or n=2, fit exactly
        assert c.post("/v1/completions", json={**OK, "prompt": ["a", "b"]}).status_code == 200
        assert c.post("/v1/completions", json={**OK, "n": 2}).status_code == 200
    limited.wait_idle()


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(limited, scheme):
    r = httpx.get(limited.url + "/v1/models", headers={"Authorization": f"{scheme} secret"})
    assert r.status_code == 200
    for header in [f"{scheme} wrong", f"{scheme}secret", "Basic secret", scheme]:
        r = httpx.get(limited.url + "/v1/models", headers={"Authorization": header})
        assert_error(r, 401, code="invalid_api_key")


def test_models_show_no_local_path(limited, tiny_models):
    r = httpx.get(limited.url + "/v1/models", headers={"Authorization": "Bearer secret"})
    folder = str(tiny_models["llama"])
    assert folder not in r.text and str(tiny_models["llama"].parent) not in r.text
    assert {m["root"] for m in r.json()["data"]} == {"llama"}


def test_public_root():
    assert public_root("gemma3-270m") == "gemma3-270m"
    assert public_root("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert public_root("/home/me/.cache/models/llama-3") == "llama-3"
    assert public_root("./models/x.gguf") == "x.gguf"
    assert public_root("~/models/y") == "y"
    assert public_root(None) is None
