"""More KV tiers behind the block pool: evicted blocks kept in host memory, then in a memory-mapped file.

A prefix cache is bounded by its pool: once the working set (many chats with growing histories, agents' long shared
contexts) outgrows it, evicted prefixes are recomputed. Copying a block back costs microseconds; recomputing its tokens
costs a forward pass over them. So blocks the pool evicts are kept, by their keys (`inferd.prefix_hash`), in larger
and slower stores, as vLLM's CPU offloading, SGLang's HiCache and Dynamo's KVBM do:

- **Write-back on eviction.** When the pool hands out a free block that still indexes a prefix, that block's K/V is
  copied into the first tier before the block is reused. The step is schedule-then-run on one thread, so at that
  moment the block holds exactly the K/V of its key (everything the last forward pass wrote); nothing is copied for
  blocks that are never evicted.
- **Load on a hit.** A prefix lookup that runs out in the pool goes on in the tiers; the blocks found there are
  copied into freshly allocated blocks while the request is admitted, so it is scheduled in the same step with them
  counted as computed (and as `cached_tokens`). The tiers' entries stay (inclusive), so evicting that block again
  costs no copy.
- **LRU, demoting.** A full tier moves its least recently used entry to the next tier (host -> disk), or drops it
  from the last. Entries in use by an admission in progress are pinned. A key lives in at most one tier: a block
  offloaded again while its key sits on disk goes to host memory and leaves the disk.
- **Checked.** Every entry carries a CRC-32 of its bytes, computed when stored and checked before a load: a block
  whose bytes no longer match (a damaged file, a stray write) is dropped and counted, the admission is retried at
  the next step without it, and its tokens are recomputed.
- **Observable.** Each tier reports stored/removed blocks as KV events with its own medium (`HOST`, `DISK`), so an
  indexer knows where a block lives; `/metrics` counts hits, stores, demotions and failures per tier.

Each tier is one uint8 tensor of [slots, layers, 2 (K, V), block bytes]: a block is contiguous (one checksum, one
sequential read from disk). Copies see blocks as 32-bit words where the rows allow it (torch's index ops move bytes
one at a time, six times slower here), so fp8 caches are copied as the bytes they are.

On a CPU engine the pool itself is host memory, so a host tier of N GiB does about what N more GiB of
`--kv-cache-memory` would, plus a copy per load; its use there is the disk tier behind it, and on a GPU engine it is
the tier that holds what device memory cannot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferd.disagg.transport import as_words
from inferd.prefix_hash import BlockHash

if TYPE_CHECKING:
    from inferd.engine.kv_publisher import KVEventRecorder

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
HOST, DISK = "HOST", "DISK"  # the tiers' KV event media (the pool's own is CPU or GPU)


@dataclass(eq=False)
class TierEntry:
    """One block kept in a tier: where, what it holds, and its bytes' checksum."""

    key: BlockHash
    slot: int
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    lora_name: str | None
    checksum: int = 0
    tier: TierStore | None = None


@dataclass(frozen=True)
class Evicted:
    """A block the pool is about to reuse, while it still holds the K/V of `key`."""

    block_id: int
    key: BlockHash
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    lora_name: str | None


@dataclass
class TierStats:
    """Counters per tier, read by /metrics."""

    capacity: int
    hits: int = 0  # blocks loaded from this tier into the pool
    stored: int = 0  # blocks written into this tier (offloaded or demoted into it)
    demoted: int = 0  # blocks moved on to the next tier
    dropped: int = 0  # blocks dropped when full (the last tier) or when the key went up a tier
    checksum_failures: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    blocks: int = 0  # held now


class TierStore:
    """`capacity` block slots in one tensor (host memory, or a file mapped into memory), LRU by key."""

    def __init__(self, medium: str, capacity: int, block_shape: tuple[int, int, int], path: Path | None = None):
        if capacity < 1:
            raise ValueError(f"a KV tier needs at least one block, got {capacity}")
        self.medium = medium
        self.capacity = capacity
        self.path = path
        shape = (capacity, *block_shape)
        if path is None:
            self.data = torch.empty(shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        else:
            nbytes = capacity * block_shape[0] * block_shape[1] * block_shape[2]
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:  # a fresh, sparse file: what an earlier run left is not trusted
                f.truncate(nbytes)
            self.data = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8).view(shape)
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.stats = TierStats(capacity)

    def touch(self, entry: TierEntry) -> None:
        self.entries.move_to_end(entry.key)

    def victim(self, pinned: set[BlockHash]) -> TierEntry | None:
        """The least recently used entry not pinned, if any."""
        return next((e for k, e in self.entries.items() if k not in pinned), None)

    def take_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def add(self, entry: TierEntry) -> None:
        entry.tier = self
        self.entries[entry.key] = entry
        self.stats.blocks = len(self.entries)

    def remove(self, entry: TierEntry) -> None:
        del self.entries[entry.key]
        self._free.append(entry.slot)
        entry.tier = None
        self.stats.blocks = len(self.entries)

    def checksum(self, slot: int) -> int:
        return zlib.crc32(self.data[slot].numpy())

    def close(self) -> None:
        self.entries.clear()
        self.data = torch.empty(0, dtype=torch.uint8)
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


