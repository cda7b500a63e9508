"""Fuzzing a real server (uvicorn on loopback, tiny random model) from its own OpenAPI schema, with schemathesis.

Every operation of /openapi.json gets generated requests, valid and invalid ones (schemathesis's positive and
negative modes), with hypothesis's Unicode and numeric edge cases. The checks: no 5xx, every status code,
content type and body as the schema declares them, and after every request the server holds nothing: no
request running or waiting, every KV block free (`engine.check_idle()`). What a schema cannot say (token ids
that must be below the vocabulary size, stop strings, lone surrogates and non-finite numbers inside otherwise
valid JSON) has hypothesis strategies of its own below.

Two drivers: schemathesis's generators run here under hypothesis, one test per operation and mode (so a
failure names the operation and shrinks to a small case), and `schemathesis run --phases coverage` (its CLI, as
CI would run it against any server) sends the boundary values of every field: the int64 extremes, empty and
over-long strings, missing and null fields.

The run is bounded for CI (2 cores, about a minute and a half here): EXAMPLES per operation and mode, a short
context (max_model_len 128) so that no request generates for long, and bodies asking for at most MAX_TOKENS
tokens (the schema allows up to 2**63 - 1).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import VOCAB
from tests.server.conftest import MODEL_NAME, start_server

MAX_TOKENS = 4
EXAMPLES = 100  # per operation and mode
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)

CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"mode": "all", "max-examples": EXAMPLES},
        "checks": {
            # lax pydantic takes "1" for 1 and ignores unknown fields, as OpenAI and vLLM do: schema-invalid
            # input may be served, so schemathesis's "negative data was accepted" is no failure here
            "negative_data_rejection": {"enabled": False},
            # valid by the schema is not always servable: the context, the vocabulary, n x prompts vs the queue
            "positive_data_acceptance": {"enabled": False},
        },
    }
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    srv = start_server(tiny_models["llama"], max_waiting_requests=64, max_num_seqs=8, max_model_len=128)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_dict(fuzz_server.app.openapi(), config=CONFIG)


OPERATIONS = [
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/metrics"),
    ("GET", "/kv_events"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/load_lora_adapter"),  # this server serves no adapters: always a 400
    ("POST", "/v1/unload_lora_adapter"),
]
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# invalid data for every operation with a body; the others take no body and any path string is valid
CASES = [(m, p, POSITIVE) for m, p in OPERATIONS] + [(m, p, NEGATIVE) for m, p in OPERATIONS if m == "POST"]


def test_every_operation_is_fuzzed(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


def _bounded(body, stream: bool):
    """Generated bodies ask for few tokens, and half of them stream (so that the events' schema is checked
    often); everything else stays as generated."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS):
                body[key] = MAX_TOKENS
        if stream and "stream" not in body:
            body["stream"] = True
    return body


# schemathesis's own pytest plugin (schema.parametrize) does not run on pytest 9.2 (it reads a node attribute
# pytest removed), so each operation's strategy is driven with hypothesis directly; the checks are the same
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_operation(api_schema, fuzz_server, method, path, mode):
    operation = api_schema[path][method]
    assert mode is POSITIVE or operation.body, "negative cases are for operations with a body"

    @FAST
    @given(case=operation.as_strategy(generation_mode=mode), stream=st.booleans())
    def run(case, stream):
        case.body = _bounded(case.body, stream)
        case.call_and_validate(base_url=fuzz_server.url, timeout=30)
        fuzz_server.wait_idle()  # nothing running or waiting, every KV block free

    run()


@pytest.mark.timeout(300)
def test_schemathesis_coverage_phase(fuzz_server, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", fuzz_server.url + "/openapi.json", "--phases", "coverage",
           "--exclude-checks", "negative_data_rejection,positive_data_acceptance", "--request-timeout", "30",
           "--workers", "1", "--no-color"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)  # its cache goes there
    # every generated case passed; warnings may remain (the LoRA routes of a server without adapters answer
    # every valid body with 400 or 404, which schemathesis reports as missing test data)
    counts = re.search(r"(\d+) generated, (\d+) passed\s*$", run.stdout.rpartition("Test cases:")[2].split("Seed")[0])
    ok = run.returncode == 0 and counts is not None and counts[1] == counts[2]
    assert ok, run.stdout[-5000:] + run.stderr[-2000:]
    fuzz_server.wait_idle()


