"""Picking a replica, as llm-d's endpoint picker does: filters, then a weighted sum of scorers, then a pick.

Filters drop replicas that cannot take the request (unhealthy or ejected, already tried, saturated).
Each scorer maps a replica to [0, 1], higher is better; unknown load (never scraped, or stale) scores
0, never as idle. The picker takes the best weighted sum and breaks ties at random. Picking has no
await in it and raises the winner's in-flight count before returning, so the next request of a burst
already sees this one.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from inferd.gateway.config import RoutingConfig, Saturation
from inferd.gateway.replicas import Load, Replica


@dataclass
class Candidate:
    replica: Replica
    load: Load | None  # None: unknown
    prefix: float = 0.0  # matched fraction of the request's full blocks
    adapter: str | None = None  # the LoRA adapter the request asks for


class AllSaturated(Exception):
    """Healthy replicas exist but every one is saturated: the request should wait at the gateway."""


def saturated(c: Candidate, s: Saturation) -> bool:
    if s.max_in_flight is not None and c.replica.in_flight >= s.max_in_flight:
        return True
    if c.load is None:
        return False
    if s.max_waiting is not None and c.load.waiting > s.max_waiting:
        return True
    return s.max_kv_cache_usage is not None and c.load.kv_usage >= s.max_kv_cache_usage


def score_queue(c: Candidate) -> float:
    return 0.0 if c.load is None else 1.0 / (1.0 + c.load.waiting)


def score_kv_cache(c: Candidate) -> float:
    return 0.0 if c.load is None else max(0.0, 1.0 - c.load.kv_usage)


def score_in_flight(c: Candidate) -> float:
    return 1.0 / (1.0 + c.replica.in_flight)


TOKEN_UNIT = 1024  # in-flight tokens at which the token scorer halves


def score_in_flight_tokens(c: Candidate) -> float:
    return 1.0 / (1.0 + c.replica.in_flight_tokens / TOKEN_UNIT)


def score_prefix(c: Candidate) -> float:
    return c.prefix


def score_lora_affinity(c: Candidate) -> float:
    """As the Gateway API Inference Extension's LoRA affinity: 1 where the adapter already runs (or waits), 0.5
    where the replica has a free adapter slot (it loads the adapter without evicting one in use), else 0;
    a request for the base model scores every replica alike."""
    if c.adapter is None:
        return 1.0
    if c.load is None or c.load.max_loras is None:
        return 0.0
    if c.adapter in c.load.lora_active:
        return 1.0
    return 0.5 if len(c.load.lora_active) < c.load.max_loras else 0.0


SCORERS: dict[str, Callable[[Candidate], float]] = {
    "queue": score_queue,
    "kv_cache": score_kv_cache,
    "in_flight": score_in_flight,
    "in_flight_tokens": score_in_flight_tokens,
    "prefix": score_prefix,
    "lora_affinity": score_lora_affinity,
}


@dataclass
class Pick:
    replica: Replica
    scores: dict[str, float]
    tokens: int = 0  # what this request added to the replica's in-flight tokens

    def release(self) -> None:
        self.replica.in_flight -= 1
        self.replica.in_flight_tokens -= self.tokens


class Picker:
    def __init__(self, routing: RoutingConfig, stale_after_s: float, rng: random.Random | None = None):
        self.routing = routing
        self.stale_after_s = stale_after_s
        self.rng = rng or random.Random()
        self._rr = itertools.count()
        # the scorers that count, read once (a config is never changed in place: a reload builds a new Picker)
        self.weights = {n: w for n, w in routing.scorers.model_dump().items() if w > 0}

    def candidates(
        self, replicas: list[Replica], exclude: set[str], prefix: dict[str, float], adapter: str | None = None
    ) -> list[Candidate]:
        now = time.monotonic()
        return [
            Candidate(r, r.fresh_load(now, self.stale_after_s), prefix.get(r.url, 0.0), adapter)
            for r in replicas
            if r.available(now) and r.url not in exclude
        ]

    def pick(self, cands: list[Candidate], tokens: int = 0) -> Pick | None:
        """The best candidate, counted in flight (with the request's `tokens`); None if there is none;
        AllSaturated if all are full."""
        if not cands:
            return None
        open_ = [c for c in cands if not saturated(c, self.routing.saturation)]
        if not open_:
            raise AllSaturated()
        chosen, scores = self._choose(open_)
        chosen.replica.in_flight += 1  # before returning: the next pick sees it
        chosen.replica.in_flight_tokens += tokens
        return Pick(chosen.replica, scores, tokens)

    def _choose(self, cands: list[Candidate]) -> tuple[Candidate, dict[str, float]]:
        mode = self.routing.picker
        if mode == "round_robin":
            ordered = sorted(cands, key=lambda c: c.replica.url)
            return ordered[next(self._rr) % len(ordered)], {}
        if mode == "random":
            return self.rng.choice(cands), {}
        weights = self.weights
        scored = []
        for c in cands:
            parts = {name: SCORERS[name](c) for name in weights}
            scored.append((sum(weights[n] * v for n, v in parts.items()), c, parts))
        best = max(s for s, _, _ in scored)
        ties = [(c, parts) for s, c, parts in scored if s >= best - 1e-9]
        return self.rng.choice(ties)
