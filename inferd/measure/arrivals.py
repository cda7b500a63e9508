"""When requests arrive: Poisson or gamma inter-arrivals at a request rate, and a rate that varies in time.

Same as vLLM: inter-arrival times ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean is
1/rate whatever the burstiness; burstiness 1 is a Poisson process, < 1 burstier, > 1 more even.

Two ways to bound a schedule: by count (`arrival_offsets`, `inter_arrival_times`: a load generator's
run, whose first request goes at once so its duration measures serving, not the first wait) or by
duration (`arrivals_within`: a process observed over [0, duration), as the simulator's and the labs'
workloads are). `thinned_arrivals` is the non-homogeneous Poisson process of a rate that changes over
time (a day's traffic). Every lab, benchmark, the simulator and `inferd bench` draw arrivals here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def _check(rate: float, burstiness: float) -> None:
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if rate <= 0:
        raise ValueError("request rate must be > 0 (use inf to send everything at once)")


def _gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def inter_arrival_times(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds to wait before each request, relative to the previous one (the first is 0)."""
    if count < 0:
        raise ValueError("count must be >= 0")
    _check(rate, burstiness)
    if math.isinf(rate):
        return np.zeros(count)
    gaps = _gaps(count, rate, burstiness, rng)
    if count:
        gaps[0] = 0.0  # the run starts with a request, so duration measures serving, not the first wait
    return gaps


def arrival_offsets(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start of the run (the first at 0), reproducible from `seed`."""
    return np.cumsum(inter_arrival_times(count, rate, burstiness, np.random.default_rng(seed)))


def arrivals_within(duration: float, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in [0, duration) of the process at `rate`, sorted; the first after one gap from 0."""
    _check(rate, burstiness)
    if math.isinf(rate):
        raise ValueError("a process over a duration needs a finite rate")
    n = int(rate * duration * 1.2 + 50)  # enough in one draw but rarely
    t = np.cumsum(_gaps(n, rate, burstiness, rng))
    while t[-1] < duration:
        t = np.concatenate([t, t[-1] + np.cumsum(_gaps(n, rate, burstiness, rng))])
    return t[t < duration]


def thinned_arrivals(
    rate_fn: Callable[[np.ndarray], np.ndarray], peak: float, duration: float, rng: np.random.Generator
) -> np.ndarray:
    """A non-homogeneous Poisson process of rate `rate_fn(t)` (at most `peak`) over [0, duration), sorted:
    a homogeneous one at the peak rate, each arrival kept with probability rate_fn(t) / peak."""
    n = rng.poisson(peak * duration)
    t = np.sort(rng.uniform(0, duration, n))
    return t[rng.uniform(0, peak, n) < rate_fn(t)]
