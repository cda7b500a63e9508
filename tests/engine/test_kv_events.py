"""KV cache events: a subscriber that applies them holds exactly what the engine's prefix cache holds, read with
vLLM's own message types (wire compatibility), through evictions, replays, late joins and dropped batches."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from inferd import LLM, SamplingParams
from inferd.config import make_engine_config
from inferd.engine import kv_publisher
from inferd.errors import ConfigError
from inferd.prefix_hash import block_hashes
from tests.conftest import VOCAB

BLOCK = 16
EVENTS = {
    "enable_kv_cache_events": True,
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
}


# vLLM's types as its examples/online_serving/kv_events_subscriber.py declares them: what a vLLM subscriber decodes
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VKVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VKVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(VKVCacheEvent):
    pass


class VKVEventBatch(VEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VDECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)


class Subscriber:
    """A subscriber as vLLM's example writes one: SUB for the stream, a replay request when seq jumps."""

    def __init__(self, info: dict):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(info["endpoint"])
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay_endpoint = info["replay_endpoint"]
        self.blocks: dict[bytes, tuple] = {}
        self.last_seq = -1
        self.batches = 0
        self.stored: list[BlockStored] = []
        self.removed: set[bytes] = set()

    def apply(self, batch: VKVEventBatch) -> None:
        self.batches += 1
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.stored.append(e)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    self.blocks[h] = (parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                    parent = h
            elif isinstance(e, BlockRemoved):
                self.removed.update(e.block_hashes)
                for h in e.block_hashes:
                    self.blocks.pop(h, None)
            else:
                self.blocks.clear()

    def replay(self, start: int) -> int:
        """Ask for every batch from `start`; apply them; the number of batches received."""
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        got = 0
        try:
            while req.poll(5000):
                _, seq_bytes, payload = req.recv_multipart()
                if not payload:
                    return got
                self.apply(VDECODER.decode(payload))
                self.last_seq = int.from_bytes(seq_bytes, "big")
                got += 1
            raise AssertionError("the replay did not end")
        finally:
            req.close(0)

    def drain(self, until_seq: int, timeout: float = 10) -> None:
        """Read the stream until batch `until_seq` is applied, replaying any gap."""
        deadline = time.monotonic() + timeout
        while self.last_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at seq {self.last_seq} of {until_seq}"
            if not self.sub.poll(100):
                continue
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
            self.apply(VDECODER.decode(payload))
            self.last_seq = seq

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _cached(llm: LLM) -> dict[bytes, tuple]:
    return {k: (p, t) for k, (p, t, _) in llm.engine.kv.pool.snapshot().items()}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def _seq(llm: LLM) -> int:
    """The last seq once the publisher has sent everything handed to it."""
    assert llm.engine.kv_events.flush()
    return llm.engine.kv_events.info()["sequence"]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_subscriber_mirrors_the_cache_through_evictions(tiny_models):
    with LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=24, **EVENTS) as llm:
        info = llm.engine.kv_events.info()
        assert info["block_size"] == BLOCK and info["hash"] == "sha256-chain-int64le" and info["medium"] == "CPU"
        sub = Subscriber(info)
        try:
            time.sleep(0.2)  # the subscription reaches the publisher
            sub.replay(0)  # and whatever was sent before that (seq 0: AllBlocksCleared)
            prompts = _prompts(9, 30, seed=1)
            llm.generate(prompts[:3], GREEDY)
            sub.drain(_seq(llm))
            assert sub.blocks == _cached(llm)
            first = block_hashes(prompts[0], BLOCK)
            assert first[0] in sub.blocks and sub.blocks[first[0]][1] == prompts[0][:BLOCK]
            assert sub.blocks[first[1]][0] == first[0]  # the chain: a block's parent is the one before it
            # a 24-block pool cannot hold them all: later prompts evict earlier blocks, and the events say so
            llm.generate(prompts[3:], GREEDY)
            sub.drain(_seq(llm))
            assert sub.blocks == _cached(llm)
            gone = [h for p in prompts[:3] for h in block_hashes(p, BLOCK) if h not in _cached(llm)]
            assert gone, "the pool was expected to evict"
            assert set(gone) <= sub.removed and not set(gone) & set(sub.blocks)
            for e in sub.stored:
                assert len(e.token_ids) == len(e.block_hashes) * BLOCK and e.block_size == BLOCK and e.medium == "CPU"
        finally:
            sub.close()


def test_late_subscriber_gets_a_snapshot_when_the_buffer_moved_on(tiny_models):
    settings = {**EVENTS, "kv_events_buffer_steps": 2}
    with LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=64, **settings) as llm:
        for prompt in _prompts(4, 30, seed=2):
            llm.generate([prompt], GREEDY)
        seq = _seq(llm)
        assert seq > 2  # more batches than the buffer holds
        sub = Subscriber(llm.engine.kv_events.info())
        try:
            assert sub.replay(0) == 1  # one snapshot batch, under the latest seq
            assert sub.last_seq == seq
            assert sub.blocks == _cached(llm) and sub.blocks
            assert sub.replay(seq + 1) == 0  # nothing newer: just the end frame
            assert sub.replay(seq) == 1  # the last batch is still buffered
        finally:
            sub.close()


def test_a_full_queue_drops_batches_then_sends_a_snapshot(tiny_models, monkeypatch):
    """The step never waits for the publisher: with its thread held and a one-batch queue, steps drop their
    batches, and the first batch that fits afterwards is the whole cache, so a subscriber is right again."""
    gate = threading.Event()
    run = kv_publisher.ZmqEventPublisher._run
    monkeypatch.setattr(kv_publisher.ZmqEventPublisher, "_run", lambda self: (gate.wait(30), run(self)))
    settings = {**EVENTS, "kv_events_max_queue_size": 1}
    with LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=64, **settings) as llm:
        pub = llm.engine.kv_events
        sub = Subscriber(pub.info())
        try:
            time.sleep(0.2)
            started = time.monotonic()
            llm.generate(_prompts(3, 30, seed=3), GREEDY)  # the queue holds seq 0's AllBlocksCleared: full
            assert time.monotonic() - started < 20
            assert pub.dropped > 0 and pub._stale
            gate.set()
            time.sleep(0.3)
            llm.generate([_prompts(1, 20, seed=4)[0]], GREEDY)  # this step's batch is a snapshot
            sub.drain(_seq(llm))
            assert sub.blocks == _cached(llm)
            assert not pub._stale
        finally:
            sub.close()


def test_vllm_json_config_and_bad_settings():
    config = make_engine_config(
        "m", kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    )
    k = config.kv_events
    assert k.enabled and k.kv_events_endpoint == "tcp://*:6000" and k.kv_events_topic == "kv"
    assert not make_engine_config(
        "m", kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}
    ).kv_events.enabled
    with pytest.raises(ConfigError, match="unknown kv events config keys"):
        make_engine_config("m", kv_events_config='{"enable": true}')
    with pytest.raises(ConfigError, match="not JSON"):
        make_engine_config("m", kv_events_config="{enable")
    with pytest.raises(ConfigError, match="ZMQ address"):
        make_engine_config("m", kv_events_endpoint="localhost:5557").validate()
    with pytest.raises(ConfigError, match="kv_events_publisher"):
        make_engine_config("m", kv_events_publisher="kafka").validate()


def test_off_by_default_records_nothing(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=128, dtype="float32", num_blocks=64)
    assert llm.engine.kv_events is None and llm.engine.kv.events is None
    llm.generate(_prompts(1, 20, seed=5), GREEDY)
