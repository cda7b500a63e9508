"""The block pool and the KV cache manager.

K/V for every token lives in fixed-size blocks. A request owns a list of block ids (its block table).
With prefix caching, every *full* block is keyed by a chained hash of its tokens (`inferd.prefix_hash`),
so a later request with the same prefix can take the blocks instead of recomputing them. A freed block keeps its hash
until the pool hands it out again, which is what makes it reusable after its request is gone. With KV tiers
(`inferd.engine.kv_tier`), a block handed out again is first copied to host memory or disk, and a prefix lookup
that runs out in the pool goes on there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferd.engine.kv_tier import Evicted, KVTiers, TierEntry
from inferd.prefix_hash import BlockHash, extend_block_hashes
from inferd.request import Request
from inferd.sampling import SamplingParams

if TYPE_CHECKING:
    from inferd.engine.kv_publisher import KVEventRecorder
    from inferd.kv_events import KVCacheEvent


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # stored with the hash so a hit is checked, not trusted
    parent_hash: BlockHash | None = None  # the previous block's key (for KV events' snapshots)
    lora_name: str | None = None  # the adapter it was computed under (for KV events)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Ref-counted blocks, an LRU queue of free ones, and the hash index of cached full blocks.

    Free blocks that hold no cached data sit at the front of the queue so they are reused before
    any block that could still give a prefix hit.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventRecorder | None = None):
        if num_blocks < 1:
            raise ValueError("the block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events  # told of every key that enters or leaves the index (inferd/engine/kv_publisher.py)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self.tiers: KVTiers | None = None  # where evicted blocks go (KVCacheManager.attach_tiers)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """In eviction order (first = next to be reused)."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out, evicted = [], []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if self.tiers is not None and block.block_hash is not None and self._cached.get(block.block_hash) is block:
                evicted.append(Evicted(block_id, block.block_hash, block.token_ids, block.parent_hash, block.lora_name))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:  # their K/V is still in place: the next forward pass writes over it
            self.tiers.offload(evicted)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block, in the given order (pass a sequence tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(
        self,
        block: Block,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
        lora_name: str | None = None,
    ) -> bool:
        """Index a full block under its key; False if it was not (caching off, already keyed, or the same
        content already lives in another block, which stays the one indexed)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash, block.lora_name = parent, lora_name
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = ()

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no request holds; True when the index is left empty."""
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
        if self.tiers is not None:
            self.tiers.clear()
        return not self._cached

    def snapshot(self) -> dict[BlockHash, tuple[BlockHash | None, list[int], str | None]]:
        """Every indexed block: key -> (parent key, token ids, adapter)."""
        return {k: (b.parent_hash, list(b.token_ids), b.lora_name) for k, b in self._cached.items()}

    def check_idle(self) -> None:
        """Every block free (ref count 0) and in the free queue exactly once: nothing leaked."""
        leaked = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if leaked:
            raise AssertionError(f"blocks still referenced while idle: {leaked[:10]}")
        if len(self._free) != self.num_blocks:
            raise AssertionError(f"free queue holds {len(self._free)} of {self.num_blocks} blocks")


@dataclass
class ComputedBlocks:
    """Blocks found in the prefix cache for a new request, and how many tokens they cover: the pool's blocks,
    then entries of the KV tiers that continue them (copied into new blocks when the request is admitted)."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0
    offloaded: list[TierEntry] = field(default_factory=list)


class KVCacheManager:
    """Maps requests to blocks: prefix lookup, allocation for the next tokens, and freeing."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, events: KVEventRecorder | None = None
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.events = events
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self._num_hashed: dict[str, int] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # per request, computed once per full block
        self.stats = PrefixCacheStats()
        self.tiers: KVTiers | None = None

    def attach_tiers(self, tiers: KVTiers | None) -> None:
        """Keep evicted blocks in these tiers and look prefixes up there after the pool."""
        self.tiers = self.pool.tiers = tiers if self.enable_caching else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fit(self, lengths: Sequence[int]) -> tuple[int, int]:
        """Requests of these lengths allocated in order, in an empty cache the size of this one (no prefix
        caching; this one is not touched), until one does not fit: (how many fit, blocks they hold)."""
        kv = KVCacheManager(self.num_blocks, self.block_size, enable_caching=False)
        for fitted, n in enumerate(lengths):
            if not kv.allocate_slots(Request(f"r{fitted}", "r", 0, list(range(n)), SamplingParams(), frozenset()), n):
                break
        else:
            fitted = len(lengths)
        return fitted, kv.num_blocks - kv.pool.num_free_blocks

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from its `start`-th block on."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            tokens = request.prompt_token_ids + request.output_token_ids
            extend_block_hashes(hashes, tokens, self.block_size, request.prefix_salt)
        return hashes

    def find_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of full blocks. The last token is always left to compute."""
        if not self.enable_caching:
            return ComputedBlocks()
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        offloaded: list[TierEntry] = []
        if self.tiers is not None and len(hits) < max_blocks:
            first, bs = len(hits), self.block_size
            offloaded = self.tiers.lookup(
                hashes[first:max_blocks], lambda i: request.token_ids_slice((first + i) * bs, (first + i + 1) * bs)
            )
        return ComputedBlocks(hits, (len(hits) + len(offloaded)) * self.block_size, offloaded)

    def record_lookup(self, request: Request, computed: ComputedBlocks) -> None:
        """Count a prefix lookup once its request is admitted (a failed admission is retried)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += computed.num_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None, num_lookahead: int = 0
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`, and `num_lookahead` slots past them (the
        runner's own drafts, written after the step: never cached). False (and no change) if it can't."""
        computed = computed or ComputedBlocks()
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens + num_lookahead) - len(blocks) - len(computed.blocks)
        # cached blocks that sit in the free queue stop being allocatable once we take them
        num_reclaimed = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(computed.blocks)
        new = self._allocate(max(num_new_blocks, 0), computed)
        if new is None:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        blocks.extend(computed.blocks)
        blocks.extend(new)
        self._cache_full_blocks(request, blocks, total_tokens)
        return True

    def _allocate(self, n: int, computed: ComputedBlocks) -> list[Block] | None:
        """n new blocks, the first of them filled from the KV tiers' entries `computed.offloaded`. None if one of
        those failed its checksum: nothing is taken (the computed blocks are let go again) and the next lookup
        goes without the dropped entry."""
        offloaded = computed.offloaded
        if not offloaded:
            return self.pool.allocate(n)
        with self.tiers.pin(offloaded):  # the allocation offloads evicted blocks, which must not push these out
            new = self.pool.allocate(n)
        if self.tiers.load(offloaded, [b.block_id for b in new[: len(offloaded)]]):
            return new
        self.pool.free(reversed(new))
        self.pool.free(reversed(computed.blocks))
        return None

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        """Register blocks that will be full after this step under their hashes.

        Registering before the forward pass is safe: within a layer every token's K/V is written
        before any attention reads, so a request scheduled in the same step that hits these
        blocks reads the values being written.
        """
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        run: list[int] = []  # blocks indexed just now, in a row: one BlockStored event each run
        for i in range(start, num_full):
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            parent = hashes[i - 1] if i else None
            if self.pool.cache_block(blocks[i], hashes[i], tokens, parent, request.lora_name):
                run.append(i)
            elif run:
                self._stored(request, hashes, run)
                run = []
        if run:
            self._stored(request, hashes, run)
        self._num_hashed[request.request_id] = num_full

    def _stored(self, request: Request, hashes: list[BlockHash], run: list[int]) -> None:
        if self.events is not None:
            first, last = run[0], run[-1] + 1
            tokens = request.token_ids_slice(first * self.block_size, last * self.block_size)
            self.events.stored(hashes[first:last], hashes[first - 1] if first else None, tokens, request.lora_name)

    # -- blocks filled or read from outside (inferd.engine.kv_connector) --------------------------------
    def allocate_for_load(self, request: Request, computed: ComputedBlocks, num_external_tokens: int) -> bool:
        """Blocks for a prefix hit plus tokens a KV connector will load. The loaded blocks enter the prefix
        cache only once the request is scheduled after the load succeeded (by allocate_slots)."""
        num_new = self.blocks_needed(computed.num_tokens + num_external_tokens) - len(computed.blocks)
        num_reclaimed = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        if num_new > self.pool.num_free_blocks - num_reclaimed:
            return False
        self.pool.touch(computed.blocks)
        new = self._allocate(max(num_new, 0), computed)
        if new is None:
            return False
        self.req_blocks[request.request_id] = list(computed.blocks) + new
        return True

    def hand_over(self, request: Request) -> list[Block]:
        """Forget a finished request but keep its block references; the caller frees them (release_blocks)."""
        self._num_hashed.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, [])

    def release_blocks(self, blocks: list[Block]) -> None:
        self.pool.free(reversed(blocks))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        # tail first, so the LRU queue evicts the end of a sequence before its shared head
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def snapshot_events(self) -> list[KVCacheEvent]:
        """The whole cache as KV events: AllBlocksCleared, then every indexed block (a resync)."""
        from inferd.kv_events import snapshot_events

        media = {self.events.medium if self.events else None: self.pool.snapshot()}
        if self.tiers is not None:
            media |= self.tiers.snapshot()
        return snapshot_events(media, self.block_size)

    def check_idle(self) -> None:
        if self.req_blocks:
            raise AssertionError(f"requests still hold blocks: {list(self.req_blocks)[:5]}")
        self.pool.check_idle()
