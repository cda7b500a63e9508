"""Exact prefix routing: the blocks each replica's KV cache holds now, read from its KV events.

The fallback index (`inferd.gateway.prefix`) remembers the keys of requests the gateway sent to a replica,
so it keeps "seeing" blocks the replica evicted and never sees blocks that traffic around the gateway
cached there. A replica started with `--kv-events-config` publishes every change to its cache
(`inferd.engine.kv_publisher`); this index subscribes to each such replica and keeps the set of keys it holds,
as llm-d's precise prefix-cache scorer and Dynamo's KV router do. The keys are the engine's own, which the
gateway computes from the prompt with the same function, so a match here is a block the replica will find.

How it stays right:
- **Discovery**: after a replica's scrape, `discover` asks its `GET /kv_events` (once, then again after
  `RECHECK_S` if it said none) for the endpoints, and subscribes if the block size and key scheme match the
  pool's. A replica that publishes nothing (or a non-inferd one) keeps the fallback index.
- **Sequence**: every batch carries a seq. A gap (the PUB socket dropped messages for a slow subscriber)
  asks the replica's replay socket for what was missed, holding live batches until the replay ends; a seq
  that goes backwards is a restarted replica (its first batch clears everything). A subscription starts with
  a replay from seq 0, which the replica answers with its buffer or a snapshot of its whole cache, so a
  gateway that restarts, or joins late, holds the true state after one round trip.
- **Until synced** (before the first replay ended, or while a replay is late) a replica is not in the index
  and the fallback index scores it.
- **Every medium**: a replica with KV tiers (`--kv-offload-memory`, `inferd.engine.kv_tier`) reports blocks in
  host memory or on disk under their own medium; a block counts as held while any medium holds it (a tier hit is
  copied back, not recomputed), so a block that leaves the cache for the host tier stays held.
- **Bounded**: at most `capacity` keys per replica (oldest first out), which a replica's own pool bounds
  anyway; a replica that leaves the pool is unsubscribed.

One thread reads every replica's sockets (zmq's poller) and owns their state; the event loop only reads
the key sets (`match`) and hands it commands, so no request waits on an event.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

from inferd.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decoder
from inferd.prefix_hash import HASH_SCHEME, BlockHash

logger = logging.getLogger(__name__)

RECHECK_S = 30.0  # how long a replica that publishes no events goes before it is asked again
REPLAY_TIMEOUT_S = 5.0  # a replay not ended by then is abandoned; the replica is asked again


def public_endpoint(endpoint: str, replica_url: str) -> str:
    """A bound address as a subscriber reaches it: a wildcard host (`tcp://0.0.0.0:5557`, `tcp://*:5557`,
    `tcp://[::]:5557`) becomes the replica's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        host = urlsplit(replica_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


@dataclass
class Subscription:
    """One replica's sockets and what its events say it holds (owned by the index's thread)."""

    url: str
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    # key -> a bit per medium that holds it (`media` numbers them); insertion-ordered: the oldest leave first
    blocks: dict[BlockHash, int] = field(default_factory=dict)
    media: dict[str | None, int] = field(default_factory=dict)
    last_seq: int = -1
    synced: bool = False  # a replay ended since the subscription started: `blocks` is the replica's cache
    replay_since: float | None = None  # when the replay in progress was asked for
    held: list[tuple[int, bytes]] = field(default_factory=list)  # live batches that came during a replay
    batches: int = 0
    resyncs: int = 0
    sub: object = None
    dealer: object = None


