"""The gateway's parts on their own: config errors with lines, the picker, the wait queue, the SSE filter,
the prefix index (in memory and in a real redis-server), and the budget stores agreeing with each other."""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import struct
import subprocess
import sys
import time

import pytest

from inferd.errors import ConfigError, InvalidRequestError
from inferd.gateway.admission import AdmissionQueue
from inferd.gateway.budget import MemoryBudgetStore, RedisBudgetStore, amount_vector, limit_vector
from inferd.gateway.config import Limits, PoolConfig, RoutingConfig, parse_config
from inferd.gateway.errors import GatewayError
from inferd.gateway.picker import AllSaturated, Picker
from inferd.gateway.prefix import MemoryPrefixIndex, RedisPrefixIndex
from inferd.gateway.proxy import SSEFilter
from inferd.gateway.replicas import Load, Pool, parse_load
from inferd.prefix_hash import block_hashes
from inferd.prompts import check_prompt
from tests.gateway.procs import REPO, _env, redis_binary, start_redis

pytestmark = pytest.mark.timeout(60)

GOOD = """\
pools:
  - name: a
    replicas: [http://127.0.0.1:8001]
models:
  - name: tiny
    backends:
      - pool: a
"""


def test_config_errors_name_the_line():
    assert parse_config(GOOD).pools[0].replicas == ["http://127.0.0.1:8001"]
    with pytest.raises(ConfigError, match=r"gw.yaml:8: models.0.backends.0.weight: Input should be"):
        parse_config(GOOD.replace("      - pool: a", "      - pool: a\n        weight: -1"), "gw.yaml")
    with pytest.raises(ConfigError, match=r"gw.yaml:3: pools.0.replicas.0: .*http://"):
        parse_config(GOOD.replace("http://127.0.0.1:8001", "127.0.0.1:8001"), "gw.yaml")
    with pytest.raises(ConfigError, match=r"gw.yaml:3: pools.0.blok_size: Extra inputs are not permitted"):
        parse_config(GOOD.replace("  - name: a", "  - name: a\n    blok_size: 16"), "gw.yaml")
    with pytest.raises(ConfigError, match=r"gw.yaml:7: models.0.backends.0.pool: Value error, unknown pool 'b'"):
        parse_config(GOOD.replace("- pool: a", "- pool: b"), "gw.yaml")
    with pytest.raises(ConfigError, match=r"gw.yaml:\d+: not valid YAML"):
        parse_config("pools: [\n", "gw.yaml")


BAD_URLS = """\
pools:
  - name: a
    replicas:
      - http://127.0.0.1:8001
      - {url}
models:
  - name: tiny
    backends:
      - pool: a
"""


@pytest.mark.parametrize(
    "url,why",
    [
        ("http://127.0.0.1:99999", "the port must be an integer in 1..65535"),
        ("http://127.0.0.1:0", "the port must be an integer in 1..65535"),
        ("http://h:80x", "the port must be an integer in 1..65535"),
        ("http://:8000", "has no host"),
        ("ftp://127.0.0.1:8000", "must start with http:// or https://"),
    ],
)
def test_a_bad_replica_url_names_its_line_and_field(url, why):
    with pytest.raises(ConfigError, match=rf"gw.yaml:5: pools.0.replicas.1: Value error, .*{re.escape(why)}"):
        parse_config(BAD_URLS.format(url=url), "gw.yaml")


def test_check_refuses_a_bad_replica_url_and_a_list_file_skips_one(tmp_path, caplog):
    path = tmp_path / "gw.yaml"
    path.write_text(BAD_URLS.format(url="http://127.0.0.1:99999"))
    argv = [sys.executable, "-m", "inferd.cli", "gateway", "--config", str(path), "--check"]
    out = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert out.returncode != 0 and f"{path}:5: pools.0.replicas.1:" in out.stderr + out.stdout, out
    listed = tmp_path / "replicas.txt"
    listed.write_text("http://127.0.0.1:8002\nhttp://127.0.0.1:99999  # a typo\n\n")
    with caplog.at_level("WARNING"):
        pool = Pool(PoolConfig(name="p", replicas_file=listed))
    assert list(pool.replicas) == ["http://127.0.0.1:8002"]
    assert f"{listed}:2: replica URL 'http://127.0.0.1:99999'" in caplog.text


def _pool(n: int) -> Pool:
    return Pool(PoolConfig(name="p", replicas=[f"http://r{i}:1" for i in range(n)]))


