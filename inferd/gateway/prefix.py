"""Prefix affinity: which replica already holds a request's prompt prefix in its KV cache.

The keys are the engine's own (`inferd.prefix_hash.block_hashes`, with the pool's block size and the
request's `cache_salt`), so a key the gateway remembers for a replica is a key that replica's prefix
cache computed for the same tokens. Each replica gets an LRU index of the block keys the gateway has
sent there; a request's score on a replica is the fraction of its full blocks found there, counted
from the first block (the chain means a miss ends the match). The index lives in process memory, or
in Redis (a sorted set per replica, scored by last use) so several gateway processes share it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from inferd.gateway.store import StoreGuard, StoreUnavailable
from inferd.prefix_hash import BlockHash


class MemoryPrefixIndex:
    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._by_replica: dict[str, OrderedDict[BlockHash, None]] = {}

    async def match(self, replicas: Sequence[str], hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each replica, how many leading blocks of `hashes` it holds."""
        out = {}
        for url in replicas:
            lru = self._by_replica.get(url)
            n = 0
            if lru is not None:
                while n < len(hashes) and hashes[n] in lru:
                    n += 1
            out[url] = n
        return out

    async def insert(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        lru = self._by_replica.setdefault(replica, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    async def forget(self, replica: str) -> None:
        """A replica that restarted or left lost its cache."""
        self._by_replica.pop(replica, None)

    def holds(self, replica: str, key: BlockHash) -> bool:
        """Whether the key was sent to the replica lately (what its cache is worth: inferd/gateway/cache_worth.py)."""
        lru = self._by_replica.get(replica)
        return lru is not None and key in lru


class RedisPrefixIndex:
    """The same index in Redis: ZSET `{prefix}:pfx:{replica}` of block keys scored by last use.

    The index is a hint: while Redis does not answer, requests are routed without it (no match, nothing
    remembered), and for one timeout after each failure it is not asked at all, so a frozen Redis costs a
    request at most one timeout."""

    def __init__(self, redis, prefix: str, capacity_blocks: int):
        self.redis = redis
        self.prefix = prefix
        self.capacity = capacity_blocks
        self.guard = StoreGuard("prefix index", redis)

    async def _run(self, call, default):
        if self.guard.resting():
            return default
        try:
            return await self.guard.run(call)
        except StoreUnavailable:
            return default

    def _key(self, replica: str) -> str:
        return f"{self.prefix}:pfx:{replica}"

    async def match(self, replicas: Sequence[str], hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not hashes:
            return {u: 0 for u in replicas}
        pipe = self.redis.pipeline(transaction=False)
        for url in replicas:
            pipe.zmscore(self._key(url), list(hashes))
        found = await self._run(pipe.execute, None)
        if found is None:
            return {u: 0 for u in replicas}
        out = {}
        for url, scores in zip(replicas, found, strict=True):
            n = 0
            while n < len(hashes) and scores[n] is not None:
                n += 1
            out[url] = n
        return out

    async def insert(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        key = self._key(replica)
        now = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(key, {h: now + i * 1e-6 for i, h in enumerate(hashes)})
        pipe.zremrangebyrank(key, 0, -self.capacity - 1)
        await self._run(pipe.execute, None)

    async def forget(self, replica: str) -> None:
        await self._run(lambda: self.redis.delete(self._key(replica)), None)

    def holds(self, replica: str, key: BlockHash) -> bool:
        """Not known without a round trip per key: a replica without KV events counts as holding nothing unique
        (its cache's worth is 0 to a scale-down)."""
        return False
