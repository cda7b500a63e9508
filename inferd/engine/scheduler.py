"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every step, each scheduled request gets a number of tokens to compute. A decoding request needs one
(its last sampled token); a prefilling request takes the next chunk of what it has not computed yet.
Prefill chunks and decodes share a step, so a long prompt never stalls the requests already running.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from inferd.config import SchedulerConfig
from inferd.engine.kv_cache import KVCacheManager
from inferd.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What one step computes: tokens per request, in the order the runner lays them out."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # under KV pressure, admit nothing new this step
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step: all that remain, within the budget and the chunk cap."""
        limit = self.config.long_prefill_token_threshold
        return min(remaining, budget, limit) if limit > 0 else min(remaining, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                victim = self.running.pop()  # the newest arrival has the lowest priority
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.requests.append(request)
                out.num_scheduled_tokens[request.request_id] = n
                budget -= n
                i += 1
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        logger.info(
            "preempted %s (%d tokens) to free KV blocks; it will be recomputed",
            request.request_id,
            request.num_tokens,
        )

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # waiting requests (new or preempted) have nothing computed: all they reuse comes from the cache
            computed = self.kv.find_computed_blocks(request)
            n = self._chunk(request.num_tokens - computed.num_tokens, budget)
            if not self.kv.allocate_slots(request, n, computed):
                break
            self.kv.record_lookup(request, computed)
            self.waiting.popleft()
            request.num_computed_tokens = computed.num_tokens
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = computed.num_tokens
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