def test_a_burst_spreads_because_the_pick_counts_in_flight_before_returning():
    pool = _pool(4)
    for r in pool.replicas.values():  # identical, fresh load: only the in-flight counts tell them apart
        r.load = Load(at=time.monotonic())
    picker = Picker(RoutingConfig(), stale_after_s=5, rng=random.Random(0))
    picks = [picker.pick(picker.candidates(list(pool.replicas.values()), set(), {})) for _ in range(8)]
    assert sorted(r.in_flight for r in pool.replicas.values()) == [2, 2, 2, 2]
    for p in picks:
        p.release()
    assert all(r.in_flight == 0 for r in pool.replicas.values())


def test_in_flight_tokens_send_a_short_request_away_from_a_long_one():
    pool = _pool(2)
    a, b = pool.replicas.values()
    a.load = b.load = Load(at=time.monotonic())
    routing = RoutingConfig(scorers={"queue": 0, "kv_cache": 0, "in_flight": 0, "in_flight_tokens": 1, "prefix": 0})
    picker = Picker(routing, stale_after_s=5, rng=random.Random(0))
    cands = lambda: picker.candidates([a, b], set(), {})  # noqa: E731
    long = picker.pick(cands(), tokens=8000)
    short = [picker.pick(cands(), tokens=100) for _ in range(3)]  # each lands beside the others, not the long one
    assert {p.replica for p in short} == {a, b} - {long.replica}
    assert long.replica.in_flight_tokens == 8000
    for p in [long, *short]:
        p.release()
    assert a.in_flight_tokens == b.in_flight_tokens == 0 and a.in_flight == b.in_flight == 0


def test_unknown_load_is_not_idle_and_saturation_raises():
    pool = _pool(2)
    fresh, stale = pool.replicas.values()
    fresh.load = Load(at=time.monotonic(), waiting=3, kv_usage=0.5)
    stale.load = Load(at=time.monotonic() - 60)  # idle, but long ago
    picker = Picker(RoutingConfig(), stale_after_s=2)
    pick = picker.pick(picker.candidates([fresh, stale], set(), {}))
    assert pick.replica is fresh
    full = Picker(RoutingConfig(saturation={"max_in_flight": 1}), stale_after_s=2)
    full.pick(full.candidates([stale], set(), {}))
    with pytest.raises(AllSaturated):
        full.pick(full.candidates([stale], set(), {}))


def test_prefix_affinity_outweighs_a_small_load_difference():
    pool = _pool(2)
    a, b = pool.replicas.values()
    a.load, b.load = Load(at=time.monotonic(), waiting=1), Load(at=time.monotonic())
    picker = Picker(RoutingConfig(), stale_after_s=2)
    assert picker.pick(picker.candidates([a, b], set(), {a.url: 1.0})).replica is a


def test_queue_admits_by_priority_then_fair_share():
    async def run():
        q = AdmissionQueue(max_size=10, max_wait_s=5)
        q.in_flight.update({"busy": 5, "quiet": 0})
        order: list[str] = []
        deadline = asyncio.get_running_loop().time() + 5

        async def waiter(name: str, tenant: str, prio: int):
            await q.wait(tenant, prio, None, time.monotonic(), deadline)
            order.append(name)

        tasks = [
            asyncio.create_task(waiter("busy-low", "busy", 0)),
            asyncio.create_task(waiter("quiet-low", "quiet", 0)),
            asyncio.create_task(waiter("busy-high", "busy", 5)),
        ]
        await asyncio.sleep(0.01)
        q.wake_all()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["busy-high", "quiet-low", "busy-low"]


def test_queue_full_and_timeout_are_503_and_the_deadline_504():
    async def run():
        q = AdmissionQueue(max_size=0, max_wait_s=0.05)
        now = time.monotonic
        with pytest.raises(GatewayError) as e:
            await q.wait("t", 0, None, now(), now() + 1)
        assert e.value.status == 503 and e.value.code == "overloaded"
        q.max_size = 1
        t = now()
        with pytest.raises(GatewayError, match="saturated") as e:
            await q.wait("t", 0, None, t, t + 1)
        assert e.value.status == 503 and e.value.code == "queue_timeout" and e.value.headers["Retry-After"] == "1"
        assert 0.04 < now() - t < 0.5
        # woken and waiting again: max_wait_s counts from the first wait, not from the last wake
        queued_at = now() - 0.04
        t = now()
        with pytest.raises(GatewayError, match="saturated"):
            await q.wait("t", 0, 7, queued_at, t + 1)
        assert now() - t < 0.04
        with pytest.raises(GatewayError) as e:  # the request's deadline comes first
            await q.wait("t", 0, None, now(), now() + 0.01)
        assert e.value.status == 504 and e.value.code == "timeout"

    asyncio.run(run())


