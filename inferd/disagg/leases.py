"""The prefill side's leases: blocks pinned for a decode instance to pull, until it acknowledges or time runs out.

The table is shared by two threads. The engine's step thread creates leases and is the only one that
frees blocks (`expired`, `take_released`): the block pool is not thread-safe. The transfer channel's
threads open a lease to read it (`open`, which also keeps it from expiring while the copy runs, up to
`read_timeout`) and acknowledge it (`ack`), which queues its blocks for the step thread to free.

A lease is readable only while it is in the table: once acknowledged or expired it is gone, and a pull
for it is refused, so a decode can never read blocks that were freed (and maybe reused) under it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # unix time
    owner: Any = None  # the step thread's handle on the pinned blocks (never touched off that thread)
    reading_until: float = 0.0  # a reader holds it open until then
    created: float = field(default_factory=time.time)


class LeaseTable:
    def __init__(self, read_timeout: float = 30.0):
        self.read_timeout = read_timeout
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: list[Lease] = []

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.lease_id] = lease

    def open(self, lease_id: str, now: float | None = None) -> tuple[int, ...] | None:
        """The blocks of a live lease, which stays pinned for read_timeout more seconds; None if gone."""
        now = time.time() if now is None else now
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires_at <= now:
                return None
            lease.reading_until = max(lease.reading_until, now + self.read_timeout)
            return lease.block_ids

    def ack(self, lease_id: str) -> bool:
        """The decode side is done with it: queue its blocks to be freed. False if it was already gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._released.append(lease)
            return True

    def take_released(self) -> list[Lease]:
        with self._lock:
            released, self._released = self._released, []
            return released

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return the leases past their expiry that no reader holds open any more."""
        now = time.time() if now is None else now
        with self._lock:
            gone = [x for x in self._leases.values() if x.expires_at <= now and x.reading_until <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
            return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases) + len(self._released)

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(x.block_ids) for x in [*self._leases.values(), *self._released])
