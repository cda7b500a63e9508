"""Percentiles, with one definition, and a rate that forgets.

Percentiles: numpy's default linear interpolation between the two nearest ranks
(`np.percentile`), which vLLM's serving benchmark reports.

A nearest-rank percentile of the same samples can differ by a whole sample (the p99 of 100 samples is the
99th or the interpolation between the 99th and the 100th); one definition keeps a dashboard's p99, a lab's
and a benchmark's comparable. Histogram estimates (PromQL's `histogram_quantile`, `inferd.autoscale.signals`)
are another concept: they read a quantile from bucket counts, not from the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float] | np.ndarray, p: float, counts: Sequence[int] | None = None) -> float | None:
    """The `p`-th percentile (0 to 100) of `values`; None when there are none.

    NaN values are left out (a request that never finished has no TTFT), as `np.nanpercentile` does.
    `counts`, when given, says how many times each value occurs (one step time for all the tokens a step
    produced): the result is that of the values repeated, without building the repeated array.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} must be between 0 and 100")
    v = np.asarray(values, dtype=float).ravel()
    keep = ~np.isnan(v)
    if counts is None:
        v = v[keep]
        return float(np.percentile(v, p)) if v.size else None
    c = np.asarray(counts, dtype=np.int64).ravel()
    if c.shape != v.shape:
        raise ValueError("counts must have one entry per value")
    keep &= c > 0
    v, c = v[keep], c[keep]
    if not v.size:
        return None
    order = np.argsort(v, kind="stable")
    v, ends = v[order], np.cumsum(c[order])  # value i fills the repeated sample's positions ends[i-1]..ends[i]-1
    rank = p / 100 * (int(ends[-1]) - 1)
    lo = int(np.floor(rank))
    below, above = v[np.searchsorted(ends, [lo, min(lo + 1, int(ends[-1]) - 1)], side="right")]
    return float(below + (above - below) * (rank - lo))


class DecayedRate:
    """A recent rate of something counted (blocks a replica's cache served per second, say): each amount is
    weighed by exp(-age / tau), tau = half_life / ln 2, so an amount counts half after `half_life_s`; a steady
    rate r reads r. No window to keep: one value and when it was last updated."""

    def __init__(self, half_life_s: float):
        self.tau = half_life_s / math.log(2)
        self._value = 0.0
        self._at: float | None = None

    def _decayed(self, now: float) -> float:
        return 0.0 if self._at is None else self._value * math.exp(-max(0.0, now - self._at) / self.tau)

    def add(self, amount: float, now: float) -> None:
        self._value, self._at = self._decayed(now) + amount, now

    def rate(self, now: float) -> float:
        """Per second, at `now`."""
        return self._decayed(now) / self.tau