def test_sse_filter_keeps_bytes_and_takes_back_only_what_forced_usage_added():
    chunk = b'data: {"choices":[{"text":"a, \\"usage\\":null"}],"usage":null}\n\n'
    bare = b'data: {"choices":[{"text":"a, \\"usage\\":null"}]}\n\n'  # as sent without include_usage
    spaced = b'data: {"usage": null, "choices": [{"text": "b"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    done = b"data: [DONE]\n\n"
    stream = chunk + spaced + chunk + usage + done
    for forced in (True, False):
        f = SSEFilter(forced_usage=forced)
        out = b"".join(f.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + f.tail()
        assert out == (bare + b'data: {"choices": [{"text": "b"}]}\n\n' + bare + done if forced else stream)
        assert (f.usage.prompt, f.usage.completion) == (3, 2)


def test_parse_load_reads_inferd_and_vllm_names():
    text = """# TYPE inferd:num_requests_waiting gauge
inferd:num_requests_waiting{model_name="tiny"} 3.0
inferd:num_requests_running{model_name="tiny"} 2.0
inferd:kv_cache_usage_perc{model_name="tiny"} 0.25
# TYPE inferd:prefix_cache_hits counter
inferd:prefix_cache_hits_total{model_name="tiny"} 40.0
vllm:num_requests_waiting{model_name="other"} 1.0
"""
    load = parse_load(text, at=1.0)
    assert (load.waiting, load.running, load.kv_usage, load.prefix_hits) == (4.0, 2.0, 0.25, 40.0)


async def _index_roundtrip(index) -> None:
    tokens = list(range(100))
    hashes = block_hashes(tokens, 16)  # 6 full blocks
    await index.insert("http://a", hashes[:4])
    other = block_hashes([1, *tokens[1:]], 16)  # differs in the first block: the chain matches nothing
    got = await index.match(["http://a", "http://b"], hashes)
    assert got == {"http://a": 4, "http://b": 0}
    assert (await index.match(["http://a"], other)) == {"http://a": 0}
    salted = block_hashes(tokens, 16, salt="tenant-1")
    assert (await index.match(["http://a"], salted)) == {"http://a": 0}
    await index.insert("http://a", other)  # capacity 8: the oldest keys go first
    assert (await index.match(["http://a"], hashes))["http://a"] < 4


def test_memory_prefix_index():
    asyncio.run(_index_roundtrip(MemoryPrefixIndex(capacity_blocks=8)))


@pytest.fixture(scope="module")
def redis_url(logs):
    if redis_binary() is None:
        pytest.skip("redis-server not found on PATH: run `bash scripts/system-deps.sh` (Debian package redis-server)")
    proc = start_redis(logs)
    yield f"redis://127.0.0.1:{proc.port}/0"
    proc.stop()


def test_redis_prefix_index(redis_url):
    import redis.asyncio as aioredis

    async def run():
        r = aioredis.from_url(redis_url)
        try:
            await _index_roundtrip(RedisPrefixIndex(r, "t-pfx", capacity_blocks=8))
        finally:
            await r.aclose()

    asyncio.run(run())


def test_memory_and_redis_budget_stores_agree(redis_url):
    import redis.asyncio as aioredis

    limits = Limits(requests=10, tokens={"total": 100, "cost": 150}, cost={"output": 4.0}, max_concurrent=2)
    steps = [(10, 10, None), (5, 20, (5, 3)), (40, 0, None), (30, 10, (30, 10)), (1, 1, None)]

    async def trace(store) -> list:
        out, open_ = [], []
        for inp, outp, settle_to in steps:
            amounts = amount_vector(limits, inp, outp)
            d = await store.reserve("t", limit_vector(limits), amounts, 60.0, limits.max_concurrent)
            out.append((d.allowed, d.failed, [round(x, 3) for x in d.used]))
            if d.allowed:
                open_.append(d)
                if settle_to is not None:
                    actual = amount_vector(limits, *settle_to)
                    await store.settle("t", d.window_start, [a - b for a, b in zip(actual, amounts, strict=True)])
                    open_.remove(d)
        return out

    async def run():
        r = aioredis.from_url(redis_url)
        try:
            return await trace(MemoryBudgetStore()), await trace(RedisBudgetStore(r, "t-budget"))
        finally:
            await r.aclose()

    mem, red = asyncio.run(run())
    assert mem == red
    # the 3rd fits the cost budget only because the 2nd was settled down to its real usage (175 > 150 if not);
    # the 4th overruns the total tokens (68 + 40 > 100); the 5th fits every budget but finds both
    # concurrency slots taken (the 1st and 3rd are still open)
    assert [a for a, _, _ in mem] == [True, True, True, False, False]
    assert mem[3][1] == 3 and mem[4][1] == 5


def test_gateway_and_server_errors_share_one_body():
    import json

    from inferd.errors import error_body, error_event
    from inferd.server.errors import APIError

    args, kw = (429, "too many \ud800 requests", "rate_limit_error"), {"param": "p", "code": "c"}
    gateway, server = GatewayError(*args, **kw), APIError(*args, **kw)
    assert gateway.body() == server.body == error_body(*args[1:], **kw)
    assert gateway.body()["error"] == {
        "message": "too many \\ud800 requests",
        "type": "rate_limit_error",
        "param": "p",
        "code": "c",
    }
    json.dumps(gateway.body(), ensure_ascii=False).encode("utf-8")  # a lone surrogate would not encode
    assert gateway.sse_event() == error_event(server.body).encode()


def test_prefix_hash_names_a_token_id_that_is_no_int64():
    ids = list(range(16))
    want = hashlib.sha256(b"inferd-prefix-root" + struct.pack("<16q", *ids)).digest()
    assert block_hashes(ids, 16) == [want]  # keys of valid ids are what they were
    for bad in (2**64, 2**63, -(2**63) - 1, 1.5, "a", None):
        with pytest.raises(ValueError, match="token ids are integers") as e:
            block_hashes([*ids[:15], bad], 16)
        assert repr(bad) in str(e.value)


def test_check_prompt_reads_prompts_as_the_server_does():
    assert check_prompt([1.0, "2", True]) == [1, 2, 1]
    assert check_prompt([[5], [6, 7]]) == [[5], [6, 7]]
    with pytest.raises(InvalidRequestError, match=r"prompt\.1\.0: Input should be a valid integer") as e:
        check_prompt([[5], ["x"]])
    assert e.value.param == "prompt.1.0"
    with pytest.raises(InvalidRequestError, match="less than or equal to 9223372036854775807") as e:
        check_prompt([2**64])
    assert e.value.param == "prompt.0"


def test_a_tenants_scheduling_class_goes_only_to_pools_that_rank_requests():
    from inferd.gateway.config import TenantConfig
    from inferd.gateway.service import _scheduling

    tenant = TenantConfig(id="t", api_key_sha256=["0" * 64], engine_priority=-1, ttft_deadline_ms=300)
    pool = lambda policy: PoolConfig(name="p", replicas=["http://127.0.0.1:1"], scheduling_policy=policy)
    assert _scheduling(tenant, pool("fcfs"), {}) == {}  # an fcfs replica refuses both fields
    assert _scheduling(tenant, pool("priority"), {}) == {"priority": -1}
    assert _scheduling(tenant, pool("priority"), {"priority": 4}) == {}  # the request's own stays
    assert _scheduling(tenant, pool("deadline"), {}) == {"ttft_deadline_ms": 300}
    assert _scheduling(None, pool("deadline"), {}) == {}


def test_vtc_admits_the_tenant_served_least_and_idling_banks_no_credit():
    """Under `fairness: vtc` the flooding tenant, which holds fewer requests in flight right now but has been
    served far more tokens, goes after the other; a tenant that was idle starts at the least busy counter."""

    async def run():
        q = AdmissionQueue(max_size=10, max_wait_s=5, fairness="vtc")
        q.charge("flood", 50_000)
        q.charge("steady", 2_000)
        q.in_flight.update({"flood": 1, "steady": 3})  # in_flight fairness would put flood first
        q.served["newcomer"] = 0.0
        order: list[str] = []
        deadline = asyncio.get_running_loop().time() + 5

        async def waiter(tenant: str):
            await q.wait(tenant, 0, None, time.monotonic(), deadline)
            order.append(tenant)

        tasks = [asyncio.create_task(waiter(t)) for t in ("flood", "steady", "newcomer")]
        await asyncio.sleep(0.01)
        assert q.served["newcomer"] == 2_000  # lifted to the least counter among tenants with work
        q.wake_all()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["steady", "newcomer", "flood"]  # newcomer ties steady; steady arrived first
    q = AdmissionQueue(max_size=1, max_wait_s=1, fairness="vtc")
    q.charge("heavy", 600, weight=2.0)  # a weight of 2: half the counter for the same tokens
    assert q.served["heavy"] == 300
