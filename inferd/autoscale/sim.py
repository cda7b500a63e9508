"""A discrete-event simulation of one pool: gateway, replicas with continuous batching, the autoscaler.

The model of a replica (from its `Profile`): requests wait in its queue and join the running batch
between steps while fewer than `max_num_seqs` run. A step produces one token for every running request
and takes `step_s(batch)`; a step that prefills prompt tokens takes `tokens / prefill_tokens_per_s`
longer, and a request gets its first token at the end of the step that completes its prompt. With the
profile's `max_num_batched_tokens` a step's tokens are budgeted as the engine's scheduler does (one per
decode, then prompts already started, then newcomers), so a burst of long prompts is prefilled in
chunks over several steps, each paying the decode step again; without it every newcomer's prompt is
prefilled in the step it joins. Between events the batch does not change, so the simulation jumps over runs of identical
steps at once (to the next completion, or to the step boundary after a request arrives), which keeps a
24-hour trace fast. KV cache capacity is not modelled beyond `max_num_seqs`, except for shared prefixes:
given `kv_cache_tokens`, each replica keeps the shared prefixes of the workload (`Workload.prefix_ids`) in an
LRU cache of that many tokens, and a request whose prefix is there when it joins the batch prefills only the
rest of its prompt.

The gateway sends each request to the ready replica with the fewest requests (queued + running), or
holds it while none is ready; with `routing="prefix"` a replica holding the request's prefix counts
`max_num_seqs / 2` requests fewer (prefix affinity, as the gateway's scorers weigh it). When a pool shrinks
(the autoscaler's decision, or `scale_down_at`) the replica to drain is chosen by `victim`: the newest;
one at random; the fewest recent cache hits (`cache_hits`, what `inferd up` and the pod-deletion cost use);
or the fewest tokens of recently used prefixes that no other replica holds (`unique_recent`: what the
traffic would have to recompute without it). The autoscaler is the real `PoolAutoscaler`, fed every `interval_s` the
signals the live fleet would read over `window_s` (percentiles of the exact samples here, by
`inferd.measure.stats`, not histogram estimates).
A new replica serves after `cold_start_s`; one scaled down takes no new requests and leaves once empty.
Replica-hours count every replica from its start to its leaving, loading included.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from inferd.autoscale.policy import PoolAutoscaler
from inferd.autoscale.profile import Profile
from inferd.autoscale.signals import Measured
from inferd.autoscale.workload import Workload
from inferd.errors import ConfigError
from inferd.fleet.spec import AutoscalingPolicy
from inferd.gateway.cache_worth import CACHE_WORTH_WINDOW_S, RecentBlocks, unique_recent_tokens
from inferd.gateway.replicas import CACHE_HALF_LIFE_S
from inferd.measure.stats import DecayedRate, percentile

VICTIMS = ("newest", "random", "cache_hits", "unique_recent")


@dataclass
class SLO:
    ttft_s: float | None = None  # per request
    tpot_s: float | None = None  # per request: mean inter-token time after the first
    ttft_p95_s: float | None = None  # over the run, for the planner
    itl_p95_s: float | None = None


@dataclass(eq=False)
class Replica:
    id: int
    started: float
    ready_at: float
    queue: deque = field(default_factory=deque)  # request indices
    running: list = field(default_factory=list)
    draining: bool = False
    stopped: float | None = None
    busy: bool = False
    block_start: float = 0.0
    block_step: float = 0.0
    block_steps: int = 0
    block_prefill: list = field(default_factory=list)  # requests whose first token this block gives
    pending: dict = field(default_factory=dict)  # running requests whose prompt is not all prefilled: tokens left
    version: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)  # shared prefix -> its tokens, least recent first
    cached: int = 0  # tokens in `cache`
    hits: DecayedRate = field(default_factory=lambda: DecayedRate(CACHE_HALF_LIFE_S))  # prefix tokens served

    def load(self) -> int:
        return len(self.queue) + len(self.running)


@dataclass
class SimResult:
    report: dict
    timeline: dict[str, list[float]]
    ttft: np.ndarray
    tpot: np.ndarray


class Simulator:
    def __init__(
        self,
        profile: Profile,
        workload: Workload,
        policy: AutoscalingPolicy | None = None,
        replicas: int = 1,
        slo: SLO | None = None,
        price_per_hour: float | None = None,
        timeline_s: float | None = None,
        warm_start: bool = True,
        kv_cache_tokens: int | None = None,
        routing: str = "least_load",
        victim: str = "newest",
        victim_horizon_s: float = CACHE_WORTH_WINDOW_S,
        scale_down_at: float | None = None,
        seed: int = 0,
    ):
        if policy is None and replicas < 1:
            raise ValueError("a fixed fleet needs at least one replica")
        if victim not in VICTIMS or routing not in ("least_load", "prefix"):
            raise ConfigError(f"victim must be one of {', '.join(VICTIMS)} and routing least_load or prefix")
        self.kv_tokens, self.routing, self.victim, self.horizon = kv_cache_tokens, routing, victim, victim_horizon_s
        self.rng = random.Random(seed)
        self.prefix_used = RecentBlocks(max(1, len(workload)))  # when each shared prefix was last asked for
        self._prefix_tokens: dict[int, int] = {}  # shared prefix -> its tokens
        self.cached_tokens = 0  # prompt tokens served from the replicas' prefix caches
        self.p, self.w, self.policy, self.slo = profile, workload, policy, slo or SLO()
        self.price = price_per_hour
        self.scaler = PoolAutoscaler("sim", policy) if policy is not None else None
        n = len(workload)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.replicas: list[Replica] = []
        self.gateway: deque[int] = deque()
        self.heap: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.itl_values: list[float] = []  # one entry per (step time, tokens) run, weights in itl_counts
        self.itl_counts: list[int] = []
        self.prefill_busy_s = 0.0
        self.decode_busy_s = 0.0
        self.recent_first: deque = deque()  # (time, ttft, prompt)
        self.recent_done: deque = deque()  # (time, prompt, output)
        self.recent_itl: deque = deque()  # (time, step, count)
        self.recent_busy: deque = deque()  # (end, start, replica id) of each finished run of steps
        self.timeline: dict[str, list[float]] = {
            k: [] for k in ("t", "arrival_rate", "replicas", "ready", "ttft_p95_s", "queued")
        }
        self.timeline_s = timeline_s or (policy.interval_s if policy else max(1.0, workload.duration / 500))
        self._tl_arrivals = 0
        self._tl_ttfts: list[float] = []
        self.decisions = 0
        for _ in range(replicas):
            self._add_replica(0.0, cold=not warm_start)
        if scale_down_at is not None:
            self._push(scale_down_at, "scale_down")

    # -- events --------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload=None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def run(self) -> SimResult:
        arrivals = self.w.arrivals
        i, n = 0, len(arrivals)
        self._push(0.0, "tick")
        while i < n or self._busy():
            t_next = self.heap[0][0] if self.heap else math.inf
            if i < n and arrivals[i] <= t_next:
                self.now = float(arrivals[i])
                self._arrive(i)
                i += 1
                continue
            if not self.heap:
                break
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            if kind == "block":
                rep, version = payload
                if version == rep.version:
                    self._end_block(rep)
            elif kind == "ready":
                self._ready(payload)
            elif kind == "tick":
                self._tick(more=i < n)
            elif kind == "scale_down":
                self._drain(self._victims(self._serving(), 1))
        end = self.now
        for r in self.replicas:
            if r.stopped is None:
                r.stopped = end
        return SimResult(self._report(end), self.timeline, self.first - self.w.arrivals, self._tpot())

    def _busy(self) -> bool:
        return bool(self.gateway) or any(r.busy or r.queue for r in self.replicas if r.stopped is None)

    # -- the gateway ---------------------------------------------------------------------------------
    def _arrive(self, req: int) -> None:
        self._tl_arrivals += 1
        self._route(req)

    def _serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.stopped is None and not r.draining and r.ready_at <= self.now]

    def _route(self, req: int) -> None:
        ready = self._serving()
        if not ready:
            self.gateway.append(req)
            return
        prefix = self._prefix(req)
        if prefix is None:
            rep = min(ready, key=lambda r: (r.load(), r.id))
        else:
            self.prefix_used.touch([prefix[0]], self.now)
            self._prefix_tokens[prefix[0]] = prefix[1]
            bonus = self.p.max_num_seqs / 2 if self.routing == "prefix" else 0.0
            rep = min(ready, key=lambda r: (r.load() - (bonus if prefix[0] in r.cache else 0.0), r.id))
        rep.queue.append(req)
        if not rep.busy:
            self._start_block(rep)
        elif len(rep.running) < self.p.max_num_seqs and rep.block_steps > 1:
            self._cut_block(rep)

    # -- a replica -----------------------------------------------------------------------------------
    def _add_replica(self, now: float, cold: bool = True) -> None:
        ready_at = now + (self.p.cold_start_s if cold else 0.0)
        rep = Replica(len(self.replicas), now, ready_at)
        self.replicas.append(rep)
        self._push(ready_at, "ready", rep)

    def _ready(self, rep: Replica) -> None:
        if rep.stopped is not None or rep.draining:
            return
        while self.gateway:
            self._route(self.gateway.popleft())

    def _start_block(self, rep: Replica) -> None:
        """Plan the next run of identical steps from now."""
        chunks, finished = self._plan_prefill(rep)
        if not rep.running:
            rep.busy = False
            if rep.draining:
                rep.stopped = self.now
            return
        step = self.p.step_s(len(rep.running))
        rep.busy, rep.block_start, rep.block_prefill = True, self.now, finished
        if chunks or rep.pending:  # one step that prefills (chunks of) prompts and decodes the others
            prefill = chunks / self.p.prefill_tokens_per_s
            rep.block_step, rep.block_steps = step + prefill, 1
            self.prefill_busy_s += prefill
        else:
            remaining = min(int(self.w.output_tokens[r] - self.tokens[r]) for r in rep.running)
            rep.block_step, rep.block_steps = step, max(1, remaining)
        rep.version += 1
        self._push(self.now + rep.block_step * rep.block_steps, "block", (rep, rep.version))

    def _plan_prefill(self, rep: Replica) -> tuple[int, list[int]]:
        """The next step's prompt tokens, as the engine's scheduler gives them: each decode takes one token
        of the budget, prompts already started go on first, then queued requests join while there are
        slots and budget; a prompt longer than what is left is cut into chunks over several steps.
        Returns (prompt tokens in the step, the requests whose prompt it completes)."""
        budget = float(self.p.max_num_batched_tokens or math.inf)
        budget -= sum(1 for r in rep.running if r not in rep.pending)
        chunks, finished = 0, []

        def take(req: int) -> None:
            nonlocal budget, chunks
            n = int(min(rep.pending[req], budget))
            rep.pending[req] -= n
            budget -= n
            chunks += n
            if rep.pending[req] == 0:
                del rep.pending[req]
                finished.append(req)

        for req in list(rep.pending):
            if budget <= 0:
                break
            take(req)
        while rep.queue and len(rep.running) < self.p.max_num_seqs and budget > 0:
            req = rep.queue.popleft()
            rep.running.append(req)
            rep.pending[req] = self._to_prefill(rep, req)
            take(req)
        return chunks, finished

    def _prefix(self, req: int) -> tuple[int, int] | None:
        """(shared prefix, its tokens) of a request, where prefixes are modelled."""
        w = self.w
        if self.kv_tokens is None or w.prefix_ids is None or w.prefix_ids[req] < 0:
            return None
        return int(w.prefix_ids[req]), int(w.prefix_tokens[req])

    def _to_prefill(self, rep: Replica, req: int) -> int:
        """The prompt tokens a request joining `rep`'s batch computes: all but a prefix its cache holds. A prefix
        not there is cached now (evicting the least recently used), for the requests after it."""
        prompt, prefix = int(self.w.prompt_tokens[req]), self._prefix(req)
        if prefix is None:
            return prompt
        pid, size = prefix
        if pid in rep.cache:
            rep.cache.move_to_end(pid)
            rep.hits.add(size, self.now)
            self.cached_tokens += size
            return max(1, prompt - size)
        while rep.cache and rep.cached + size > self.kv_tokens:
            rep.cached -= rep.cache.popitem(last=False)[1]
        if size <= self.kv_tokens:
            rep.cache[pid] = size
            rep.cached += size
        return prompt

    def _victims(self, ready: list[Replica], k: int) -> list[Replica]:
        """The k replicas a scale-down drains, by `victim` (newest first among equals)."""
        newest = sorted(ready, key=lambda r: r.started, reverse=True)
        if self.victim == "random":
            return self.rng.sample(ready, k)
        if self.victim == "cache_hits":
            return sorted(newest, key=lambda r: r.hits.rate(self.now))[:k]
        if self.victim == "unique_recent":
            recent = {pid: self._prefix_tokens[pid] for pid in self.prefix_used.since(self.now - self.horizon)}
            worth = unique_recent_tokens(ready, lambda r, pid: pid in r.cache, recent)
            return sorted(newest, key=lambda r: worth[r])[:k]
        return newest[:k]

    def _drain(self, reps: list[Replica]) -> None:
        for rep in reps:
            rep.draining = True
            if not rep.busy and not rep.queue:
                rep.stopped = self.now

    def _cut_block(self, rep: Replica) -> None:
        """A request arrived mid-run: end the run at the next step boundary, where it can join."""
        done = math.floor((self.now - rep.block_start) / rep.block_step + 1e-9)
        steps = min(rep.block_steps, done + 1)
        if steps == rep.block_steps:
            return
        rep.block_steps = steps
        rep.version += 1
        self._push(rep.block_start + rep.block_step * steps, "block", (rep, rep.version))

    def _end_block(self, rep: Replica) -> None:
        steps, step, now = rep.block_steps, rep.block_step, self.now
        newcomers = set(rep.block_prefill)
        decode_step = self.p.step_s(len(rep.running))
        self.decode_busy_s += decode_step * steps
        itl_tokens = 0
        still = []
        for req in rep.running:
            if req in rep.pending:  # its prompt is not done: no token yet
                still.append(req)
                continue
            self.tokens[req] += steps
            if req in newcomers:
                self.first[req] = now + self.p.request_overhead_s
                ttft = self.first[req] - self.w.arrivals[req]
                self.recent_first.append((now, ttft, int(self.w.prompt_tokens[req])))
                self._tl_ttfts.append(ttft)
                itl_tokens += steps - 1
            else:
                itl_tokens += steps
            if self.tokens[req] >= self.w.output_tokens[req]:
                self.done[req] = now + self.p.request_overhead_s
                self.recent_done.append((now, int(self.w.prompt_tokens[req]), int(self.w.output_tokens[req])))
            else:
                still.append(req)
        if itl_tokens:
            self.itl_values.append(step)
            self.itl_counts.append(itl_tokens)
            self.recent_itl.append((now, step, itl_tokens))
        if self.scaler is not None:
            self.recent_busy.append((now, rep.block_start, rep.id))
        rep.running = still
        rep.busy = False
        self._start_block(rep)

    # -- the autoscaler ------------------------------------------------------------------------------
    def _tick(self, more: bool) -> None:
        self._record_timeline()
        if self.scaler is not None:
            self._decide()
        if more or self._busy():
            self._push(self.now + self.timeline_s, "tick")

    def _window(self, seconds: float) -> None:
        for dq in (self.recent_first, self.recent_done, self.recent_itl, self.recent_busy):
            while dq and dq[0][0] < self.now - seconds:
                dq.popleft()

    def measure(self) -> Measured:
        w = self.policy.window_s
        self._window(w)
        live = [r for r in self.replicas if r.stopped is None and r.ready_at <= self.now]
        running = sum(len(r.running) for r in live)
        m = Measured(
            waiting=float(sum(len(r.queue) for r in live)),
            running=float(running),
            kv_cache_usage=running / self.p.max_num_seqs,
            request_rate=len(self.recent_done) / w,
            prompt_token_rate=sum(x[1] for x in self.recent_done) / w,
            generation_token_rate=sum(x[2] for x in self.recent_done) / w,
            prefill_tokens_per_s=self.p.prefill_tokens_per_s,
        )
        if self.recent_first:
            m.ttft_p95_s = percentile([x[1] for x in self.recent_first], 95)
            m.mean_prompt_tokens = float(np.mean([x[2] for x in self.recent_first]))
        if self.recent_itl:
            m.itl_p95_s = percentile([x[1] for x in self.recent_itl], 95, [x[2] for x in self.recent_itl])
        return m

    def utilization(self) -> float:
        """Sum over the ready replicas of the share of the window each spent inside steps: what CPU (or GPU)
        utilisation reports for a replica. It saturates at 1 per replica as soon as one request keeps it
        stepping, however many more could join the batch, which is why it is a poor LLM scaling signal."""
        w = self.policy.window_s
        self._window(w)
        since = self.now - w
        live = {r.id: r for r in self.replicas if r.stopped is None and r.ready_at <= self.now}
        busy = sum(end - max(start, since) for end, start, rid in self.recent_busy if rid in live)
        busy += sum(self.now - max(r.block_start, since) for r in live.values() if r.busy)
        return busy / w

    def _decide(self) -> None:
        ready = self._serving()
        loading = [r for r in self.replicas if r.stopped is None and not r.draining and r.ready_at > self.now]
        s = self.measure().signals(self.now, len(ready), len(loading), float(len(self.gateway)))
        d = self.scaler.decide(s)
        self.decisions += 1
        for _ in range(d.desired - d.current):
            self._add_replica(self.now)
        if d.desired < d.current:
            self._drain(self._victims(ready, d.current - d.desired))

    def _record_timeline(self) -> None:
        tl = self.timeline
        tl["t"].append(self.now)
        tl["arrival_rate"].append(self._tl_arrivals / self.timeline_s)
        tl["replicas"].append(sum(r.stopped is None for r in self.replicas))
        tl["ready"].append(len(self._serving()))
        tl["ttft_p95_s"].append(percentile(self._tl_ttfts, 95) if self._tl_ttfts else math.nan)
        tl["queued"].append(len(self.gateway) + sum(len(r.queue) for r in self.replicas if r.stopped is None))
        self._tl_arrivals, self._tl_ttfts = 0, []

    # -- the report ----------------------------------------------------------------------------------
    def _tpot(self) -> np.ndarray:
        out = self.w.output_tokens
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(out > 1, (self.done - self.first) / np.maximum(out - 1, 1), np.nan)

    def _report(self, end: float) -> dict:
        w, slo = self.w, self.slo
        ttft = self.first - w.arrivals
        tpot = self._tpot()
        finished = ~np.isnan(self.done)
        ok = finished.copy()
        if slo.ttft_s is not None:
            ok &= ttft <= slo.ttft_s
        if slo.tpot_s is not None:
            ok &= np.isnan(tpot) | (tpot <= slo.tpot_s)
        replica_s = sum((r.stopped if r.stopped is not None else end) - r.started for r in self.replicas)
        span = max(end, 1e-9)
        prompt, output = w.prompt_tokens, w.output_tokens
        itl_p95 = percentile(self.itl_values, 95, self.itl_counts)
        rep = {
            "requests": int(len(w)),
            "finished": int(finished.sum()),
            "duration_s": round(end, 3),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p95_s": percentile(ttft, 95),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": float(np.nanmean(ttft)) if len(w) else None,
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p95_s": percentile(tpot, 95),
            "itl_p50_s": percentile(self.itl_values, 50, self.itl_counts),
            "itl_p95_s": itl_p95,
            "request_throughput": float(finished.sum()) / span,
            "input_token_throughput": float(prompt[finished].sum()) / span,
            "output_token_throughput": float(output[finished].sum()) / span,
            "slo": {k: v for k, v in vars(slo).items() if v is not None},
            "slo_attainment": float(ok.mean()) if len(w) else None,
            "request_goodput": float(ok.sum()) / span,
            "output_token_goodput": float(output[ok].sum()) / span,
            "total_token_goodput": float((prompt[ok] + output[ok]).sum()) / span,
            "replica_hours": replica_s / 3600,
            "max_replicas": int(max(self.timeline["replicas"], default=len(self.replicas))),
            "mean_replicas": replica_s / span,
            "cold_starts": int(sum(r.ready_at > r.started for r in self.replicas)),
            "prefill_time_share": self._prefill_share(),
            "cached_prompt_tokens": self.cached_tokens,
        }
        rep["slo_attainment_ttft_p95"] = None if slo.ttft_p95_s is None else rep["ttft_p95_s"] <= slo.ttft_p95_s
        rep["slo_attainment_itl_p95"] = None if slo.itl_p95_s is None else (itl_p95 or 0) <= slo.itl_p95_s
        rep |= self._costs(rep, float(prompt[finished].sum()), float(output[finished].sum()), ok)
        return rep

    def _prefill_share(self) -> float:
        busy = self.prefill_busy_s + self.decode_busy_s
        return self.prefill_busy_s / busy if busy else 0.0

    def _costs(self, rep: dict, input_tokens: float, output_tokens: float, ok: np.ndarray) -> dict:
        if self.price is None:
            return {}
        cost = rep["replica_hours"] * self.price
        share = rep["prefill_time_share"]
        good_in = float(self.w.prompt_tokens[ok].sum())
        good_out = float(self.w.output_tokens[ok].sum())

        def per_m(c: float, tokens: float) -> float | None:
            return c / tokens * 1e6 if tokens > 0 else None

        return {
            "price_per_hour": self.price,
            "cost": cost,
            "cost_per_million_tokens": per_m(cost, input_tokens + output_tokens),
            "cost_per_million_output_tokens": per_m(cost, output_tokens),
            # the replica-time split by what it was spent on: prefill for input, decode for output
            "cost_per_million_input_tokens_split": per_m(cost * share, input_tokens),
            "cost_per_million_output_tokens_split": per_m(cost * (1 - share), output_tokens),
            "goodput_cost_per_million_tokens": per_m(cost, good_in + good_out),
            "goodput_cost_per_million_output_tokens": per_m(cost, good_out),
        }


class UtilisationSimulator(Simulator):
    """The CPU-utilisation rule of Kubernetes' HPA, ceil(total utilisation / target): `utilization` is the
    policy's `running` signal, the baseline an LLM-aware policy is measured against."""

    def measure(self) -> Measured:
        return Measured(running=self.utilization())


def simulate(
    profile: Profile,
    workload: Workload,
    policy: AutoscalingPolicy | None = None,
    replicas: int = 1,
    slo: SLO | None = None,
    price_per_hour: float | None = None,
    timeline_s: float | None = None,
) -> SimResult:
    return Simulator(profile, workload, policy, replicas, slo, price_per_hour, timeline_s).run()
