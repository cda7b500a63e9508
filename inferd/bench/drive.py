"""Serve a workload on an in-process engine with real arrival times, as a server would, and time it.

The labs' timed runs go through here. The engine is handed in (`LLM`, or anything with its `engine`); this
module imports none of it, so it sits with the benchmark's metrics it converts its times to.

`serve` feeds requests into `Engine` when they arrive (open loop: at their arrival time; closed loop: as soon
as fewer than `concurrency` are in flight; or after a number of steps), steps the engine, and records every
request's times (arrival, first scheduled, first token, each gap, finish) and every step (its duration and
how many requests were decoding, prefilling and waiting before it). `static_batch` runs the same arrivals
the pre-continuous-batching way: a batch starts when it is full (or nothing more will come soon) and no
request joins until the whole batch has finished.

The times convert to the benchmark's `RequestTiming`, so TTFT, TPOT, ITL and goodput are computed with
the same vLLM definitions `inferd bench` uses (`inferd.bench.metrics`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferd.bench.metrics import RequestTiming, compute_run_metrics
from inferd.bench.runner import spec_decode_fields
from inferd.measure.arrivals import arrival_offsets
from inferd.sampling import SamplingParams


@dataclass
class Job:
    """One request of a workload: token ids (or text) in, exactly `max_tokens` out (greedy, eos ignored), unless
    it brings its own sampling settings."""

    prompt: list[int] | str
    max_tokens: int
    at: float = 0.0  # arrival, seconds after the start (open loop)
    at_step: int | None = None  # or: arrives once this many steps have run
    cache_salt: str | None = None
    params: SamplingParams | None = None  # its own sampling settings, max_tokens included, instead


@dataclass
class Served:
    """What one request saw, in seconds since the start of the run."""

    arrival: float
    first_scheduled: float
    first_token: float
    finished: float
    itls: list[float]
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    text: str  # what it generated
    finish_reason: str | None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def queueing(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def prefill(self) -> float:
        return self.first_token - self.first_scheduled


@dataclass
class StepLog:
    start: float
    duration: float
    decoding: int  # requests computing one generated token this step
    prefilling: int  # running requests still computing their prompt
    waiting: int


@dataclass
class Run:
    served: list[Served]  # in job order
    steps: list[StepLog]
    duration: float
    spec_decode: dict = field(default_factory=dict)  # the run's drafts and acceptance, as `inferd bench` reports

    def timings(self) -> list[RequestTiming]:
        out = []
        for s in self.served:
            chunks = [s.first_token]
            for gap in s.itls:
                chunks.append(chunks[-1] + gap)
            out.append(RequestTiming(s.arrival, s.finished, chunks, True, None, s.input_tokens, s.output_tokens))
        return out

    def metrics(self, slos: dict[str, float] | None = None) -> dict:
        """vLLM's serving metrics (ms, tokens/s) over this run."""
        start = min(s.arrival for s in self.served)
        end = max(s.finished for s in self.served)
        return compute_run_metrics(self.timings(), start, end, slos).as_dict()

    @property
    def busy_fraction(self) -> float:
        """Share of the run's wall time spent inside engine steps."""
        return sum(s.duration for s in self.steps) / self.duration if self.duration else 0.0

    def slot_use(self, batch: int) -> float:
        """Mean share of a batch of `batch` slots holding a request that computes, over the run's steps."""
        return statistics.mean(min(batch, s.decoding + s.prefilling) / batch for s in self.steps)

    def decode_steps(self) -> dict[int, list[float]]:
        """Durations of the steps in which requests only decoded (none prefilled or waited), by how many did."""
        out: dict[int, list[float]] = {}
        for s in self.steps:
            if s.decoding and s.prefilling == 0 and s.waiting == 0:
                out.setdefault(s.decoding, []).append(s.duration)
        return out

    def pure_decode_steps(self, batch: int) -> list[float]:
        """Durations of steps in which exactly `batch` requests decoded and nothing else ran or waited."""
        return self.decode_steps().get(batch, [])


