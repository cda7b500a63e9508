"""Resuming a broken stream at the gateway: a replica killed mid-stream, and the client's stream goes on, token
for token the stream an uninterrupted run gives (greedy and seeded sampled, completions and chat), with one
usage that counts each token once. Attempts are bounded, and a stream that cannot be continued ends with the
error event. Real processes on loopback (tests/gateway/conftest.py); the splice's parts first, on their own."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from inferd.gateway.resume import StreamState, continuation, refuses_resume, why_not_resumable
from tests.gateway.conftest import base_config, wait_until
from tests.gateway.procs import Proc, start_replica, wait_http

pytestmark = pytest.mark.timeout(180)


# -- the parts ------------------------------------------------------------------------------------------
def _ev(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def test_stream_state_reads_strips_and_splices():
    s = StreamState("chat", client_wants_ids=False)
    head = {"id": "chatcmpl-a", "created": 1, "model": "m"}
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}
    assert s.event(_ev(role)) == _ev(role)  # bytes untouched
    out = s.event(_ev({**head, "choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [4, 5]}]}))
    assert out == _ev({**head, "choices": [{"index": 0, "delta": {"content": "Hi"}}]})  # the field cut out
    assert (s.token_ids, s.text) == ([4, 5], "Hi")

    s.begin(prompt_extra=0)  # a continuation: another id, a role chunk again, usage for its own tokens only
    other = {"id": "chatcmpl-b", "created": 2, "model": "m"}
    assert s.event(_ev({**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})) is None
    out = json.loads(
        s.event(_ev({**other, "choices": [{"index": 0, "delta": {"content": "!"}, "token_ids": [6]}]}))[6:]
    )
    assert out == {**head, "choices": [{"index": 0, "delta": {"content": "!"}}]}
    usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    out = json.loads(s.event(_ev({**other, "choices": [], "usage": usage}))[6:])
    assert (
        out["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10} and out["id"] == "chatcmpl-a"
    )
    assert s.event(b"data: [DONE]") == b"data: [DONE]"


def test_a_spliced_completions_logprobs_offsets_go_on_from_the_text_sent():
    s = StreamState("completions", client_wants_ids=False)
    lp = {"tokens": [" a", " bc"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}, {}], "text_offset": [0, 2]}
    s.event(_ev({"id": "c", "choices": [{"index": 0, "text": " a bc", "logprobs": lp, "token_ids": [8, 9]}]}))
    s.begin(prompt_extra=0)
    lp2 = {"tokens": [" d"], "token_logprobs": [-0.3], "top_logprobs": [{}], "text_offset": [0]}
    out = json.loads(s.event(_ev({"id": "x", "choices": [{"index": 0, "text": " d", "logprobs": lp2}]}))[6:])
    assert out["choices"][0]["logprobs"]["text_offset"] == [5] and out["id"] == "c"
    assert s.next_offset == 7  # and on from there


def test_continuations_exact_and_greedy():
    s = StreamState("completions", client_wants_ids=True)
    s.event(_ev({"id": "c", "choices": [{"index": 0, "text": " a b", "token_ids": [8, 9]}]}))
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 10, "min_tokens": 3, "temperature": 0, "stream": True}
    assert continuation("completions", body, s, exact=True) == ({**body, "resume": {"token_ids": [[8, 9]]}}, 0)
    greedy, extra = continuation("completions", body, s, exact=False)
    assert greedy["prompt"] == [1, 2, 8, 9] and greedy["max_tokens"] == 8 and greedy["min_tokens"] == 1
    assert extra == 2
    assert continuation("completions", {**body, "prompt": "x"}, s, exact=False)[0]["prompt"] == "x a b"
    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0}
    sc = StreamState("chat", client_wants_ids=False)
    sc.event(_ev({"id": "c", "choices": [{"index": 0, "delta": {"content": "so"}, "token_ids": [3]}]}))
    cont, _ = continuation("chat", chat, sc, exact=False)
    assert cont["messages"][-1] == {"role": "assistant", "content": "so"} and cont["continue_final_message"]
    assert refuses_resume(400, b'{"error": {"param": "resume.token_ids"}}')
    assert not refuses_resume(400, b'{"error": {"param": "prompt"}}') and not refuses_resume(400, b"nope")
    assert why_not_resumable("completions", {"temperature": 1.0}, 1, 1) is not None  # unseeded: no
    assert why_not_resumable("completions", {"temperature": 1.0, "seed": 3}, 1, 1) is None
    assert why_not_resumable("completions", {"temperature": 0}, 2, 1) is not None


# -- with real processes -----------------------------------------------------------------------------------
@pytest.fixture
def victims(tiny_llama, logs) -> Iterator[list[Proc]]:
    """Replicas of the shared one's model that a test may kill; started together (and always stopped)."""
    started: list[Proc] = []

    def start(count: int) -> list[Proc]:
        procs = [start_replica(tiny_llama, logs) for _ in range(count)]
        started.extend(procs)
        for p in procs:
            wait_http(p, "/health", timeout=120)
        return procs

    yield start
    for p in started:
        p.kill()


