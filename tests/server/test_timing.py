"""`return_timing`: where a request's time went, in its usage, from the engine's own timestamps and counts."""

from __future__ import annotations

import json
import time

import httpx

from tests.server.conftest import MODEL_NAME

FIELDS = {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "total_ms", "prefill_chunks", "decode_steps",
          "preemptions", "cached_prompt_tokens", "kv_loaded_tokens", "kv_load_ms"}  # fmt: skip


def _check(timing: dict, max_tokens: int) -> None:
    assert set(timing) == FIELDS
    assert timing["queue_ms"] >= 0 and timing["prefill_ms"] > 0 and timing["decode_ms"] >= 0
    assert abs(timing["ttft_ms"] - timing["queue_ms"] - timing["prefill_ms"]) < 0.01
    assert timing["total_ms"] >= timing["ttft_ms"] + timing["decode_ms"] - 0.01
    assert timing["total_ms"] - (timing["queue_ms"] + timing["prefill_ms"] + timing["decode_ms"]) < 5  # parts add up
    assert timing["prefill_chunks"] >= 1 and timing["decode_steps"] == max_tokens - 1  # the prefill samples one
    assert timing["preemptions"] == 0 and timing["kv_loaded_tokens"] == 0


def test_timing_in_usage_when_asked(server):
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox " * 10, "max_tokens": 5, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=30) as client:
        plain = client.post("/v1/completions", json=body).json()["usage"]
        assert "timing" not in plain and plain["prompt_tokens_details"]["cached_tokens"] == 0
        # the engine's account covers the request's end-to-end latency as the client measured it, within 5 ms (the
        # rest: HTTP, parsing, tokenizing, the answer's JSON); the best of five, as a busy machine adds to some
        unaccounted = []
        for _ in range(5):
            started = time.perf_counter()
            timed = client.post("/v1/completions", json={**body, "return_timing": True}).json()["usage"]
            unaccounted.append((time.perf_counter() - started) * 1000 - timed["timing"]["total_ms"])
            _check(timed["timing"], 5)
        assert min(unaccounted) >= 0 and min(unaccounted) < 5, unaccounted
        # the same prompt again: its full blocks came from the prefix cache, and the timing says so
        assert timed["timing"]["cached_prompt_tokens"] == timed["prompt_tokens_details"]["cached_tokens"] > 0
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "ignore_eos": True, "return_timing": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        usage_chunks = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
        assert len(usage_chunks) == 1, usage_chunks
        _check(usage_chunks[0]["timing"], 3)
    server.wait_idle()