def random_prompts(rng: random.Random, vocab: int, count: int, length: int) -> list[list[int]]:
    """Distinct random token-id prompts (ids clear of the low special tokens), so no prefix is shared."""
    hi = min(vocab, 50_000)
    return [[rng.randrange(16, hi) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class SharedPrefixes:
    """A shared-prefix workload in token ids (as `SharedPrefixDataset` in text): `prefixes` system prompts of
    `prefix_len` tokens, each followed by `users` different questions of `question_len` tokens."""

    prefixes: int
    users: int
    prefix_len: int
    question_len: int

    def prompts(self, seed: int, vocab: int) -> list[list[int]]:
        """Every prefix with each of its users' questions, in random order."""
        rng = random.Random(seed)
        heads = random_prompts(rng, vocab, self.prefixes, self.prefix_len)
        prompts = [h + random_prompts(rng, vocab, 1, self.question_len)[0] for h in heads for _ in range(self.users)]
        rng.shuffle(prompts)
        return prompts

    @property
    def max_len(self) -> int:
        """A context length for one prompt and two tokens out, in whole 16-token blocks."""
        return 16 * (2 + (self.prefix_len + self.question_len) // 16)

    def blocks_holding(self, share: float) -> int:
        """16-token KV blocks for `share` of all the prefixes, and never fewer than two requests at max_len need."""
        return max(int(share * self.prefixes * self.prefix_len / 16), 2 * self.max_len // 16)


def arriving(prompts: list[list[int]], max_tokens: int | Sequence[int], rate: float, seed: int = 0) -> list[Job]:
    """Jobs arriving as a Poisson process at `rate` per second (`inferd.measure.arrivals`), in prompt order."""
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    times = arrival_offsets(len(prompts), rate, 1.0, seed).tolist()
    return [Job(p, n, at=t) for p, n, t in zip(prompts, lengths, times, strict=True)]


def capacity_rps(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Requests/s the engine completes when these requests arrive at once: the scale for arrival rates."""
    return len(prompts) / serve(llm, [Job(p, max_tokens) for p in prompts]).duration


class _Feeder:
    """Decides when each job enters the engine."""

    def __init__(self, jobs: Sequence[Job], concurrency: int | None, static_batch: int | None, max_wait: float):
        self.pending = deque(sorted(range(len(jobs)), key=lambda i: (jobs[i].at_step is not None, jobs[i].at)))
        self.jobs = jobs
        self.concurrency = concurrency
        self.static_batch = static_batch
        self.max_wait = max_wait
        self.queue: deque[tuple[int, float]] = deque()  # static batching: arrived, not yet admitted

    def arrivals(self, now: float, steps: int, in_flight: int) -> list[tuple[int, float]]:
        """(job index, arrival time) of the jobs that arrive now."""
        out = []
        for i in list(self.pending):
            job = self.jobs[i]
            if self.concurrency is not None:
                if in_flight + len(out) >= self.concurrency:
                    break
                out.append((i, now))
            elif job.at_step is not None:
                stalled = in_flight + len(out) == 0 and self.next_time() is None  # no step will ever come
                if steps >= job.at_step or stalled:
                    out.append((i, now))
            elif job.at <= now:
                out.append((i, job.at))
            else:
                continue
        for i, _ in out:
            self.pending.remove(i)
        return out

    def admit(self, now: float, engine_idle: bool) -> list[tuple[int, float]]:
        """Static batching: the next batch, once the engine is idle and the batch is full or overdue."""
        if not engine_idle or not self.queue:
            return []
        full = len(self.queue) >= self.static_batch
        overdue = now - self.queue[0][1] >= self.max_wait
        if full or overdue or not self.pending:
            return [self.queue.popleft() for _ in range(min(self.static_batch, len(self.queue)))]
        return []

    def next_time(self) -> float | None:
        times = [self.jobs[i].at for i in self.pending if self.jobs[i].at_step is None]
        return min(times) if times and self.concurrency is None else None


def serve(
    llm,
    jobs: Sequence[Job],
    *,
    concurrency: int | None = None,
    static_batch: int | None = None,
    max_wait: float = 0.5,
) -> Run:
    """Run `jobs` through the engine of `llm` and time everything (see the module docstring)."""
    engine = llm.engine
    llm.reset_prefix_cache()  # each run starts cold: an earlier run's prompts must not hit
    feeder = _Feeder(jobs, concurrency, static_batch, max_wait)
    counters = _spec_counters(engine)
    t0 = time.monotonic()
    ids: dict[str, int] = {}
    results: dict[int, Served] = {}
    steps: list[StepLog] = []

    def add(i: int, arrival: float) -> None:
        rid = f"lab-{i}-{engine.new_request_id()}"
        ids[rid] = i
        params = jobs[i].params or SamplingParams(max_tokens=jobs[i].max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(rid, jobs[i].prompt, params, cache_salt=jobs[i].cache_salt, arrival_time=t0 + arrival)

    while feeder.pending or feeder.queue or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        in_flight = len(ids) - len(results)
        for i, arrival in feeder.arrivals(now, len(steps), in_flight):
            if static_batch is None:
                add(i, arrival)
            else:
                feeder.queue.append((i, arrival))
        if static_batch is not None:
            for i, arrival in feeder.admit(now, not engine.has_unfinished_requests()):
                add(i, arrival)
        if not engine.has_unfinished_requests():
            _sleep_until(feeder, t0, max_wait if feeder.queue else None)
            continue
        sched = engine.scheduler
        decoding = sum(1 for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens)
        log = StepLog(now, 0.0, decoding, len(sched.running) - decoding, len(sched.waiting))
        start = time.monotonic()
        outputs = engine.step()
        log.duration = time.monotonic() - start
        steps.append(log)
        for out in outputs:
            if out.finished:
                results[ids[out.request_id]] = _served(out, t0)
    duration = time.monotonic() - t0
    spec = spec_decode_fields(counters, _spec_counters(engine))
    return Run([results[i] for i in range(len(jobs))], steps, duration, spec)


def _spec_counters(engine) -> dict[str, int]:
    """The engine's speculative-decoding counters under the names `spec_decode_fields` reads."""
    stats = engine.stats()
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {f"spec_decode_{k}": getattr(stats, f"spec_{k}") for k in names}


def _sleep_until(feeder: _Feeder, t0: float, wait: float | None) -> None:
    due = feeder.next_time()
    now = time.monotonic() - t0
    delays = [d - now for d in (due,) if d is not None]
    if wait is not None:
        delays.append(0.005)
    if delays:
        time.sleep(max(0.0, min(delays)))


def _served(out, t0: float) -> Served:
    m = out.metrics
    t = m.times
    return Served(
        arrival=t.arrival - t0,
        first_scheduled=t.first_scheduled - t0,
        first_token=t.first_token - t0,
        finished=t.finished - t0,
        itls=list(t.inter_token_latencies),
        input_tokens=m.num_prompt_tokens,
        output_tokens=m.num_generation_tokens,
        cached_tokens=m.num_cached_tokens,
        text=out.outputs[0].text,
        finish_reason=out.outputs[0].finish_reason,
    )
