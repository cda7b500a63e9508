"""Step events: a compact record of every engine step, for a live dashboard, that never slows a step.

After each step the engine hands its `SchedulerOutput` (and the tokens it sampled) to a `StepEvents`,
which turns it into one small JSON-ready dict and appends it to a bounded ring. A consumer on another
thread (the server's dashboard hub) drains the ring when it likes; when it is slow the ring drops the
oldest events and counts the drops, so the step thread never waits and never grows memory.

One event:

- `id`, `ts` (wall clock, s), `dur_ms` (schedule + execute + update), `tokens` scheduled and `budget`
  (`--max-num-batched-tokens`), `running` / `waiting` after the step;
- `reqs`: one `[request id, tokens computed, kind, flags, constraint, adapter]` per chunk, in the
  scheduler's order, where kind is `"p"` (a prefill chunk, or a recompute after preemption) or `"d"` (one
  decode token), flags is `""`, `"f"` (finished this step) or `"s"` (sampled a token and goes on),
  constraint is the kind of a structured output's grammar (`"json"`, `"regex"`, ...) or `""`, and adapter
  the LoRA adapter the request runs under or `""`;
- `preempted`: ids preempted this step;
- `ttft_ms` / `itl_ms`: the time to first token and inter-token gaps of the tokens sampled this step,
  from the engine's own timestamps;
- `kv` (only when it changed, at a bounded rate): a KV snapshot, see `kv_snapshot`.

The KV snapshot costs time proportional to the blocks in use, so it is taken at most every
`kv_interval` seconds, and never more often than keeps its own cost under `kv_budget` of the elapsed
time (a big cache snapshots less often); plus once when the engine runs out of work, so a consumer
sees the cache settle. Everything here only reads the scheduler and the KV manager.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.step import SchedulerOutput

if TYPE_CHECKING:
    from inferd.engine.scheduler import SampledToken, Scheduler

logger = logging.getLogger(__name__)

# per-block codes of a KV snapshot
FREE = 0  # free, holding no cached data: reused first
CACHED = 1  # free, but still holding a cached prefix block: a later request may hit it
OWNER_BASE = 2  # 2 + i: owned by the snapshot's i-th owner
SHARED = 0x8000  # bit set on an owned block whose ref count is > 1 (a shared prefix)


def kv_snapshot(kv: KVCacheManager) -> dict[str, Any]:
    """Every block's state, run-length encoded: `{"runs": [code, count, code, count, ...], "owners": [ids]}`.

    code FREE / CACHED, or OWNER_BASE + i for a block of `owners[i]` (the first owner, for a shared
    block), with the SHARED bit when more than one request holds it. Reads only; cost grows with the
    blocks in use and the cached ones, not with the size of the cache. Safe to call from another
    thread than the step thread: it copies the containers first (atomic under the GIL) and at worst
    sees a block mid-change.
    """
    pool = kv.pool
    codes = np.zeros(pool.num_blocks, dtype=np.uint16)
    cached = [b.block_id for b in list(pool._cached.values()) if b.ref_cnt == 0]
    if cached:
        codes[cached] = CACHED
    owners = []
    for request_id, blocks in list(kv.req_blocks.items()):
        blocks = list(blocks)
        if not blocks:
            continue
        owners.append(request_id)
        code = OWNER_BASE + min(len(owners) - 1, SHARED - OWNER_BASE - 1)
        ids = np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))
        shared = np.fromiter((b.ref_cnt > 1 for b in blocks), dtype=bool, count=len(blocks))
        fresh = codes[ids] < OWNER_BASE  # a shared block keeps its first owner
        codes[ids[fresh]] = code
        codes[ids[shared]] |= SHARED
    return {"runs": run_length(codes), "owners": owners, "usage": round(pool.usage, 4)}


def kv_signature(kv: KVCacheManager) -> tuple:
    """Changes whenever a block is allocated, freed, shared or evicted from the prefix cache (cost: one
    entry per request holding blocks). Ref counts that change without any of these cannot happen."""
    pool = kv.pool
    owners = tuple((rid, len(blocks)) for rid, blocks in list(kv.req_blocks.items()))
    return pool.num_free_blocks, len(pool._cached), owners


def run_length(codes: np.ndarray) -> list[int]:
    """[value, count, value, count, ...] of a 1-d array."""
    if codes.size == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(codes)) + 1))
    counts = np.diff(np.concatenate((starts, [codes.size])))
    return np.column_stack((codes[starts], counts)).ravel().tolist()


def expand_runs(runs: Sequence[int]) -> list[int]:
    """The inverse of run_length (for tests and tools)."""
    out: list[int] = []
    for value, count in zip(runs[::2], runs[1::2], strict=True):
        out.extend([value] * count)
    return out


@dataclass
class EventRing:
    """A bounded FIFO between the step thread (push) and one consumer (drain). Never blocks.

    deque.append and popleft are atomic in CPython, so no lock is needed. When full, the oldest
    event is dropped and counted.
    """

    capacity: int = 4096
    dropped: int = 0
    _items: collections.deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._items = collections.deque(maxlen=self.capacity)

    def push(self, item: dict) -> None:
        if len(self._items) >= self.capacity:
            self.dropped += 1
        self._items.append(item)

    def drain(self, limit: int | None = None) -> list[dict]:
        out = []
        pop = self._items.popleft
        for _ in range(limit if limit is not None else len(self._items)):
            try:
                out.append(pop())
            except IndexError:
                break
        return out

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class StepEvents:
    """Turns each step into an event in `ring`. Attach with `engine.events = StepEvents(...)`."""

    ring: EventRing = field(default_factory=EventRing)
    kv_interval: float = 0.2  # seconds between KV snapshots at most
    kv_budget: float = 0.02  # fraction of time KV snapshots may take
    _ids: itertools.count = field(default_factory=itertools.count, init=False, repr=False)
    # the constraint kind of each live structured request, learnt as it enters the batch
    _constrained: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    # the LoRA adapter of each live request that has one, learnt likewise
    _adapters: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _next_kv: float = field(default=0.0, init=False, repr=False)
    _last_runs: list[int] | None = field(default=None, init=False, repr=False)
    _last_owners: list[str] | None = field(default=None, init=False, repr=False)
    _last_sig: tuple | None = field(default=None, init=False, repr=False)
    kv_cost_s: float = field(default=0.0, init=False)  # the last snapshot's cost
    errors: int = field(default=0, init=False)  # records that failed (a bug), never raised into the step

    def record(
        self,
        scheduler: Scheduler,
        sched: SchedulerOutput,
        sampled: Sequence[SampledToken],
        started: float,
    ) -> None:
        """Called by the engine at the end of a step that `started` at this perf_counter time.

        Never raises: a bug here must not fail the step (and its requests); it is logged once and counted.
        """
        try:
            self._record(scheduler, sched, sampled, started)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                logger.exception("step event failed; the dashboard misses this step (logged once)")

    def _record(self, scheduler: Scheduler, sched: SchedulerOutput, sampled: Sequence[SampledToken], started: float):
        now = time.perf_counter()
        live = scheduler.requests
        sampled_ids = {s.request.request_id for s in sampled}
        constrained, adapters = self._constrained, self._adapters
        for rid in sched.finished_ids:  # ended (or aborted) before this step
            constrained.pop(rid, None)
            adapters.pop(rid, None)
        for new in sched.new_requests:
            if new.params.structured is not None:
                constrained[new.request_id] = new.params.structured.kind
            if new.lora_name is not None:
                adapters[new.request_id] = new.lora_name
        reqs = []
        tokens = 0
        for c in sched.chunks:
            rid = c.request_id
            flag = "f" if rid not in live else ("s" if rid in sampled_ids else "")
            kind = "p" if c.is_prefill else "d"
            reqs.append([rid, c.num_tokens, kind, flag, constrained.get(rid, ""), adapters.get(rid, "")])
            tokens += c.num_tokens
            if flag == "f":
                constrained.pop(rid, None)
                adapters.pop(rid, None)
        ttft, itl = [], []
        for s in {s.request.request_id: s for s in reversed(sampled)}.values():  # a request's first token this step
            times = s.request.times
            if len(s.request.output_token_ids) == 1 and times.first_token is not None:
                ttft.append(round((times.first_token - times.arrival) * 1000, 3))
            elif times.inter_token_latencies:
                itl.append(round(times.inter_token_latencies[-1] * 1000, 3))
        event: dict[str, Any] = {
            "type": "step",
            "id": next(self._ids),
            "ts": time.time(),
            "dur_ms": round((now - started) * 1000, 3),
            "tokens": tokens,
            "budget": scheduler.config.max_num_batched_tokens,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "reqs": reqs,
            "preempted": list(sched.preempted_ids),
            "ttft_ms": ttft,
            "itl_ms": itl,
        }
        idle = not live
        if idle or now >= self._next_kv:
            kv = self.snapshot(scheduler.kv)
            if kv is not None:
                event["kv"] = kv
        self.ring.push(event)

    def push_kv(self, kv: KVCacheManager) -> bool:
        """From any thread while the engine is idle (an abort frees blocks without a step): push a
        `{"type": "kv"}` event if the cache changed. True if one was pushed."""
        snap = self.snapshot(kv)
        if snap is None:
            return False
        self.ring.push({"type": "kv", "ts": time.time(), "kv": snap})
        return True

    def snapshot(self, kv: KVCacheManager) -> dict | None:
        """A KV snapshot if the cache changed since the last one (None otherwise); schedules the next.

        A cheap signature (free and cached block counts, each owner's block count) skips the full
        snapshot when nothing moved, as in most decode steps, where a request gains a block only every
        block_size tokens.
        """
        sig = kv_signature(kv)
        if sig == self._last_sig:
            return None
        self._last_sig = sig
        t0 = time.perf_counter()
        snap = kv_snapshot(kv)
        end = time.perf_counter()
        self.kv_cost_s = end - t0
        self._next_kv = end + max(self.kv_interval, self.kv_cost_s / self.kv_budget)
        if snap["runs"] == self._last_runs and snap["owners"] == self._last_owners:
            return None
        self._last_runs, self._last_owners = snap["runs"], snap["owners"]
        return snap
