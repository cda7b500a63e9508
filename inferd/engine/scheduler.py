"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every step, each scheduled request gets a number of tokens to compute. A decoding request needs one
(its last sampled token); a prefilling request takes the next chunk of what it has not computed yet.
Prefill chunks and decodes share a step, so a long prompt never stalls the requests already running.
A chunk may reach past the prompt into output tokens computed again (after a preemption, or the delivered
tokens of a resumed stream): it says how many (`num_recompute`), and the runner computes them as decoding did.

The scheduler is also the one place where a request moves forward: `update_from_output` advances
`num_computed_tokens`, appends the sampled tokens and applies the token-level stops (`check_stop`);
`finish` ends a request for any other reason (a stop string the engine found, an abort).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from inferd.config import SchedulerConfig
from inferd.engine.kv_cache import ComputedBlocks, KVCacheManager
from inferd.engine.spec_decode import takes_drafts
from inferd.engine.step import NewRequest, RunnerOutput, ScheduledChunk, SchedulerOutput
from inferd.outputs import TokenLogprobs
from inferd.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Whether the token just appended ends `request`: (status, stop_reason), or None to go on.

    An end-of-sequence or stop token counts once `min_tokens` are out (the sampler masks them before
    that), or at once for a structured request, whose grammar allows eos only where the output is complete
    (the sampler lets the grammar override min_tokens there); a stop token is named as the stop reason, eos
    is not. Then the length limits: `max_tokens` and the model's context. Stop strings are text, so the
    engine checks them after detokenizing.
    """
    params = request.params
    num_output = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    grammar_done = params.structured is not None and last in request.eos_token_ids
    if num_output >= params.min_tokens or grammar_done:
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


class PriorityQueue:
    """The waiting requests in `Request.rank` order (`Scheduler.rank`), with the deque operations the scheduler
    uses: under the priority and deadline policies every insertion, the front ones included, goes to its place."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def _insert(self, request: Request) -> None:
        bisect.insort(self._items, request, key=lambda r: r.rank)

    append = appendleft = _insert

    def extendleft(self, requests: Iterable[Request]) -> None:
        for r in requests:
            self._insert(r)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, request: object) -> bool:
        return request in self._items


