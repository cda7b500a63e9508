"""When requests are sent: Poisson or gamma inter-arrivals at a request rate, or all at once.

Same as vLLM: inter-arrival times ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean is
1/rate whatever the burstiness; burstiness 1 is a Poisson process, < 1 burstier, > 1 more even.
"""

from __future__ import annotations

import math

import numpy as np


def inter_arrival_times(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds to wait before each request, relative to the previous one (the first is 0)."""
    if count < 0:
        raise ValueError("count must be >= 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if rate <= 0:
        raise ValueError("request rate must be > 0 (use inf to send everything at once)")
    if math.isinf(rate):
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    if count:
        gaps[0] = 0.0  # the run starts with a request, so duration measures serving, not the first wait
    return gaps


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times in seconds from the start of the run, reproducible from `seed`."""
    return np.cumsum(inter_arrival_times(count, rate, burstiness, np.random.default_rng(seed)))
