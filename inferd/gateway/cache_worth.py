"""What a replica's prefix cache is worth to the traffic: the scale-down victim's signal.

When a pool shrinks, the replica to remove is the one whose cache the traffic would miss least. Recent cache
hits (`Replica.cache_hits`) rank popularity, but a popular prefix lost with its replica is computed once on a
survivor and cached there again; what a scale-down really costs is every prefix that only the victim holds and
that the traffic still asks for. So a replica's worth is the tokens of the prefix blocks asked for in the last
`CACHE_WORTH_WINDOW_S` that no other replica of its pool holds (`unique_recent_tokens`). The gateway keeps when
each block key was last asked for (`RecentBlocks`) and reads who holds it from the KV events where replicas
publish them (else from the keys it sent there). The simulator ranks its replicas the same way
(`inferd.autoscale.sim`, victim `unique_recent`), which is where this signal was measured against the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

CACHE_WORTH_WINDOW_S = 300.0  # a prefix asked for within this long counts as one the traffic still asks for


def unique_recent_tokens(
    replicas: Sequence[Hashable], holds: Callable[[Hashable, Hashable], bool], recent: Mapping[Hashable, int]
) -> dict:
    """Per replica, the tokens of the recently asked-for prefixes (`recent`: key -> its tokens) that it alone
    holds (`holds(replica, key)`): what the traffic would compute again without it. A prefix held twice costs
    nothing to lose once; one not asked for lately is not in `recent`."""
    worth = dict.fromkeys(replicas, 0)
    for key, tokens in recent.items():
        holding = [r for r in replicas if holds(r, key)]
        if len(holding) == 1:
            worth[holding[0]] += tokens
    return worth


class RecentBlocks:
    """When each prefix block key was last asked for, the most recent `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._at: OrderedDict[Hashable, float] = OrderedDict()

    def touch(self, keys: Iterable[Hashable], now: float) -> None:
        for key in keys:
            self._at[key] = now
            self._at.move_to_end(key)
        while len(self._at) > self.capacity:
            self._at.popitem(last=False)

    def since(self, t: float) -> list[Hashable]:
        """The keys asked for at or after `t`, the newest first."""
        out = []
        for key, at in reversed(self._at.items()):
            if at < t:
                break
            out.append(key)
        return out
