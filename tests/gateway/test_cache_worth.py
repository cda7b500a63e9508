"""What a replica's cache is worth to a scale-down: tokens of recently asked prefixes that only it holds."""

from __future__ import annotations

from inferd.gateway.cache_worth import RecentBlocks, unique_recent_tokens


def test_only_prefixes_one_replica_alone_holds_count_for_it():
    held = {"a": {1, 2, 3}, "b": {2, 4}, "c": set()}
    recent = {1: 64, 2: 64, 4: 128}  # 3 was not asked for lately
    worth = unique_recent_tokens(["a", "b", "c"], lambda r, key: key in held[r], recent)
    assert worth == {"a": 64, "b": 128, "c": 0}  # 2 is held twice: losing either copy costs nothing


def test_recent_blocks_keep_the_last_use_of_the_newest_keys():
    recent = RecentBlocks(capacity=3)
    recent.touch([1, 2], now=10.0)
    recent.touch([3], now=20.0)
    recent.touch([1], now=30.0)  # asked again: now the newest
    assert recent.since(15.0) == [1, 3] and recent.since(0.0) == [1, 3, 2]
    recent.touch([4], now=40.0)  # over capacity: the least recently asked (2) leaves
    assert recent.since(0.0) == [4, 1, 3]
