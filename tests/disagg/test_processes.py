"""Disaggregated serving with real processes on loopback: a prefill instance, a decode instance, the proxy,
and a `--role both` instance to compare with. Started once for the module; the fault tests at the end
kill processes (a decode of their own first, then the shared prefill) and check that every request ends
and that both sides end with every block free."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inferd.procs import start_proxy
from tests.gateway.procs import Proc, replica_metrics, spawn, start_replica, wait_http
from tests.net import free_port

pytestmark = pytest.mark.timeout(300)

SECRET = "disagg-test-secret"
LEASE_TTL = 6.0
SMALL = ("--num-blocks", "512")  # 8192 tokens: a small cache (and shared memory segment) per process


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    both: Proc
    proxy: Proc
    kv_port: int
    model: Path
    logs: Path


def _prefill(model: Path, logs: Path, kv_port: int) -> Proc:
    return start_replica(
        model,
        logs,
        "--role",
        "prefill",
        "--kv-secret",
        SECRET,
        "--kv-port",
        str(kv_port),
        "--kv-lease-ttl",
        str(LEASE_TTL),
    )


def _decode(model: Path, logs: Path, kv_port: int, *extra: str, secret: str = SECRET) -> Proc:
    return start_replica(
        model, logs, *SMALL, "--role", "decode", "--kv-secret", secret, "--kv-peers", f"127.0.0.1:{kv_port}", *extra
    )


def _proxy(logs: Path, prefill: list[str], decode: list[str]) -> Proc:
    return start_proxy(logs, prefill, decode, "--prefill-timeout", "20")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_models) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("disagg-logs")
    model = tiny_models["llama"]
    kv_port = free_port()
    procs = [_prefill(model, logs, kv_port), _decode(model, logs, kv_port), start_replica(model, logs, *SMALL)]
    procs.append(_proxy(logs, [procs[0].url], [procs[1].url]))
    cluster = Cluster(*procs, kv_port=kv_port, model=model, logs=logs)
    try:
        for p in procs:
            wait_http(p, "/health", timeout=180)
        yield cluster
    finally:
        for p in [*procs, cluster.prefill]:  # a test may have restarted the prefill instance
            p.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 370 for i in range(n)]


def _completion(url: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(url: str, path: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + path, json={"model": "tiny", **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                text.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(text)


def _metric(proc: Proc, name: str) -> float:
    return replica_metrics(proc.url).get(name, 0.0)


def _by_label(proc: Proc, name: str, label: str) -> dict[str, float]:
    """One labelled counter of a server's /metrics: {label value: value}."""
    out: dict[str, float] = {}
    for line in httpx.get(proc.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rpartition(" ")[2])
    return out


def _wait_idle(proc: Proc, timeout: float = 20.0) -> None:
    """Every block free: no running request, no lease."""
    deadline = time.monotonic() + timeout
    while True:
        m = replica_metrics(proc.url)
        busy = m.get("inferd:kv_cache_usage_perc", 0) + m.get("inferd:kv_leases_active", 0)
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{proc.name} still holds blocks: {busy}"
        time.sleep(0.1)


GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
REJECTED = "inferd:kv_transfer_params_rejected_total"


def test_greedy_outputs_through_the_proxy_equal_a_both_instance(cluster: Cluster):
    before = _metric(cluster.decode, "inferd:remote_prefills_total")
    lengths = [1, 5, 16, 17, 31, 48, 100, 200]
    for n in lengths:
        body = {"prompt": _prompt(n, n), **GREEDY}
        got = _completion(cluster.proxy.url, body)["choices"][0]["text"]
        assert got == _completion(cluster.both.url, body)["choices"][0]["text"], n
    assert _metric(cluster.decode, "inferd:remote_prefills_total") - before == len(lengths) - 1  # 1 token: no K/V
    assert _metric(cluster.decode, "inferd:kv_transfer_blocks_total") > 0
    assert _metric(cluster.prefill, "inferd:kv_leases_created_total") >= len(lengths)
    _wait_idle(cluster.decode)
    _wait_idle(cluster.prefill)


