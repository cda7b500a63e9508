from __future__ import annotations

import math

import numpy as np
import pytest

from inferd.bench.arrivals import arrival_offsets, inter_arrival_times


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_mean_inter_arrival_follows_the_rate(rate, burstiness):
    gaps = inter_arrival_times(2001, rate, burstiness, np.random.default_rng(7))[1:]  # 2000 draws after the first
    assert abs(gaps.mean() - 1 / rate) <= 0.1 / rate
    # gamma with shape k has a coefficient of variation 1/sqrt(k): burstiness changes the spread, not the mean
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


def test_first_request_goes_at_once_and_inf_sends_everything_at_once():
    assert inter_arrival_times(5, 2.0, 1.0, np.random.default_rng(0))[0] == 0.0
    assert np.all(inter_arrival_times(100, math.inf, 1.0, np.random.default_rng(0)) == 0.0)


def test_arrivals_are_reproducible_from_the_seed():
    a, b, c = arrival_offsets(50, 3.0, 1.0, 1), arrival_offsets(50, 3.0, 1.0, 1), arrival_offsets(50, 3.0, 1.0, 2)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.all(np.diff(a) >= 0)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_settings_raise(rate, burstiness):
    with pytest.raises(ValueError):
        inter_arrival_times(3, rate, burstiness, np.random.default_rng(0))
