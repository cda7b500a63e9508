"""The gateway's event-driven prefix index against a real publisher (the engine's, without a model): it holds what
the publisher's cache holds, through late joins, gaps, restarts, a lost replay and garbage."""

from __future__ import annotations

import time

import pytest
import zmq

from inferd.config import KVEventsConfig
from inferd.engine.kv_publisher import ZmqEventPublisher
from inferd.gateway.kv_index import KVEventIndex, public_endpoint
from inferd.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheMirror
from inferd.prefix_hash import block_hashes
from tests.gateway.conftest import wait_until
from tests.net import free_port

pytestmark = pytest.mark.timeout(60)
BS = 4
URL = "http://replica-a"


def _config(**kw) -> KVEventsConfig:
    """Free loopback ports; fixed `ports` are bound on every interface (vLLM's rule: an address without a
    wildcard is a subscriber to connect to)."""
    port, replay = kw.pop("ports", (None, None))
    return KVEventsConfig(
        enable_kv_cache_events=True,
        kv_events_endpoint=f"tcp://*:{port}" if port else "tcp://127.0.0.1:*",
        kv_events_replay_endpoint=f"tcp://*:{replay}" if replay else "tcp://127.0.0.1:*",
        **kw,
    )


class Cache:
    """A stand-in engine cache: stores chains of blocks and removes them, through a real publisher."""

    def __init__(self, config: KVEventsConfig):
        self.mirror = CacheMirror(BS)
        self.pub = ZmqEventPublisher(config, BS, "CPU", self.snapshot)

    def snapshot(self):
        from inferd.kv_events import snapshot_events

        return snapshot_events(self.mirror.media, BS)

    def send(self, events) -> None:
        self.mirror.apply(events)
        self.pub.publish(events)
        assert self.pub.flush()

    def store(self, tokens: list[int]) -> list[bytes]:
        keys = block_hashes(tokens, BS)
        self.send([BlockStored(keys, None, tokens[: len(keys) * BS], BS, None, "CPU")])
        return keys


def _subscribe(index: KVEventIndex, pub: ZmqEventPublisher, url: str = URL) -> None:
    index.subscribe(url, pub.endpoint, pub.replay_endpoint)
    wait_until(lambda: index.synced(url), what="the first replay")


def test_late_subscriber_and_live_events():
    cache, index = Cache(_config()), KVEventIndex(1000)
    try:
        a = cache.store(list(range(1, 13)))  # 3 blocks, before the gateway subscribed
        _subscribe(index, cache.pub)
        assert index.match([URL], a) == {URL: 3}
        b = cache.store([7] * 8)
        wait_until(lambda: index.match([URL], b) == {URL: 2}, what="a live BlockStored")
        cache.send([BlockRemoved([a[1]], "CPU")])
        wait_until(lambda: index.match([URL], a) == {URL: 1}, what="a live BlockRemoved")  # the chain breaks
        assert index.match(["http://other"], a) == {}  # not subscribed: the fallback index scores it
    finally:
        index.close()
        cache.pub.close()


def test_a_block_moved_to_a_kv_tier_stays_held_until_every_medium_lets_it_go():
    cache, index = Cache(_config()), KVEventIndex(1000)
    try:
        a = cache.store(list(range(1, 13)))
        # the cache evicts block 1 to the host tier: removed from CPU, stored in HOST
        cache.send([BlockRemoved([a[1]], "CPU"), BlockStored([a[1]], a[0], list(range(5, 9)), BS, None, "HOST")])
        _subscribe(index, cache.pub)  # a late subscriber: the snapshot carries both media
        assert index.match([URL], a) == {URL: 3}
        cache.send([BlockStored([a[1]], a[0], list(range(5, 9)), BS, None, "CPU")])  # loaded back: in both
        cache.send([BlockRemoved([a[1]], "HOST")])
        time.sleep(0.2)
        assert index.match([URL], a) == {URL: 3}
        cache.send([BlockRemoved([a[1]], "CPU")])
        wait_until(lambda: index.match([URL], a) == {URL: 1}, what="the last medium letting go")
    finally:
        index.close()
        cache.pub.close()


def _batch(*events) -> bytes:
    from inferd.kv_events import KVEventBatch, encoder

    return encoder().encode(KVEventBatch(ts=time.time(), events=list(events)))


def _stored(tokens: list[int]) -> tuple[list[bytes], BlockStored]:
    keys = block_hashes(tokens, BS)
    return keys, BlockStored(keys, None, tokens, BS, None, "CPU")