@dataclass
class SampledToken:
    """A token appended to a request this step, for the engine to detokenize and report."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None
    index: int = -1  # its place in request.output_token_ids


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.priority = config.scheduling_policy != "fcfs"  # ranked: priority or deadline
        self.waiting: deque[Request] | PriorityQueue = PriorityQueue() if self.priority else deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # for the next step record: the runner drops their state
        # K/V from outside (inferd.engine.kv_connector): requests whose blocks are being loaded this step,
        # with their computed tokens once loaded
        self.connector = None
        self.loading: dict[str, tuple[Request, int]] = {}
        self._load_started: dict[str, float] = {}
        # speculative decoding: drafts for the next step by request (`set_drafts`), used once
        self.drafts: dict[str, list[int]] = {}
        # self-drafting: slots past a decoding request's chunk for the drafts the runner makes after the step
        # (`lookahead` of them, in steps with at most `lookahead_max_running` running requests); 0: none
        self.lookahead = 0
        self.lookahead_max_running: int | None = None
        # LoRA: the most adapters running requests may use at once (the model's slots); None without LoRA
        self.max_loras: int | None = None

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        request.rank = self.rank(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def rank(self, request: Request) -> tuple:
        """Its place under the ranked policies, fixed at arrival (so the waiting queue stays sorted):
        priority: (class, arrival), or with aging (arrival + class x priority_aging_s), a virtual arrival, so a
        request waits behind later arrivals of earlier classes only for a bounded time; deadline: its TTFT
        deadline, earliest first."""
        c, arrival = self.config, request.times.arrival
        if c.scheduling_policy == "deadline":
            due = request.ttft_deadline if request.ttft_deadline is not None else c.ttft_deadline_s
            return arrival + due, request.request_id
        if c.priority_aging_s is not None:
            return arrival + request.priority * c.priority_aging_s, request.request_id
        return request.priority, arrival, request.request_id

    # -- scheduling --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        if self.connector is not None:
            self.connector.housekeeping(self.kv)
        budget = self.config.max_num_batched_tokens
        if self.priority:
            self._preempt_for_priority(out)
        for_priority = len(out.preempted_ids)
        head = self._admissible_head(budget)
        budget = self._schedule_running(out, budget, head)
        if len(out.preempted_ids) == for_priority:  # under KV pressure, admit nothing new this step
            self._schedule_waiting(out, budget, head)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        self.drafts = {}
        return out

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Draft tokens the next step verifies, by request (inferd/engine/spec_decode.py)."""
        self.drafts = drafts

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step: all that remain, within the budget and the chunk cap."""
        limit = self.config.long_prefill_token_threshold
        return min(remaining, budget, limit) if limit > 0 else min(remaining, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int, head: Request | None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            draft = self.drafts.get(request.request_id, []) if remaining == 1 else []
            if head is not None and remaining > 1 and request.rank > head.rank and not self._same_class(request, head):
                i += 1  # a later-ranked prefill sits out the step that admits the waiting head: a short step
                continue
            n = self._chunk(remaining + len(draft), budget)
            draft = draft[: n - remaining]
            num_blocks = self.kv.num_blocks_of(request.request_id)
            ahead = self._lookahead(request, n, len(draft))
            if ahead and not self.kv.allocate_slots(request, n, num_lookahead=ahead):
                ahead = 0  # drafts are worth no preemption
            while not ahead and not self.kv.allocate_slots(request, n):
                victim = self._victim(i)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk_record(request, request.num_computed_tokens, n, num_blocks, draft, ahead))
                budget -= n
                i += 1
        return budget

    def _lookahead(self, request: Request, n: int, num_drafts: int) -> int:
        """Draft slots for a decoding request whose chunk samples (`lookahead`, within its max_tokens and the
        context: the drafts after this step's token must fit there, with the token the next step adds)."""
        limit = self.lookahead_max_running
        if not self.lookahead or (limit is not None and len(self.running) > limit) or not takes_drafts(request):
            return 0
        if n - num_drafts != request.num_tokens - request.num_computed_tokens:
            return 0  # the budget cut the chunk: nothing is sampled this step
        room = min(
            request.params.max_tokens - len(request.output_token_ids) - num_drafts - 2,
            self.max_model_len - (request.num_computed_tokens + n) - 1,
        )
        return max(0, min(self.lookahead, room))

    def _admissible_head(self, budget: int) -> Request | None:
        """Under a ranked policy: the first waiting request, if it can be admitted this step (a sequence slot and
        KV blocks for its first chunk are free). Running prefills ranked after it, of another class, sit that
        step out, and no waiting request of another class is admitted beside it, so it is not left to wait out
        a batch job's long prompt chunk by chunk and the step that computes its prompt beside the decodes is
        short: its first token comes one short step after the step it arrived in (an interactive request's
        TTFT under overload). None otherwise."""
        if not self.priority or not self.waiting:
            return None
        head = self.waiting[0]
        if self._first_chunk_fits(head, budget) is None or not self.adapter_fits(head):
            return None
        return head

    def _first_chunk_fits(self, request: Request, budget: int) -> int | None:
        """The tokens of a waiting request's first chunk within `budget`, if a sequence slot and KV blocks for
        them are free now; None if not."""
        first_chunk = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
        full = len(self.running) + len(self.loading) >= self.config.max_num_seqs
        if full or self.kv.blocks_needed(first_chunk) > self.kv.pool.num_free_blocks:
            return None
        return first_chunk

    def _same_class(self, a: Request, b: Request) -> bool:
        """Of one class under the ranked policies: the same priority, or under deadline the same TTFT deadline."""
        if self.config.scheduling_policy == "deadline":
            return a.ttft_deadline == b.ttft_deadline
        return a.priority == b.priority

    def _victim(self, i: int) -> Request:
        """The running request to preempt for KV room, among those not scheduled yet this step (from the i-th
        on): the newest arrival, or under a ranked policy the last ranked (it leaves `running`)."""
        if not self.priority:
            return self.running.pop()
        victim = max(self.running[i:], key=lambda r: r.rank)
        self.running.remove(victim)
        return victim

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Before anything is scheduled: while the first waiting request comes before the last running one and
        finds no room (every sequence slot taken, or too few free KV blocks for its first chunk), preempt the
        last running one (recomputed later, as any preemption)."""
        while self.waiting and self.running:
            head = self.waiting[0]
            worst = max(self.running, key=lambda r: r.rank)
            if worst.rank <= head.rank:
                return
            if self._first_chunk_fits(head, self.config.max_num_batched_tokens) is not None:
                return
            self.running.remove(worst)
            self._preempt(worst, out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        logger.info(
            "preempted %s (%d tokens) to free KV blocks; it will be recomputed",
            request.request_id,
            request.num_tokens,
        )

    def adapter_fits(self, request: Request) -> bool:
        """Whether `request` may join the running ones without their adapters outnumbering the LoRA slots."""
        if self.max_loras is None or request.lora_name is None:
            return True
        active = {r.lora_name for r in self.running} | {r.lora_name for r, _ in self.loading.values()}
        active.discard(None)
        return request.lora_name in active or len(active) < self.max_loras

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, head: Request | None = None) -> None:
        skipped: list[Request] = []  # their adapter has no slot this step: they keep their place in line
        try:
            self._admit(out, budget, skipped, head)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit(self, out: SchedulerOutput, budget: int, skipped: list[Request], head: Request | None) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = self.waiting[0]
            if head is not None and request is not head and not self._same_class(request, head):
                break  # the head's step stays short: later classes start at the next one
            if not self.adapter_fits(request):
                skipped.append(self.waiting.popleft())
                continue
            # a request holding blocks already had its K/V loaded by the KV connector
            loaded = self.kv.num_blocks_of(request.request_id) > 0
            # waiting requests (new or preempted) have nothing computed: all they reuse comes from the cache
            computed = ComputedBlocks() if loaded else self.kv.find_computed_blocks(request)
            if not loaded and self.connector is not None:
                started = self._start_load(request, computed)
                if started is not None:
                    if not started:
                        break
                    continue
            start = request.num_computed_tokens if loaded else computed.num_tokens
            n = self._chunk(request.num_tokens - start, budget)
            if not self.kv.allocate_slots(request, n, computed):
                break
            if not loaded:
                self.kv.record_lookup(request, computed)
            self.waiting.popleft()
            request.num_computed_tokens = start
            if request.status == RequestStatus.WAITING:  # new to the runner; a preempted one it still knows
                request.num_cached_tokens = start
                out.new_requests.append(
                    NewRequest(
                        request.request_id,
                        request.prompt_token_ids,
                        request.params,
                        request.eos_token_ids,
                        request.lora_name,
                    )
                )
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk_record(request, start, n, 0))
            budget -= n

    def _start_load(self, request: Request, computed: ComputedBlocks) -> bool | None:
        """Allocate blocks for K/V the connector can load: True if started, False if no room, None if none."""
        num_external = self.connector.get_num_new_matched_tokens(request, computed.num_tokens)
        if num_external <= 0:
            return None
        if not self.kv.allocate_for_load(request, computed, num_external):
            return False
        self.kv.record_lookup(request, computed)
        self.waiting.popleft()
        block_ids = self.kv.block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, computed.num_tokens, num_external)
        self.loading[request.request_id] = (request, computed.num_tokens + num_external)
        self._load_started[request.request_id] = time.monotonic()
        return True

    def _finish_loads(self, out: RunnerOutput) -> None:
        """Loaded requests wait (first in line) to compute the rest; failed ones recompute from scratch."""
        now = time.monotonic()
        for request_id in [*out.failed_loading, *out.finished_loading]:
            self.loading[request_id][0].kv_load_seconds += now - self._load_started.pop(request_id, now)
        for request_id in out.failed_loading:
            request, _ = self.loading.pop(request_id)
            self.kv.free(request)  # the blocks being loaded were never entered in the prefix cache
            request.num_computed_tokens = 0
            self.waiting.appendleft(request)
        for request_id in reversed(out.finished_loading):
            request, num_tokens = self.loading.pop(request_id)
            request.num_loaded_tokens += num_tokens - request.num_computed_tokens
            request.num_computed_tokens = num_tokens
            self.waiting.appendleft(request)

    def _chunk_record(
        self,
        request: Request,
        start: int,
        n: int,
        num_known_blocks: int,
        draft: list[int] | None = None,
        num_lookahead: int = 0,
    ) -> ScheduledChunk:
        """The step record of `request`: its next n tokens from `start` (the last of them drafts, if any), the
        blocks the runner lacks, and the slots past them for the runner's own drafts."""
        draft = draft or []
        end = start + n - len(draft)
        is_decode = n - len(draft) == 1 and end == request.num_tokens and start >= request.num_prompt_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end) + draft,
            start=start,
            is_prefill=not is_decode,
            samples=end == request.num_tokens,
            new_block_ids=self.kv.block_ids(request.request_id, num_known_blocks),
            num_drafts=len(draft),
            num_lookahead=num_lookahead,
            num_recompute=0 if is_decode else max(0, end - max(start, request.num_prompt_tokens)),
        )

    # -- progress ----------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[SampledToken]:
        """Move every scheduled request forward by what the step computed and sampled."""
        if out.finished_loading or out.failed_loading:
            self._finish_loads(out)
        for chunk in sched.chunks:  # rejected drafts are not computed: the next step overwrites their K/V
            rejected = chunk.num_drafts - len(out.accepted_drafts.get(chunk.request_id, ()))
            request = self.requests[chunk.request_id]
            request.num_computed_tokens += chunk.num_tokens - rejected
            if chunk.is_prefill:
                request.num_prefill_chunks += 1
            else:
                request.num_decode_steps += 1
        now = time.monotonic()
        sampled = []
        for request_id, last, logprobs in zip(out.request_ids, out.token_ids, out.logprobs, strict=True):
            request = self.requests[request_id]
            request.times.on_token(now)  # once a step: kept drafts arrive with the step's token (vLLM's ITL)
            for token_id in [*out.accepted_drafts.get(request_id, ()), last]:
                request.output_token_ids.append(token_id)
                sampled.append(SampledToken(request, token_id, logprobs, len(request.output_token_ids) - 1))
                stop = check_stop(request, self.max_model_len)
                if stop is not None:
                    self.finish(request, *stop)
                    break
        return sampled

    def finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request (a stop, a stop string, an abort): drop it from the queues and free its blocks.

        A request that has already finished only takes the new status and reason (a stop string found
        in the token that also reached max_tokens makes it a stop, as in vLLM).
        """
        request.status = status
        request.stop_reason = stop_reason
        request.times.finished = time.monotonic()
        if self.requests.pop(request.request_id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.loading.pop(request.request_id, None)
        if self.connector is None or not self.connector.request_finished(request, self.kv):
            self.kv.free(request)
        self._finished_ids.append(request.request_id)
