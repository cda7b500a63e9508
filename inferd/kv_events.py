"""KV cache events on the wire: vLLM's message types, so vLLM's subscribers read inferd's events and back.

A batch is msgpack of `KVEventBatch(ts, events)`, each event a tagged array (`["BlockStored", ...]`), sent
as ZMQ frames `[topic, seq (8 bytes, big-endian), payload]`; a replay answer is `[seq, payload]` per batch,
then `[END_SEQ, b""]`. `BlockStored` carries the keys of a run of full blocks that entered the cache, the key
of the block before them, their token ids, the block size, a LoRA id (always None in inferd), the medium
and the LoRA adapter's name (vLLM's newer trailing field, which older decoders skip); `BlockRemoved` the
keys that left it; `AllBlocksCleared` says everything went. The engine publishes them
(`inferd.engine.kv_publisher`), the gateway indexes them (`inferd.gateway.kv_index`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from inferd.prefix_hash import BlockHash

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame: no more batches follow


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the cache; msgpack'd as [tag, fields...] like vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None  # a trailing field older subscribers skip


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=KVEventBatch)


Blocks = dict[BlockHash, tuple[BlockHash | None, list[int], str | None]]  # key -> (parent key, tokens, adapter)


def snapshot_events(media: dict[str | None, Blocks], block_size: int) -> list[KVCacheEvent]:
    """`AllBlocksCleared`, then one `BlockStored` per cached block of each medium (the pool's, then each KV
    tier's), every parent before its children within a medium, so a subscriber that applies them in order
    rebuilds the cache."""
    out: list[KVCacheEvent] = [AllBlocksCleared()]
    for medium, blocks in media.items():
        done: set[BlockHash] = set()
        for key in blocks:
            chain = []
            while key is not None and key in blocks and key not in done:  # walk up to a block already emitted
                chain.append(key)
                key = blocks[key][0]
            for k in reversed(chain):
                parent, tokens, lora = blocks[k]
                out.append(BlockStored([k], parent, list(tokens), block_size, None, medium, lora))
                done.add(k)
    return out


class CacheMirror:
    """What the cache holds according to the events applied so far: per medium, key -> (parent, tokens,
    adapter)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.media: dict[str | None, Blocks] = {}

    def apply(self, events: list[KVCacheEvent]) -> None:
        n = self.block_size
        for e in events:
            if isinstance(e, BlockStored):
                blocks = self.media.setdefault(e.medium, {})
                parent = e.parent_block_hash
                for i, key in enumerate(e.block_hashes):
                    blocks[key] = (parent, e.token_ids[i * n : (i + 1) * n], e.lora_name)
                    parent = key
            elif isinstance(e, BlockRemoved):
                blocks = self.media.get(e.medium, {})
                for key in e.block_hashes:
                    blocks.pop(key, None)
            else:
                self.media.clear()
