"""Model routing: the request's `model` (a name or an alias) → an ordered list of pools to try.

The first target is one of the route's backends, drawn by weight (a canary at weight 5 next to 95
gets 5% of the traffic). If no replica of that pool can serve, the route's fallbacks follow in order:
another pool, or another model's whole plan (loops are cut).
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


class ModelRouter:
    def __init__(self, config: GatewayConfig, pools: dict[str, Pool], rng: random.Random | None = None):
        self.pools = pools
        self.rng = rng or random.Random()
        self.routes: dict[str, RouteConfig] = {}
        for r in config.models:
            for name in [r.name, *r.aliases]:
                self.routes[name] = r

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