def test_server_still_serves_after_fuzzing(fuzz_server):
    r = httpx.post(fuzz_server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(fuzz_server.url + "/health").json() == {"status": "ok", "error": None}
    fuzz_server.wait_idle()


# -- what the schema cannot express ------------------------------------------------------------------------
def post(srv, path: str, text: str) -> httpx.Response:
    return httpx.post(srv.url + path, content=text.encode(), headers={"Content-Type": "application/json"}, timeout=30)


def check_answer(srv, r: httpx.Response, ok: set[int]) -> None:
    assert r.status_code in ok | {400}, r.text
    if r.status_code == 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    srv.wait_idle()


token_ids = st.lists(
    st.one_of(
        st.integers(0, VOCAB - 1),  # valid
        st.sampled_from([-1, VOCAB, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]),  # just outside
    ),
    min_size=0,
    max_size=40,
)


@FAST
@given(ids=token_ids, nested=st.booleans(), echo=st.booleans())
def test_token_id_prompts(fuzz_server, ids, nested, echo):
    prompt = [ids, ids[:3]] if nested else ids
    body = {"prompt": prompt, "max_tokens": 2, "echo": echo}
    r = post(fuzz_server, "/v1/completions", json.dumps(body))
    valid = ids and all(0 <= t < VOCAB for t in ids) and (not nested or len(ids) >= 1)
    check_answer(fuzz_server, r, {200} if valid else set())
    r = post(fuzz_server, "/detokenize", json.dumps({"tokens": ids}))
    check_answer(fuzz_server, r, {200} if all(0 <= t < VOCAB for t in ids) else set())


stop_lists = st.one_of(
    st.text(max_size=8),
    st.lists(st.text(min_size=0, max_size=30), max_size=10),
    st.lists(st.sampled_from(["\n", " ", "e", "the", "🙂", "\x00", "ab" * 200]), max_size=5),
)


@FAST
@given(stop=stop_lists, include=st.booleans(), stream=st.booleans(), ids=st.lists(st.integers(0, VOCAB - 1)))
def test_stop_lists(fuzz_server, stop, include, stream, ids):
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "stop": stop, "include_stop_str_in_output": include,
            "stream": stream, "stop_token_ids": ids}  # fmt: skip
    r = post(fuzz_server, "/v1/completions", json.dumps(body))
    empty = stop == "" or (isinstance(stop, list) and "" in stop)
    check_answer(fuzz_server, r, set() if empty else {200})
    if r.status_code == 200 and stream:
        assert r.text.rstrip().endswith("data: [DONE]")


surrogates = st.integers(0xD800, 0xDFFF).map(chr)
text_with_surrogate = st.tuples(st.text(max_size=10), surrogates, st.text(max_size=10)).map("".join)

BODIES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}


def _paths(value, path=()):
    """Every place in a JSON value where a string or number may be put: (path, key or index)."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _put(body, path, value):
    body = json.loads(json.dumps(body))
    if not path:
        return value
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@st.composite
def poisoned(draw, bad):
    """A valid body with one value (or one new field) replaced by `bad`, as JSON text."""
    route = draw(st.sampled_from(sorted(BODIES)))
    body = BODIES[route]
    where = draw(st.sampled_from([p for p in _paths(body) if p] + [("model",), ("extra_field",), ("stop",)]))
    return route, where, _put(body, where, draw(bad))


@FAST
@given(case=poisoned(text_with_surrogate))
def test_lone_surrogates_anywhere_are_400(fuzz_server, case):
    route, where, body = case
    r = post(fuzz_server, route, json.dumps(body))  # ensure_ascii: the surrogate travels as a \\udXXX escape
    assert r.status_code == 400, (route, where, r.text)
    assert r.json()["error"]["param"] == ".".join(map(str, where))
    fuzz_server.wait_idle()


@FAST
@given(case=poisoned(st.sampled_from([math.inf, -math.inf, math.nan])), literal=st.sampled_from(["", "1e999"]))
def test_non_finite_numbers_anywhere_are_400(fuzz_server, case, literal):
    route, where, body = case
    text = json.dumps(body)  # Python writes Infinity, -Infinity and NaN bare
    if literal:
        text = text.replace("-Infinity", "-" + literal).replace("Infinity", literal).replace("NaN", literal)
    r = post(fuzz_server, route, text)
    assert r.status_code == 400, (route, where, r.text)
    assert r.json()["error"]["param"] == ".".join(map(str, where))
    fuzz_server.wait_idle()