class KVEventIndex:
    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._subs: dict[str, Subscription] = {}  # url -> subscription: written by the thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._checked: dict[str, float] = {}  # url -> when /kv_events was last asked (the event loop's)
        self._decoder = decoder()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the event loop's side --------------------------------------------------------------------------
    def synced(self, url: str) -> bool:
        sub = self._subs.get(url)
        return sub is not None and sub.synced

    def match(self, urls: Sequence[str], hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each synced replica among `urls`, how many leading blocks of `hashes` its cache holds."""
        out = {}
        for url in urls:
            sub = self._subs.get(url)
            if sub is None or not sub.synced:
                continue
            blocks, n = sub.blocks, 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            out[url] = n
        return out

    def holds(self, url: str, key: BlockHash) -> bool:
        """Whether the synced replica's cache (any medium) holds the block."""
        sub = self._subs.get(url)
        return sub is not None and key in sub.blocks

    def stats(self) -> list[tuple[str, int, int, int, bool]]:
        """(replica, blocks held, batches applied, resyncs, synced) per subscription."""
        return [(s.url, len(s.blocks), s.batches, s.resyncs, s.synced) for s in list(self._subs.values())]

    async def discover(self, client, url: str, headers: dict[str, str], block_size: int) -> None:
        """Subscribe to the replica at `url` if it publishes KV events this index can use; every `RECHECK_S`
        ask again, and resubscribe if its endpoints changed or its sequence went back (it restarted and has
        published nothing since, so no batch told this index)."""
        now = time.monotonic()
        if now - self._checked.get(url, float("-inf")) < RECHECK_S:
            return
        self._checked[url] = now
        try:
            r = await client.get(f"{url}/kv_events", timeout=5.0, headers=headers)
            info = r.json() if r.status_code == 200 else {}
        except Exception as e:  # a replica without the route, or down: the fallback index serves it
            logger.debug("no KV events from %s: %s", url, e)
            return
        if not isinstance(info, dict) or not info.get("enabled") or not info.get("endpoint"):
            return
        if info.get("hash") != HASH_SCHEME or info.get("block_size") != block_size:
            logger.warning(
                "replica %s publishes KV events with block size %s and keys %s; the pool routes with block size "
                "%s and %s: not subscribing",
                url, info.get("block_size"), info.get("hash"), block_size, HASH_SCHEME,
            )  # fmt: skip
            return
        replay = info.get("replay_endpoint")
        endpoint, replay = public_endpoint(info["endpoint"], url), public_endpoint(replay, url) if replay else None
        sub = self._subs.get(url)
        if sub is not None:
            seq = info.get("sequence")
            moved = (sub.endpoint, sub.replay_endpoint) != (endpoint, replay)
            if not moved and not (sub.synced and isinstance(seq, int) and seq < sub.last_seq):
                return
            logger.info("KV events of %s: the replica restarted or moved; subscribing again", url)
            self._commands.put(("unsubscribe", url))
        self.subscribe(url, endpoint, replay, str(info.get("topic") or ""))

    def subscribe(self, url: str, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self._start()
        self._commands.put(("subscribe", Subscription(url, endpoint, replay_endpoint, topic.encode())))

    def retain(self, urls: set[str]) -> None:
        """Unsubscribe from replicas no longer in any pool."""
        for url in [u for u in list(self._subs) if u not in urls]:
            self._commands.put(("unsubscribe", url))
            self._checked.pop(url, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gateway-kv-events", daemon=True)
            self._thread.start()

    # -- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        poller = zmq.Poller()
        by_socket: dict[object, tuple[Subscription, str]] = {}
        try:
            while not self._stop.is_set():
                self._take_commands(ctx, poller, by_socket)
                for sock, _ in poller.poll(50):
                    sub, kind = by_socket[sock]
                    while sock.poll(0):
                        frames = sock.recv_multipart()
                        if kind == "sub":
                            self._on_live(sub, frames)
                        else:
                            self._on_replay(sub, frames)
                now = time.monotonic()
                for sub in list(self._subs.values()):
                    if sub.replay_since is not None and now - sub.replay_since > REPLAY_TIMEOUT_S:
                        logger.warning("KV events of %s: replay timed out; asking again", sub.url)
                        self._new_dealer(ctx, poller, by_socket, sub)
                        self._replay(sub, sub.last_seq + 1)
        finally:
            ctx.destroy(linger=0)

    def _take_commands(self, ctx, poller, by_socket) -> None:
        import zmq

        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "subscribe":
                sub: Subscription = arg
                if sub.url in self._subs:
                    continue
                sub.sub = ctx.socket(zmq.SUB)
                sub.sub.setsockopt(zmq.LINGER, 0)
                sub.sub.setsockopt(zmq.SUBSCRIBE, sub.topic)
                sub.sub.connect(sub.endpoint)
                poller.register(sub.sub, zmq.POLLIN)
                by_socket[sub.sub] = (sub, "sub")
                self._subs[sub.url] = sub
                if sub.replay_endpoint:
                    self._new_dealer(ctx, poller, by_socket, sub)
                    self._replay(sub, 0)  # whatever the replica holds now, from its buffer or a snapshot
                else:
                    sub.synced = True  # no replay: from the next AllBlocksCleared on, at best
                logger.info("KV events: subscribed to %s at %s", sub.url, sub.endpoint)
            else:
                sub = self._subs.pop(arg, None)
                if sub is not None:
                    for sock in (sub.sub, sub.dealer):
                        if sock is not None:
                            poller.unregister(sock)
                            by_socket.pop(sock, None)
                            sock.close(0)

    def _new_dealer(self, ctx, poller, by_socket, sub: Subscription) -> None:
        """A fresh replay socket (an abandoned replay's late answers go to the old one, closed here)."""
        import zmq

        if sub.dealer is not None:
            poller.unregister(sub.dealer)
            by_socket.pop(sub.dealer, None)
            sub.dealer.close(0)
        sub.dealer = ctx.socket(zmq.DEALER)
        sub.dealer.setsockopt(zmq.LINGER, 0)
        sub.dealer.connect(sub.replay_endpoint)
        poller.register(sub.dealer, zmq.POLLIN)
        by_socket[sub.dealer] = (sub, "replay")

    def _replay(self, sub: Subscription, start: int) -> None:
        sub.replay_since = time.monotonic()
        sub.resyncs += start > 0
        sub.dealer.send_multipart([b"", start.to_bytes(8, "big")])

    def _on_live(self, sub: Subscription, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        if sub.replay_since is not None:
            sub.held.append((seq, frames[2]))
            return
        if seq <= sub.last_seq:  # PUB/SUB never repeats: the replica restarted and counts from 0 again
            sub.last_seq = -1
        if seq == sub.last_seq + 1:
            self._apply(sub, seq, frames[2])
        elif sub.dealer is not None:  # a gap: ask for what was missed, hold this one
            sub.held.append((seq, frames[2]))
            self._replay(sub, sub.last_seq + 1)
        else:  # no replay socket: apply and hope the gap held nothing this replica's requests need
            self._apply(sub, seq, frames[2])

    def _on_replay(self, sub: Subscription, frames: list[bytes]) -> None:
        if len(frames) != 3 or sub.replay_since is None:
            return
        _, seq_bytes, payload = frames
        if payload:
            seq = int.from_bytes(seq_bytes, "big")
            self._apply(sub, seq, payload, replayed=True)
            return
        sub.replay_since, sub.synced = None, True  # the end frame
        held, sub.held = sorted(sub.held), []
        for seq, payload in held:
            if seq <= sub.last_seq:
                continue
            if seq != sub.last_seq + 1:  # still a gap (the replica moved on during the replay)
                sub.held = [(s, p) for s, p in held if s > sub.last_seq]
                self._replay(sub, sub.last_seq + 1)
                return
            self._apply(sub, seq, payload)

    def _apply(self, sub: Subscription, seq: int, payload: bytes, replayed: bool = False) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("KV events of %s: batch %d unreadable (%s); resyncing", sub.url, seq, e)
            sub.blocks.clear()
            sub.synced = False
            if sub.dealer is not None and sub.replay_since is None:
                self._replay(sub, 0)
            return
        events = batch.events
        snapshot = bool(events) and isinstance(events[0], AllBlocksCleared)
        if replayed and seq <= sub.last_seq and not snapshot:
            return
        blocks = sub.blocks
        for e in events:
            if isinstance(e, BlockStored):
                bit = sub.media.setdefault(e.medium, 1 << len(sub.media))
                for h in e.block_hashes:
                    blocks[h] = blocks.get(h, 0) | bit
            elif isinstance(e, BlockRemoved):
                bit = sub.media.setdefault(e.medium, 1 << len(sub.media))
                for h in e.block_hashes:
                    held = blocks.get(h, 0) & ~bit
                    if held:
                        blocks[h] = held
                    else:
                        blocks.pop(h, None)
            else:
                blocks.clear()
        while len(blocks) > self.capacity:
            del blocks[next(iter(blocks))]
        sub.last_seq = seq
        sub.batches += 1
