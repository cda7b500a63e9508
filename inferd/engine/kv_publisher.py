"""KV cache events: what the prefix cache stores and evicts, published as it happens, in vLLM's wire format.

A router that knows which blocks each replica holds *now* can send a request to the replica that will hit
its prefix, instead of guessing from where it sent earlier requests (the gateway's fallback index, which
keeps "seeing" blocks a replica evicted long ago). vLLM publishes exactly this (`--kv-events-config`), and
llm-d's precise prefix-cache scorer and Dynamo's KV router index it; inferd publishes the same messages, so
their subscribers read inferd's events and inferd's gateway reads vLLM's.

- **The events** are vLLM's (`inferd.kv_events`, the wire format this module and the gateway's subscriber
  share): `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, batched per step. The keys are the engine's
  own (`inferd.prefix_hash`: a sha256 chain from the root `inferd-prefix-root`, the cache salt and adapter
  in the first block), so a subscriber that tokenizes a prompt can compute the same keys (`/kv_events`
  names the scheme).
- **Recording** (`KVEventRecorder`) happens on the step thread, inside the block pool, and costs a list
  append per block that changes. After each step the engine hands the step's events to the publisher as one
  `KVEventBatch`.
- **Publishing** (`ZmqEventPublisher`) runs on its own thread: a PUB socket sends `[topic, seq (8 bytes,
  big-endian), payload]`, seq counting batches from 0 at start, and a ROUTER socket answers replay requests
  (`[start seq]`) with every buffered batch from that seq on, then an end frame (seq -1, empty payload). The
  first batch is `AllBlocksCleared`, so a subscriber that still held a restarted replica's blocks drops them.
- **Nothing here slows a step**: the hand-over is a `put_nowait` on a bounded queue. When the queue is full
  (the publisher thread starved), batches are dropped and the next batch that fits is a snapshot of the
  whole cache (`AllBlocksCleared`, then a `BlockStored` per cached block), so a subscriber is right again
  from that batch on. A slow subscriber loses messages at the PUB socket's high-water mark, sees the gap in
  seq and asks for a replay; one that asks for batches older than the buffer (it joined late, or was away
  too long) is answered with a snapshot, built from a mirror of the cache the publisher thread keeps from
  the batches it sent, so replay always ends in the cache's true state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from inferd.config import KVEventsConfig
from inferd.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheMirror,
    KVCacheEvent,
    KVEventBatch,
    encoder,
    snapshot_events,
)
from inferd.prefix_hash import HASH_ROOT, HASH_SCHEME, BlockHash

logger = logging.getLogger(__name__)


class KVEventRecorder:
    """The step's cache changes, in order, as events; the block pool calls it, the engine takes them."""

    def __init__(self, block_size: int, medium: str):
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVCacheEvent] = []

    def stored(
        self,
        hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        lora_name: str | None,
        medium: str | None = None,
    ) -> None:
        """Blocks entering the pool's index, or with `medium` a KV tier's (inferd/engine/kv_tier.py)."""
        medium = medium or self.medium
        self.events.append(BlockStored(hashes, parent, token_ids, self.block_size, None, medium, lora_name))

    def removed(self, block_hash: BlockHash, medium: str | None = None) -> None:
        medium = medium or self.medium
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def take(self) -> list[KVCacheEvent]:
        out, self.events = self.events, []
        return out


def _is_bind(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, or ipc/inproc, is bound; any other address is a subscriber to connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes the engine's event batches on a thread of its own (module docstring)."""

    POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket again

    def __init__(self, config: KVEventsConfig, block_size: int, medium: str, snapshot=None):
        import zmq

        self.config = config
        self.block_size = block_size
        self.medium = medium
        self.snapshot = snapshot  # () -> the cache's current events (AllBlocksCleared + BlockStored ...)
        self.topic = config.kv_events_topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.kv_events_max_queue_size)
        self._stale = False  # batches were dropped: the next one must be a snapshot
        self.dropped = 0  # batches dropped because the queue was full
        self.sent = 0
        self.replays = 0
        self._seq = -1  # the last seq sent (the publisher thread's)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.kv_events_buffer_steps)
        self._mirror = CacheMirror(block_size)
        self._encoder = encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.kv_events_hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.kv_events_endpoint
        if _is_bind(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if config.kv_events_replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.kv_events_replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._closed = False
        self.publish([AllBlocksCleared()])  # seq 0: whatever a subscriber held of an earlier run is gone
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s)", self.endpoint, self.replay_endpoint or "none")

    # -- the step thread ------------------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Hand one step's events over; never blocks. After a drop the next batch is a snapshot."""
        if self._stale:
            if self.snapshot is None:
                return
            events = self.snapshot()
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
            self._stale = False
        except queue.Full:
            self.dropped += 1
            self._stale = True

    def info(self) -> dict[str, Any]:
        """What a subscriber needs to know (the server's `/kv_events`)."""
        return {
            "enabled": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.config.kv_events_topic,
            "block_size": self.block_size,
            "medium": self.medium,
            "hash": HASH_SCHEME,
            "hash_root": HASH_ROOT.decode(),
            "sequence": self._seq,
            "sent": self.sent,
            "dropped": self.dropped,
            "replays": self.replays,
        }

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch handed over has been sent; False if that took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    # -- the publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except zmq.ZMQError:
                    return
                except Exception:
                    logger.exception("KV events: a replay request failed")
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self._send(*item)
            except zmq.ZMQError:
                return
            finally:
                self._queue.task_done()

    def _send(self, ts: float, events: list[KVCacheEvent]) -> None:
        self._mirror.apply(events)
        payload = self._encoder.encode(KVEventBatch(ts=ts, events=events))
        seq = self._seq + 1
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], copy=False)
        self._buffer.append((seq, payload))
        self._seq = seq
        self.sent += 1

    def _answer_replay(self) -> None:
        """`[client, (b""), start seq]` -> every buffered batch from start on, or, if start is older than the
        buffer (or from an earlier run), one snapshot batch under the latest seq; then the end frame."""
        frames = self._replay.recv_multipart()
        if len(frames) not in (2, 3) or len(frames[-1]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        head = frames[:-1]  # the client's identity, and the empty delimiter a REQ socket sends
        start = int.from_bytes(frames[-1], "big")
        self.replays += 1
        oldest = self._buffer[0][0] if self._buffer else self._seq + 1
        if oldest <= start <= self._seq + 1:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        else:
            events = snapshot_events(self._mirror.media, self.block_size)
            payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
            self._replay.send_multipart([*head, max(self._seq, 0).to_bytes(8, "big"), payload])
        self._replay.send_multipart([*head, END_SEQ, b""])
