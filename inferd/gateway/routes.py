"""Model routing: the request's `model` (a name, an alias or a LoRA adapter) → an ordered list of pools to try.

The first target is one of the route's backends, drawn by weight (a canary at weight 5 next to 95
gets 5% of the traffic). If no replica of that pool can serve, the route's fallbacks follow in order:
another pool, or another model's whole plan (loops are cut). A LoRA adapter's request goes to the same
pools under the adapter's own name (the replicas serve it by that name); another model cannot serve it, so
only the route's pool fallbacks follow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from inferd.gateway.config import Backend, GatewayConfig, RouteConfig
from inferd.gateway.replicas import Pool


@dataclass(frozen=True)
class Target:
    pool: Pool
    model: str  # the model name sent upstream
    adapter: str | None = None  # the LoRA adapter asked for (then also `model`)


class ModelRouter:
    def __init__(self, config: GatewayConfig, pools: dict[str, Pool], rng: random.Random | None = None):
        self.pools = pools
        self.rng = rng or random.Random()
        self.routes: dict[str, RouteConfig] = {}
        self.adapters: set[str] = set()
        for r in config.models:
            for name in [r.name, *r.aliases, *r.adapters]:
                self.routes[name] = r
            self.adapters.update(r.adapters)

    def names(self) -> list[str]:
        return list(self.routes)

    def resolve(self, name: str) -> RouteConfig | None:
        return self.routes.get(name)

    def plan(self, name: str, _seen: frozenset[str] = frozenset()) -> list[Target]:
        route = self.routes[name]
        if route.name in _seen:
            return []
        seen = _seen | {route.name}
        backends = [b for b in route.backends if b.weight > 0]
        first = backends[0] if len(backends) == 1 else self.rng.choices(backends, [b.weight for b in backends])[0]
        if name in self.adapters:
            pools = [self.pools[first.pool], *(self.pools[fb.pool] for fb in route.fallbacks if fb.pool is not None)]
            return list(dict.fromkeys(Target(pool, name, name) for pool in pools))
        targets = [self._target(route, first)]
        if not route.fallbacks:
            return targets
        for fb in route.fallbacks:
            if fb.pool is not None:
                pool = self.pools[fb.pool]
                targets.append(Target(pool, pool.config.model or route.name))
            else:
                targets.extend(self.plan(fb.model, seen))
        return list(dict.fromkeys(targets))  # a pool tried once per model name

    def _target(self, route: RouteConfig, backend: Backend) -> Target:
        pool = self.pools[backend.pool]
        return Target(pool, backend.model or pool.config.model or route.name)
