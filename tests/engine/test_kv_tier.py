"""KV tiers behind the block pool: evicted blocks come back from host memory or disk, token-exact, and a damaged
block is recomputed, never read."""

from __future__ import annotations

import random

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.kv_publisher import KVEventRecorder
from inferd.engine.kv_tier import DISK, HOST, Evicted, KVTiers
from inferd.errors import ConfigError
from inferd.kv_events import BlockRemoved, BlockStored, CacheMirror
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def _chats(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def _llm(model, **kw) -> LLM:
    # 16 blocks of 16 tokens: four 60-token prompts (4 blocks each, with their outputs) fill the pool
    return LLM(str(model), max_model_len=128, dtype="float32", num_blocks=16, block_size=BLOCK, **kw)


def _tiers(llm: LLM) -> KVTiers:
    assert llm.engine.kv.tiers is not None
    return llm.engine.kv.tiers


def _host_bytes(llm: LLM, blocks: int) -> int:
    from inferd.engine.runner import ModelRunner

    e = llm.engine
    return blocks * ModelRunner.bytes_per_block(e.model, BLOCK, e.kv_dtype)


def _rounds(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt once (later ones evict earlier ones from the 16-block pool), then every prompt again."""
    outs = [llm.generate([p], GREEDY)[0] for p in prompts + prompts]
    return [o.outputs[0].token_ids for o in outs], [o.metrics.num_cached_tokens for o in outs]


def test_evicted_blocks_come_back_from_host_memory_token_exact(tiny_model):
    prompts = _chats(6, 60, seed=1)
    ref = [hf_greedy(tiny_model, tuple(p), 8).token_ids for p in prompts]
    with _llm(tiny_model, enable_prefix_caching=True) as plain:
        host = _host_bytes(plain, 64)
        plain_out, plain_cached = _rounds(plain, prompts)
    with _llm(tiny_model, kv_offload_memory=host) as llm:
        out, cached = _rounds(llm, prompts)
        tier = _tiers(llm).tiers[0]
        assert tier.medium == HOST
        assert out == plain_out == ref + ref
        # the second round finds every prompt's 3 full blocks (the 4th holds the last token) in the host tier
        assert cached[6:] == [48] * 6 and sum(plain_cached[6:]) < sum(cached[6:])
        assert tier.stats.hits > 0 and tier.stats.stored > 0 and tier.stats.checksum_failures == 0
        assert llm.engine.kv.stats.hits >= 6 * 48
        assert_idle(llm)


def test_a_full_host_tier_demotes_to_disk_and_disk_hits_are_exact(tiny_models, tmp_path):
    model = tiny_models["gemma3"]
    prompts = _chats(8, 60, seed=2)
    path = tmp_path / "kv" / "tier.bin"
    with _llm(model) as plain:
        plain_out, _ = _rounds(plain, prompts)
        host, disk = _host_bytes(plain, 6), _host_bytes(plain, 128)
    with _llm(model, kv_offload_memory=host, kv_offload_disk=str(path), kv_offload_disk_memory=disk) as llm:
        assert path.stat().st_size == disk
        out, cached = _rounds(llm, prompts)
        host_tier, disk_tier = _tiers(llm).tiers
        assert disk_tier.medium == DISK
        assert out == plain_out
        assert cached[8:] == [48] * 8
        assert host_tier.stats.demoted > 0 and disk_tier.stats.stored == host_tier.stats.demoted
        assert disk_tier.stats.hits > 0
        # a key lives in one tier only
        assert not set(host_tier.entries) & set(disk_tier.entries)
        assert_idle(llm)
    assert not path.exists()  # the engine removes its tier file when it closes


def test_a_damaged_block_is_dropped_and_recomputed(tiny_models, tmp_path):
    model = tiny_models["llama"]
    prompts = _chats(6, 60, seed=3)
    with _llm(model) as plain:
        plain_out, _ = _rounds(plain, prompts)
        host = _host_bytes(plain, 64)
    with _llm(model, kv_offload_memory=host) as llm:
        first = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
        tier = _tiers(llm).tiers[0]
        assert tier.entries
        tier.data[:, 0, 0, 0] += 1  # every stored block damaged
        again = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert first + [o.outputs[0].token_ids for o in again] == plain_out
        assert tier.stats.checksum_failures > 0
        # the first prompt's blocks were damaged and dropped: recomputed, not read
        assert again[0].metrics.num_cached_tokens == 0
        assert_idle(llm)


def test_fp8_cache_blocks_round_trip_as_bytes(tiny_models):
    model = tiny_models["qwen2"]
    prompts = _chats(6, 60, seed=4)
    with _llm(model, kv_cache_dtype="fp8") as plain:
        plain_out, _ = _rounds(plain, prompts)
        host = _host_bytes(plain, 64)
    with _llm(model, kv_cache_dtype="fp8", kv_offload_memory=host) as llm:
        out, cached = _rounds(llm, prompts)
        assert out == plain_out and cached[6:] == [48] * 6


def test_tier_moves_are_kv_events_with_their_medium(tiny_models):
    events = {
        "enable_kv_cache_events": True,
        "kv_events_endpoint": "tcp://127.0.0.1:*",
        "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
    }
    model = tiny_models["llama"]
    with _llm(model) as plain:
        host = _host_bytes(plain, 64)
    with _llm(model, kv_offload_memory=host, **events) as llm:
        mirror, pub = CacheMirror(BLOCK), llm.engine.kv_events
        publish = pub.publish
        pub.publish = lambda events: (mirror.apply(events), publish(events))
        for p in _chats(6, 60, seed=5):
            llm.generate([p], GREEDY)
        sent = llm.engine.kv.snapshot_events()
        rebuilt = CacheMirror(BLOCK)
        rebuilt.apply(sent)
        assert set(rebuilt.media) == {"CPU", HOST}
        assert rebuilt.media == {m: b for m, b in mirror.media.items() if b}
        assert set(rebuilt.media[HOST]) == set(_tiers(llm).tiers[0].entries)


def test_offload_and_pin_bookkeeping():
    """Unit level: the host tier's LRU demotes to the disk tier, pinned entries stay, events follow."""
    caches = [(torch.arange(8 * 4, dtype=torch.float32).view(8, 2, 1, 2).clone(), torch.zeros(8, 2, 1, 2))]
    recorder = KVEventRecorder(2, "CPU")
    tiers = KVTiers.build(lambda: caches, host_blocks=2, events=recorder)
    key = lambda i: i.to_bytes(8, "little")  # noqa: E731
    ev = lambda i: Evicted(i, key(i), (i, i), None, None)  # noqa: E731
    tiers.offload([ev(0), ev(1)])
    first = tiers.lookup([key(0)], lambda i: (0, 0))
    with tiers.pin(first):
        tiers.offload([ev(2)])  # full: the LRU entry not pinned (block 1) goes
    assert set(tiers.tiers[0].entries) == {key(0), key(2)}
    assert tiers.load(first, [7])
    assert torch.equal(caches[0][0][7], caches[0][0][0])
    stored = [e.block_hashes[0] for e in recorder.events if isinstance(e, BlockStored)]
    removed = [h for e in recorder.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored == [key(0), key(1), key(2)] and removed == [key(1)]
    assert {e.medium for e in recorder.events} == {HOST}


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kv_offload_disk": "/tmp/x.bin"}, "needs both"),
        ({"kv_offload_disk_memory": 1 << 30}, "needs both"),
        ({"kv_offload_memory": 1 << 30, "enable_prefix_caching": False}, "prefix caching"),
        ({"kv_offload_memory": 10}, "at least one block"),
    ],
)
def test_bad_tier_settings_are_clear_errors(tiny_models, settings, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=16, **settings)


def test_tier_counters_on_the_metrics_endpoint(tiny_models):
    import httpx

    from tests.server.conftest import MODEL_NAME, start_server
    from tests.server.test_lifecycle import scrape, value

    server = start_server(
        tiny_models["llama"], max_model_len=128, num_blocks=16, block_size=BLOCK, kv_offload_memory=64 << 20
    )
    try:
        for prompt in _chats(6, 60, seed=6) * 2:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        after = scrape(server)
        assert value(after, "inferd:kv_tier_hits_total", medium=HOST) > 0
        assert value(after, "inferd:kv_tier_stored_total", medium=HOST) > 0
        assert value(after, "inferd:kv_tier_blocks", medium=HOST) > 0
        assert value(after, "inferd:kv_tier_capacity_blocks", medium=HOST) > 0
        assert value(after, "inferd:kv_tier_checksum_failures_total", medium=HOST) == 0
    finally:
        server.stop()