def _resume_config(pool_urls: list[str], **resume) -> dict:
    pool = {"name": "p", "replicas": pool_urls, "model": "tiny"}
    route = {"name": "tiny", "backends": [{"pool": "p"}], "resume": {"enabled": True, **resume}}
    return base_config([pool], [route], routing={"picker": "round_robin"})


def _events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


def _stream_until_cut(
    gw_url: str, path: str, body: dict, victim: Proc, kill_too: Proc | None = None, headers: dict | None = None
) -> bytes:
    """Stream `body` through the gateway until it lands on `victim` (round robin), freeze the victim after the
    first bytes and kill it; the whole stream the client got (and its response headers in `headers`)."""
    for _ in range(4):
        with httpx.stream("POST", f"{gw_url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            if r.headers["x-inferd-replica"] != victim.url:
                r.read()
                continue
            if headers is not None:
                headers.update(r.headers)
            chunks = r.iter_raw()
            got = next(chunks)
            os.kill(victim.popen.pid, signal.SIGSTOP)  # mid-stream, whatever the machine's speed
            victim.kill()
            return got + b"".join(chunks)
    raise AssertionError("round robin never picked the victim")


def _direct(replica: Proc, path: str, body: dict) -> list[str]:
    r = httpx.post(f"{replica.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return _events(r.content)


def _resumes(gw_url: str, outcome: str) -> float:
    for line in httpx.get(f"{gw_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("inferd_gateway_stream_resumes_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _counts(usage: dict) -> tuple[int, int, int]:
    """Prompt, completion, total tokens (cached tokens differ: the survivor's cache served the reference run)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def _tokens(events: list[str]) -> tuple[list[int], str, list[dict]]:
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    text = "".join(
        ch.get("text") or (ch.get("delta") or {}).get("content") or "" for c in chunks for ch in c["choices"]
    )
    return ids, text, chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 17}], ids=["greedy", "seeded"])
def test_a_killed_replica_mid_stream_and_the_stream_goes_on_exactly(replicas, victims, gateway, sampling):
    (victim,) = victims(1)
    survivor = replicas[0]
    gw = gateway(_resume_config([victim.url, survivor.url]))
    # completions, the client asks for token ids too; 300 tokens: a few chunks at most before the freeze
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "logprobs": 1, **sampling}
    body |= {"stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    want_ids, want_text, want = _tokens(_direct(survivor, "/v1/completions", body))
    events = _events(_stream_until_cut(gw.url, "/v1/completions", body, victim))
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    ids, text, chunks = _tokens(events)
    assert ids == want_ids and text == want_text and len(ids) == 300
    offsets = lambda cs: [
        o for c in cs for ch in c["choices"] for o in (ch.get("logprobs") or {}).get("text_offset", [])
    ]
    assert offsets(chunks) == offsets(want) and len(offsets(chunks)) == 300  # one text, counted through the splice
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1  # one stream, as the client sees it
    usage = [_counts(c["usage"]) for c in chunks if c.get("usage")]
    assert usage == [_counts(want[-1]["usage"])] and usage[0][1] == 300  # each token counted once
    assert _resumes(gw.url, "exact") == 1

    # chat, the client asks for no token ids: it gets none, and one role chunk
    chat = {k: v for k, v in body.items() if k not in ("prompt", "return_token_ids")}
    chat |= {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200}
    (victim2,) = victims(1)
    gw2 = gateway(_resume_config([victim2.url, survivor.url]))
    want_ids, want_text, want = _tokens(_direct(survivor, "/v1/chat/completions", chat))
    events = _events(_stream_until_cut(gw2.url, "/v1/chat/completions", chat, victim2))
    assert events[-1] == "data: [DONE]"
    ids, text, chunks = _tokens(events)
    assert ids == [] and text == want_text
    assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1
    assert [_counts(c["usage"]) for c in chunks if c.get("usage")] == [_counts(want[-1]["usage"])]
    assert len({c["id"] for c in chunks}) == 1 and _resumes(gw2.url, "exact") == 1


def test_attempts_are_bounded_and_what_cannot_resume_ends_with_the_error_event(victims, gateway):
    a, b = victims(2)
    gw = gateway(_resume_config([a.url, b.url], max_attempts=1))
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        streaming, other = (a, b) if r.headers["x-inferd-replica"] == a.url else (b, a)
        chunks = r.iter_raw()
        got = next(chunks)
        os.kill(streaming.popen.pid, signal.SIGSTOP)
        streaming.kill()
        wait_until(lambda: _resumes(gw.url, "exact") == 1, timeout=30, what="the resume")
        os.kill(other.popen.pid, signal.SIGSTOP)  # the continuation breaks too: its one attempt is used
        other.kill()
        got += b"".join(chunks)
    events = _events(got)
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "stream_broken" and "data: [DONE]" not in events
    assert _resumes(gw.url, "failed") == 1
    assert "attempts were used" in gw.log.read_text()


def test_a_sampled_stream_without_a_seed_is_seeded_by_the_gateway_and_resumed_exactly(replicas, victims, gateway):
    (victim,) = victims(1)
    survivor = replicas[1]
    gw = gateway(_resume_config([victim.url, survivor.url]))
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    body |= {"stream": True, "return_token_ids": True}
    headers: dict = {}
    events = _events(_stream_until_cut(gw.url, "/v1/completions", body, victim, headers=headers))
    seed = int(headers["x-inferd-seed"])
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    want_ids, want_text, _ = _tokens(_direct(survivor, "/v1/completions", {**body, "seed": seed}))
    ids, text, _ = _tokens(events)
    assert ids == want_ids and text == want_text and len(ids) == 300
    assert _resumes(gw.url, "exact") == 1


def test_a_sampled_stream_without_a_seed_is_not_resumed_when_the_gateway_seeds_none(replicas, victims, gateway):
    (victim,) = victims(1)
    gw = gateway(_resume_config([victim.url, replicas[1].url], seed_unseeded=False))
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    events = _events(_stream_until_cut(gw.url, "/v1/completions", {**body, "stream": True}, victim))
    assert json.loads(events[-1][6:])["error"]["code"] == "stream_broken"
    assert _resumes(gw.url, "failed") == 1
    assert "samples without a seed" in gw.log.read_text()


def test_a_bad_resume_from_the_client_is_the_replicas_400(replicas, gateway):
    gw = gateway(_resume_config([replicas[0].url]))
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 4, "resume": {"token_ids": [[1], [2]]}}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "resume.token_ids"