@dataclass
class KVTiers:
    """The tiers behind one block pool, first (fastest) to last; owned by the KV cache manager."""

    tiers: list[TierStore]
    caches: Callable[[], KVCaches]  # the pool's tensors, per layer (K, V) [blocks, block_size, heads, dim]
    events: KVEventRecorder | None = None
    pinned: set[BlockHash] = field(default_factory=set)
    word: torch.dtype = torch.uint8  # the widest unit both the pool's rows and the tiers' split into

    @classmethod
    def build(
        cls,
        caches: Callable[[], KVCaches],
        host_blocks: int,
        disk_blocks: int = 0,
        disk_path: str | Path | None = None,
        events: KVEventRecorder | None = None,
    ) -> KVTiers | None:
        """Tiers for a pool with these caches: `host_blocks` in memory, then `disk_blocks` in a file at
        `disk_path`; None if both are 0."""
        kv = caches()
        k = kv[0][0]
        block_shape = (len(kv), 2, k[0].numel() * k.element_size())
        tiers = []
        if host_blocks > 0:
            tiers.append(TierStore(HOST, host_blocks, block_shape))
        if disk_blocks > 0:
            if disk_path is None:
                raise ValueError("a disk KV tier needs a file path")
            tiers.append(TierStore(DISK, disk_blocks, block_shape, Path(disk_path)))
        return cls(tiers, caches, events, word=as_words(k).dtype) if tiers else None

    def describe(self) -> str:
        mib = lambda t: t.data.numel() / 1024**2  # noqa: E731
        return ", ".join(
            f"{t.medium} {t.capacity} blocks ({mib(t):.0f} MiB{f' in {t.path}' if t.path else ''})" for t in self.tiers
        )

    # -- from the pool: blocks about to be reused -----------------------------------------------------
    @torch.inference_mode()
    def offload(self, evicted: Sequence[Evicted]) -> None:
        """Keep the K/V of blocks the pool evicts, in the first tier (copied before the pool reuses them)."""
        first = self.tiers[0]
        todo: list[tuple[Evicted, TierEntry]] = []
        for e in evicted:
            held = self._find(e.key)
            if held is not None and (held.tier is first or held.key in self.pinned):
                held.tier.touch(held)  # inclusive: a block loaded from a tier is evicted again at no cost
                continue
            if held is not None:  # on disk: it comes back up to the faster tier
                self._drop(held, demoted=False)
            slot = self._slot(0)
            if slot is None:
                continue  # every entry pinned by the admission in progress: this block is not kept
            entry = TierEntry(e.key, slot, e.token_ids, e.parent, e.lora_name)
            todo.append((e, entry))
        if not todo:
            return
        t0 = time.perf_counter()
        self._copy_in(first, [e.block_id for e, _ in todo], [entry.slot for _, entry in todo])
        for _, entry in todo:
            entry.checksum = first.checksum(entry.slot)
            first.add(entry)
            self._stored(first, entry)
        first.stats.stored += len(todo)
        first.stats.store_seconds += time.perf_counter() - t0

    def _find(self, key: BlockHash) -> TierEntry | None:
        for tier in self.tiers:
            entry = tier.entries.get(key)
            if entry is not None:
                return entry
        return None

    def _slot(self, i: int) -> int | None:
        """A free slot in tier i, making room by demoting or dropping its least recently used entry."""
        tier = self.tiers[i]
        slot = tier.take_slot()
        if slot is not None:
            return slot
        victim = tier.victim(self.pinned)
        if victim is None:
            return None
        if i + 1 < len(self.tiers):
            self._demote(victim, i + 1)
        else:
            self._drop(victim, demoted=False)
        return tier.take_slot()

    def _demote(self, entry: TierEntry, i: int) -> None:
        src, dst = entry.tier, self.tiers[i]
        slot = self._slot(i)
        if slot is None:
            self._drop(entry, demoted=False)
            return
        t0 = time.perf_counter()
        dst.data[slot].copy_(src.data[entry.slot])
        self._drop(entry, demoted=True)
        moved = TierEntry(entry.key, slot, entry.token_ids, entry.parent, entry.lora_name, entry.checksum)
        dst.add(moved)
        self._stored(dst, moved)
        dst.stats.stored += 1
        dst.stats.store_seconds += time.perf_counter() - t0

    def _drop(self, entry: TierEntry, demoted: bool) -> None:
        tier = entry.tier
        tier.remove(entry)
        if demoted:
            tier.stats.demoted += 1
        else:
            tier.stats.dropped += 1
        if self.events is not None:
            self.events.removed(entry.key, tier.medium)

    def _stored(self, tier: TierStore, entry: TierEntry) -> None:
        if self.events is not None:
            self.events.stored([entry.key], entry.parent, list(entry.token_ids), entry.lora_name, tier.medium)

    # -- from the KV cache manager: prefix hits beyond the pool ----------------------------------------
    def lookup(self, keys: Sequence[BlockHash], token_ids: Callable[[int], Sequence[int]]) -> list[TierEntry]:
        """The entries holding keys[0], keys[1], ... in a row (token_ids(i): the i-th block's tokens)."""
        out = []
        for i, key in enumerate(keys):
            entry = self._find(key)
            if entry is None or entry.token_ids != tuple(token_ids(i)):
                break
            out.append(entry)
        return out

    @contextlib.contextmanager
    def pin(self, entries: Sequence[TierEntry]) -> Iterator[None]:
        """Keep `entries` in place while blocks are allocated for them (the allocation offloads, which may
        demote or drop)."""
        keys = {e.key for e in entries}
        self.pinned |= keys
        try:
            yield
        finally:
            self.pinned -= keys

    @torch.inference_mode()
    def load(self, entries: Sequence[TierEntry], block_ids: Sequence[int]) -> bool:
        """Copy the entries' K/V into the pool's blocks (allocated for them while they were pinned). False, and
        nothing copied, if an entry's bytes no longer match its checksum: that entry is dropped (counted, logged),
        so the caller retries without it and recomputes those tokens."""
        t_check = time.perf_counter()
        bad = [e for e in entries if e.tier.checksum(e.slot) != e.checksum]
        checking = time.perf_counter() - t_check  # counted in the tiers' load time, by their share of the blocks
        for entry in bad:
            logger.warning("KV tier %s: a block failed its checksum; dropped, its tokens recomputed", entry.tier.medium)
            entry.tier.stats.checksum_failures += 1
            self._drop(entry, demoted=False)
        if bad:
            return False
        by_tier: dict[int, list[tuple[TierEntry, int]]] = {}
        for entry, block_id in zip(entries, block_ids, strict=True):
            by_tier.setdefault(id(entry.tier), []).append((entry, block_id))
        for pairs in by_tier.values():
            tier = pairs[0][0].tier
            t0 = time.perf_counter()
            self._copy_out(tier, [e.slot for e, _ in pairs], [b for _, b in pairs])
            for entry, _ in pairs:
                tier.touch(entry)
            tier.stats.hits += len(pairs)
            tier.stats.load_seconds += time.perf_counter() - t0 + checking * len(pairs) / len(entries)
        return True

    def _copy_in(self, tier: TierStore, block_ids: list[int], slots: list[int]) -> None:
        """Pool blocks -> tier slots, per layer K and V."""
        kv = self.caches()
        src = torch.tensor(block_ids, dtype=torch.long, device=kv[0][0].device)
        dst = torch.tensor(slots, dtype=torch.long)
        data = tier.data.view(self.word)
        for layer, (k, v) in enumerate(kv):
            for j, t in enumerate((k, v)):
                rows = t.view(torch.uint8).view(self.word).index_select(0, src).reshape(len(block_ids), -1)
                data[:, layer, j].index_copy_(0, dst, rows.to("cpu"))

    def _copy_out(self, tier: TierStore, slots: list[int], block_ids: list[int]) -> None:
        """Tier slots -> pool blocks, per layer K and V."""
        kv = self.caches()
        device = kv[0][0].device
        src = torch.tensor(slots, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long, device=device)
        data = tier.data.view(self.word)
        for layer, (k, v) in enumerate(kv):
            for j, t in enumerate((k, v)):
                rows = data[:, layer, j].index_select(0, src).to(device, non_blocking=True)
                flat = t.view(torch.uint8).view(self.word)
                flat.index_copy_(0, dst, rows.view(len(slots), *flat.shape[1:]))

    # -- the rest ---------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every entry (the prefix cache was reset)."""
        for tier in self.tiers:
            for entry in list(tier.entries.values()):
                self._drop(entry, demoted=False)

    def snapshot(self) -> dict[str, dict[BlockHash, tuple[BlockHash | None, list[int], str | None]]]:
        """Per medium, every entry: key -> (parent key, token ids, adapter)."""
        return {
            t.medium: {k: (e.parent, list(e.token_ids), e.lora_name) for k, e in t.entries.items()} for t in self.tiers
        }

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