def test_a_gap_is_replayed():
    """The test plays the replica with raw sockets: batch 1 never reaches the subscriber; batch 2 does, and the
    index asks the replay socket for 1 on, holding 2 until the replay ends."""
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port, router_port = pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")
    index = KVEventIndex(100)
    end = (-1).to_bytes(8, "big", signed=True)
    a, stored_a = _stored(list(range(1, 9)))
    b, stored_b = _stored(list(range(20, 28)))
    try:
        index.subscribe(URL, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{router_port}")
        wait_until(lambda: router.poll(0), what="the first replay request")
        ident, start = router.recv_multipart()[0], 0
        router.send_multipart([ident, b"", start.to_bytes(8, "big"), _batch(AllBlocksCleared())])
        router.send_multipart([ident, b"", end, b""])
        wait_until(lambda: index.synced(URL), what="the first replay")
        time.sleep(0.3)  # the subscription reached the PUB socket
        pub.send_multipart([b"", (2).to_bytes(8, "big"), _batch(stored_b)])  # seq 1 is missing
        wait_until(lambda: router.poll(0), what="the replay of the gap")
        frames = router.recv_multipart()
        assert int.from_bytes(frames[-1], "big") == 1
        assert index.match([URL], b) == {URL: 0}  # held until the replay ends
        router.send_multipart([frames[0], b"", (1).to_bytes(8, "big"), _batch(stored_a)])
        router.send_multipart([frames[0], b"", (2).to_bytes(8, "big"), _batch(stored_b)])
        router.send_multipart([frames[0], b"", end, b""])
        wait_until(lambda: index.match([URL], a) == index.match([URL], b) == {URL: 2}, what="both batches")
        assert index._subs[URL].last_seq == 2 and index._subs[URL].resyncs == 1
    finally:
        index.close()
        ctx.destroy(linger=0)


def test_a_restarted_replica_clears_what_it_held():
    ports = (free_port(), free_port())
    cache, index = Cache(_config(ports=ports)), KVEventIndex(1000)
    try:
        old = cache.store(list(range(1, 9)))
        _subscribe(index, cache.pub)
        for _ in range(3):
            cache.store([9] * 4)  # the old run's seq moves past the new run's first batches
        assert index.match([URL], old) == {URL: 2}
        cache.pub.close()
        time.sleep(0.2)
        cache = Cache(_config(ports=ports))  # seq 0 again (AllBlocksCleared), likely before the SUB reconnects
        time.sleep(0.5)
        new = cache.store(list(range(100, 108)))  # seq 1: below the last seq seen, so a restart: replay from 0
        wait_until(lambda: index.match([URL], new) == {URL: 2}, what="the new run's blocks")
        assert index.match([URL], old) == {URL: 0}
    finally:
        index.close()
        cache.pub.close()


def test_a_buffer_that_moved_on_answers_with_a_snapshot_and_the_index_is_bounded():
    cache, index = Cache(_config(kv_events_buffer_steps=2)), KVEventIndex(6)
    try:
        chains = [cache.store([i] * 8) for i in range(1, 6)]  # 5 batches + seq 0: past the 2-batch buffer
        cache.send([BlockRemoved(chains[0], "CPU")])
        _subscribe(index, cache.pub)
        held = index._subs[URL].blocks
        assert set(held) <= {k for c in chains[1:] for k in c} and len(held) == 6  # 8 blocks, capacity 6
        assert index.match([URL], chains[-1]) == {URL: 2} and index.match([URL], chains[0]) == {URL: 0}
    finally:
        index.close()
        cache.pub.close()


def test_garbage_and_a_silent_replay_socket_do_not_stop_the_index():
    """A batch that does not decode clears the replica and asks for a replay; a replay that never answers times
    out (the replica stays out of the index meanwhile) and is asked again."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    silent = ctx.socket(zmq.ROUTER)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    index = KVEventIndex(100)
    try:
        index.subscribe(URL, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{silent_port}")
        wait_until(lambda: silent.poll(0), what="the replay request")
        silent.recv_multipart()
        assert not index.synced(URL) and index.match([URL], [b"x"]) == {}
        wait_until(lambda: silent.poll(0), timeout=10, what="the replay asked again after its timeout")
        ident = silent.recv_multipart()[0]
        silent.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])
        wait_until(lambda: index.synced(URL), what="the end frame")
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
        wait_until(lambda: silent.poll(0), what="a replay after the unreadable batch")
        assert not index.synced(URL)
    finally:
        index.close()
        ctx.destroy(linger=0)


def test_public_endpoint():
    assert public_endpoint("tcp://0.0.0.0:5557", "http://10.0.0.5:8000") == "tcp://10.0.0.5:5557"
    assert public_endpoint("tcp://*:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert public_endpoint("tcp://127.0.0.1:41000", "http://10.0.0.5:8000") == "tcp://127.0.0.1:41000"
    assert public_endpoint("ipc:///tmp/kv", "http://h:1") == "ipc:///tmp/kv"
    assert AllBlocksCleared() is not None