def test_streaming_and_chat_through_the_proxy(cluster: Cluster):
    body = {"prompt": _prompt(40, 1), **GREEDY}
    want = _completion(cluster.both.url, body)["choices"][0]["text"]
    assert _stream_text(cluster.proxy.url, "/v1/completions", body) == want
    chat = {"messages": [{"role": "user", "content": "Paged attention stores keys in blocks. " * 4}], **GREEDY}
    r = httpx.post(cluster.both.url + "/v1/chat/completions", json={"model": "tiny", **chat}, timeout=120)
    want_chat = r.json()["choices"][0]["message"]["content"]
    r = httpx.post(cluster.proxy.url + "/v1/chat/completions", json={"model": "tiny", **chat}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want_chat
    assert _stream_text(cluster.proxy.url, "/v1/chat/completions", chat) == want_chat


def test_a_constraint_holds_on_both_sides_of_the_handoff(cluster: Cluster):
    """The decode side samples under the request's grammar: the output follows it and is the token-for-token
    output of a `both` instance with the same seed, for a prompt long enough to be prefilled remotely."""
    before = _metric(cluster.decode, "inferd:remote_prefills_total")
    pattern = r"(red|green|blue)-[0-9]{3}"
    for seed in (1, 2, 3):
        body = {"prompt": _prompt(48, seed), "max_tokens": 20, "seed": seed, "structured_outputs": {"regex": pattern}}
        got = _completion(cluster.proxy.url, body)["choices"][0]
        assert got["finish_reason"] == "stop" and re.fullmatch(pattern, got["text"]), got
        assert got["text"] == _completion(cluster.both.url, body)["choices"][0]["text"]
    assert _metric(cluster.decode, "inferd:remote_prefills_total") - before == 3
    _wait_idle(cluster.decode)
    _wait_idle(cluster.prefill)


def test_concurrent_requests_through_the_proxy(cluster: Cluster):
    bodies = [{"prompt": _prompt(20 + 9 * i, 100 + i), **GREEDY} for i in range(8)]
    want = [_completion(cluster.both.url, b)["choices"][0]["text"] for b in bodies]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(
                *(client.post(cluster.proxy.url + "/v1/completions", json={"model": "tiny", **b}) for b in bodies)
            )
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(run()) == want
    _wait_idle(cluster.decode)
    _wait_idle(cluster.prefill)


def test_prefix_hits_on_the_decode_side_pull_fewer_blocks(cluster: Cluster):
    shared = _prompt(64, 7)
    blocks = lambda: _metric(cluster.decode, "inferd:kv_transfer_blocks_total")  # noqa: E731
    hits = lambda: _metric(cluster.decode, "inferd:kv_transfer_blocks_prefix_hit_total")  # noqa: E731
    b0, h0 = blocks(), hits()
    _completion(cluster.proxy.url, {"prompt": shared + _prompt(20, 8), **GREEDY})
    assert blocks() - b0 == 6 and hits() == h0  # 84 tokens, all but the last: 6 blocks
    _completion(cluster.proxy.url, {"prompt": shared + _prompt(30, 9), **GREEDY})
    assert hits() - h0 == 4  # the 64 shared tokens were already in the decode side's cache
    assert blocks() - b0 == 6 + 2  # 94 tokens, all but the last: 6 blocks, 4 of them cached


def test_untrusted_transfer_params_sent_directly_are_prefilled_locally_and_touch_nothing(cluster: Cluster):
    """A client sending forged, altered or malformed parameters straight to a decode instance gets what it
    would without them: 200 and a `both` instance's tokens. No block is pulled, nothing is contacted, and
    each is counted by reason."""
    prompt = _prompt(40, 11)
    lease = _completion(
        cluster.prefill.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    kv = lease["kv_transfer_params"]
    _wait_idle(cluster.decode)
    want = _completion(cluster.both.url, {"prompt": prompt, **GREEDY})["choices"][0]["text"]
    before, rejected = replica_metrics(cluster.decode.url), _by_label(cluster.decode, REJECTED, "reason")
    bad = [{**kv, "peer": "10.1.2.3:80"}, {**kv, "block_ids": [0]}, {"x": 1}, {**kv, "signature": "0" * 64}]
    for params in bad:
        got = _completion(cluster.decode.url, {"prompt": prompt, "kv_transfer_params": params, **GREEDY})
        assert got["choices"][0]["text"] == want
    after = replica_metrics(cluster.decode.url)
    for name in ("inferd:remote_prefills_total", "inferd:kv_transfer_blocks_total", "inferd:kv_transfers_total"):
        assert after.get(name, 0) == before.get(name, 0), name
    now = _by_label(cluster.decode, REJECTED, "reason")
    assert now.get("bad_signature", 0) - rejected.get("bad_signature", 0) == len(bad), now
    # a `both` instance is not disaggregated: the field is refused there
    r = httpx.post(cluster.both.url + "/v1/completions", json={"prompt": prompt, "kv_transfer_params": kv})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    _wait_idle(cluster.decode)
    # the genuine lease, used directly, gives the same tokens as the both instance
    got = _completion(cluster.decode.url, {"prompt": prompt, "kv_transfer_params": kv, **GREEDY})
    assert got["choices"][0]["text"] == want
    _wait_idle(cluster.prefill)


def test_a_decode_instance_with_another_secret_answers_prefilling_itself_and_says_so_once(cluster: Cluster):
    """An operator's mistake (INFERD_KV_SECRET differs between the pools) is not blamed on the client: every
    request through the proxy is answered with a `both` instance's tokens, the decode instance prefills them
    itself, counts each, and logs the cause once; the prefill side frees the leases nobody collected."""
    decode = _decode(cluster.model, cluster.logs, cluster.kv_port, secret="not-the-prefill-secret")
    proxy = _proxy(cluster.logs, [cluster.prefill.url], [decode.url])
    try:
        for p in (decode, proxy):
            wait_http(p, "/health", timeout=180)
        bodies = [{"prompt": _prompt(30 + 7 * i, 60 + i), **GREEDY} for i in range(4)]
        expiries = _metric(cluster.prefill, "inferd:kv_lease_expiries_total")
        for body in bodies:
            got = _completion(proxy.url, body)["choices"][0]["text"]
            assert got == _completion(cluster.both.url, body)["choices"][0]["text"]
        assert _by_label(decode, REJECTED, "reason") == {"bad_signature": len(bodies)}
        assert _by_label(decode, "inferd:local_prefills_total", "reason")["params_rejected"] == len(bodies)
        assert _metric(decode, "inferd:remote_prefills_total") == 0
        warned = [line for line in decode.log.read_text().splitlines() if "kv_transfer_params claiming" in line]
        assert len(warned) == 1 and "INFERD_KV_SECRET" in warned[0], decode.log_tail()
        _wait_idle(decode)
    finally:
        proxy.stop()
        decode.stop()
    _wait_idle(cluster.prefill, timeout=LEASE_TTL + 10)  # the leases expire there
    assert _metric(cluster.prefill, "inferd:kv_lease_expiries_total") - expiries == len(bodies)


def test_a_4xx_from_the_prefill_instance_passes_through(cluster: Cluster):
    r = httpx.post(cluster.proxy.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]
    r = httpx.post(cluster.proxy.url + "/v1/completions", json={"prompt": "hi", "top_p": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"]


def test_lease_expired_before_the_pull_recomputes(cluster: Cluster):
    prompt = _prompt(50, 12)
    lease = _completion(
        cluster.prefill.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert _metric(cluster.prefill, "inferd:kv_leases_active") == 1
    expiries = _metric(cluster.prefill, "inferd:kv_lease_expiries_total")
    _wait_idle(cluster.prefill, timeout=LEASE_TTL + 5)  # freed by the engine loop's timer, with no request
    assert _metric(cluster.prefill, "inferd:kv_lease_expiries_total") == expiries + 1
    got = _completion(
        cluster.decode.url, {"prompt": prompt, "kv_transfer_params": lease["kv_transfer_params"], **GREEDY}
    )
    assert (
        got["choices"][0]["text"] == _completion(cluster.both.url, {"prompt": prompt, **GREEDY})["choices"][0]["text"]
    )
    m = replica_metrics(cluster.decode.url)
    assert m["inferd:local_prefills_total"] >= 1
    _wait_idle(cluster.decode)


def test_decode_killed_mid_transfer_leaves_the_prefill_side_free(cluster: Cluster):
    decode = _decode(cluster.model, cluster.logs, cluster.kv_port, "--kv-transport", "tcp")
    try:
        wait_http(decode, "/health", timeout=180)
        prompts = [_prompt(300, 20 + i) for i in range(4)]
        leases = [
            _completion(
                cluster.prefill.url, {"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            )
            for p in prompts
        ]
        assert _metric(cluster.prefill, "inferd:kv_leases_active") == 4

        async def fire() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                tasks = [
                    asyncio.create_task(
                        client.post(
                            decode.url + "/v1/completions",
                            json={"prompt": p, "kv_transfer_params": x["kv_transfer_params"], "max_tokens": 50},
                        )
                    )
                    for p, x in zip(prompts, leases, strict=True)
                ]
                await asyncio.sleep(0.3)
                decode.kill()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for r in results:  # a clear end: an answer, or a broken connection; never a hang
                    assert isinstance(r, (httpx.Response, httpx.HTTPError)), r

        asyncio.run(fire())
    finally:
        decode.kill()
    _wait_idle(cluster.prefill, timeout=LEASE_TTL + 10)


def test_prefill_killed_mid_run_requests_still_complete(cluster: Cluster):
    bodies = [{"prompt": _prompt(60 + 10 * i, 40 + i), **GREEDY} for i in range(6)]
    want = [_completion(cluster.both.url, b)["choices"][0]["text"] for b in bodies]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(client.post(cluster.proxy.url + "/v1/completions", json=b)) for b in bodies]
            await asyncio.sleep(0.2)
            cluster.prefill.kill()
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [r.json()["choices"][0]["text"] for r in results] == want
    # and afterwards, with no prefill instance at all, the decode instance prefills itself
    assert _completion(cluster.proxy.url, bodies[0])["choices"][0]["text"] == want[0]
    proxy = replica_metrics(cluster.proxy.url)
    assert proxy["inferd:disagg_proxy_prefills_total"] >= len(bodies) + 1
    _wait_idle(cluster.decode)
    # the module's other tests may come after this one: the prefill instance back, on its ports, and in use
    killed = cluster.prefill
    cluster.prefill = spawn("prefill-again", list(killed.popen.args), killed.port, cluster.logs)
    wait_http(cluster.prefill, "/health", timeout=180)
    pulled = lambda: _metric(cluster.decode, "inferd:kv_transfer_blocks_total")  # noqa: E731
    before = pulled()
    deadline = time.monotonic() + 30
    while pulled() == before and time.monotonic() < deadline:  # until the proxy sends prefills there again
        _completion(cluster.proxy.url, {"prompt": _prompt(40, 99), **GREEDY})
    assert pulled() > before, "the proxy never used the restarted prefill instance"
    _wait_idle(cluster.decode)


def test_sigterm_closes_the_prefill_side_kv_channel(tmp_path, tiny_models):
    """uvicorn re-raises SIGTERM once drained; `inferd serve` turns it into an exit (143) that still runs its
    clean-up, so a prefill instance closes its KV channel and shared memory instead of leaking them."""
    proc = _prefill(tiny_models["llama"], tmp_path, free_port())
    try:
        wait_http(proc, "/health", timeout=180)
        out = _completion(proc.url, {"prompt": _prompt(40, 1), "max_tokens": 1})  # a lease, then the channel's use
        assert out["usage"]["prompt_tokens"] >= 40
    finally:
        proc.stop()
    assert proc.popen.returncode == 143, proc.log_tail()
    assert "leaked shared_memory" not in proc.log.read_text(), proc.log_tail()


def test_speculative_decoding_on_the_decode_side(tmp_path, tiny_models):
    """A decode instance with n-gram speculation continues remotely prefilled requests with drafts, and gives
    the tokens a `both` instance without speculation gives. The echo model repeats its last token, so the
    drafts hold and its argmax has a wide margin in any dtype."""
    from tests.engine.echo_model import echo_model

    model = echo_model(tiny_models["llama"], tmp_path / "echo", 0.0)
    kv_port = free_port()
    spec = ("--speculative-method", "ngram", "--speculative-disable-by-batch-size", "64")
    procs = [_prefill(model, tmp_path, kv_port), _decode(model, tmp_path, kv_port, *spec)]
    procs.append(start_replica(model, tmp_path, *SMALL))
    procs.append(_proxy(tmp_path, [procs[0].url], [procs[1].url]))
    prefill, decode, both, proxy = procs
    try:
        for p in procs:
            wait_http(p, "/health", timeout=180)
        for seed in (1, 2, 3):
            prompt = _prompt(40, seed) + [9, 9, 9]  # a run the lookup continues from the first decode step
            body = {"prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
            got = _completion(proxy.url, body)
            assert got["usage"]["completion_tokens"] == 24
            assert got["choices"][0]["text"] == _completion(both.url, body)["choices"][0]["text"]
        assert _metric(decode, "inferd:remote_prefills_total") == 3
        drafted = _metric(decode, "inferd:spec_decode_num_draft_tokens_total")
        assert drafted > 0 and _metric(decode, "inferd:spec_decode_num_accepted_tokens_total") == drafted
        _wait_idle(decode)
        _wait_idle(prefill)
    finally:
        for p in procs:
            p.stop()
