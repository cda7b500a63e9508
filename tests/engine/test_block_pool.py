"""Block pool and KV cache manager: ref counts, LRU order, prefix hashes, no leaks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.kv_cache import BlockPool, KVCacheManager
from inferd.prefix_hash import hash_block_tokens
from inferd.request import Request
from inferd.sampling import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, rid, 0, tokens, SamplingParams(max_tokens=4), frozenset({1}), cache_salt=salt)


def test_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a, b])
    assert pool.num_free_blocks == 4
    pool.check_idle()


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])


def test_cannot_allocate_more_than_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_lru_order_and_uncached_blocks_go_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:2]):
        pool.cache_block(b, hash_block_tokens(None, [i]), [i])
    pool.free([blocks[0]])  # cached
    pool.free([blocks[1]])  # cached, freed later: more recently used
    pool.free([blocks[2]])  # holds nothing reusable: reused first
    pool.free([blocks[3]])
    assert pool.free_block_ids() == [3, 2, 0, 1]
    # allocation evicts in that order, dropping the hash of a reused cached block
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [3, 2, 0]
    assert taken[2].block_hash is None
    assert pool.lookup(hash_block_tokens(None, [0]), [0]) is None
    assert pool.lookup(hash_block_tokens(None, [1]), [1]) is blocks[1]


def test_hit_is_checked_against_stored_tokens():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is a
    assert pool.lookup(h, [1, 3]) is None  # same key, other tokens (a collision): no hit


def test_hash_is_stable_across_processes():
    code = "from inferd.prefix_hash import hash_block_tokens as h; print(h(h(None, [1, 2]), [3, 4], 's').hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)}
    assert len(outs) == 1
    assert outs.pop().strip() == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4], "s").hex()


def test_prefix_hit_shares_blocks_and_skips_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10, 22)))  # 12 tokens: 3 full blocks
    assert kv.allocate_slots(a, a.num_tokens)
    b = _req("b", list(range(10, 22)))  # identical prompt: the last block must still be computed
    hit = kv.find_computed_blocks(b)
    assert hit.num_tokens == 8 and [x.block_id for x in hit.blocks] == kv.block_ids("a")[:2]
    c = _req("c", list(range(10, 20)) + [99, 98, 97])  # shares 2 full blocks + a partial one
    assert kv.find_computed_blocks(c).num_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    kv.check_idle()


def test_freed_blocks_keep_hash_until_reused():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(3, 12)))
    kv.allocate_slots(a, a.num_tokens)
    kv.free(a)
    b = _req("b", list(range(3, 12)))
    assert kv.find_computed_blocks(b).num_tokens == 8


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(3, 12)), salt="tenant-a")
    kv.allocate_slots(a, a.num_tokens)
    assert kv.find_computed_blocks(_req("b", list(range(3, 12)), salt="tenant-b")).num_tokens == 0
    assert kv.find_computed_blocks(_req("c", list(range(3, 12)))).num_tokens == 0
    assert kv.find_computed_blocks(_req("d", list(range(3, 12)), salt="tenant-a")).num_tokens == 8


def test_eviction_takes_tail_before_head():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _req("a", [5, 6, 7, 8, 9, 10])
    kv.allocate_slots(a, 6)
    ids = kv.block_ids("a")
    kv.free(a)
    assert kv.pool.free_block_ids() == [ids[2], ids[1], ids[0]]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = _req("a", [5, 6, 7, 8, 9])
    assert not kv.allocate_slots(a, 5)
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks
    kv.check_idle()


# -- properties ---------------------------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 9)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_interleavings_never_leak(ops, caching):
    """Any sequence of allocate/grow/free leaves every block free and no block in use twice."""
    kv = KVCacheManager(num_blocks=12, block_size=2, enable_caching=caching)
    live: dict[str, Request] = {}
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "add" and rid not in live:
            r = _req(rid, [3 + (who + i) % 4 for i in range(n)])  # overlapping prompts: prefix hits happen
            hit = kv.find_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit):
                r.num_computed_tokens = r.num_tokens
                live[rid] = r
        elif op == "grow" and rid in live:
            r = live[rid]
            r.output_token_ids.append(3 + n % 4)
            if kv.allocate_slots(r, 1):
                r.num_computed_tokens += 1
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        used = [b for ids in kv.req_blocks.values() for b in ids]
        refs = {}
        for b in used:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in kv.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0)
        assert kv.pool.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    for r in list(live.values()):
        kv.free(r)
    kv.check_idle()


def test_fit_counts_the_requests_an_empty_cache_of_this_size_holds_and_leaves_this_one_alone():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    kv.allocate_slots(Request("busy", "r", 0, list(range(40)), SamplingParams(), frozenset()), 40)
    assert kv.fit([16, 17, 33]) == (3, 6)  # 1 + 2 + 3 blocks
    assert kv.fit([100, 100]) == (1, 7)  # the second needs 7 more of the 3 left
    assert kv.fit([]) == (0, 0) and kv.num_blocks_of("busy") == 3 and kv.pool.num_free_blocks == 7
