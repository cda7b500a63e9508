"""Arrival processes: the rate sets the mean gap, burstiness the spread; schedules by count or over a duration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferd.measure.arrivals import arrival_offsets, arrivals_within, inter_arrival_times, thinned_arrivals


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


def test_a_process_over_a_duration_has_the_rate_and_stays_inside_it():
    t = arrivals_within(1000.0, 5.0, 1.0, np.random.default_rng(4))
    assert np.all(np.diff(t) >= 0) and t[0] > 0 and t[-1] < 1000.0
    assert len(t) == pytest.approx(5000, rel=0.05)
    assert len(arrivals_within(10.0, 200.0, 0.3, np.random.default_rng(0))) == pytest.approx(2000, rel=0.2)
    with pytest.raises(ValueError):
        arrivals_within(10.0, 0.0, 1.0, np.random.default_rng(0))


def test_thinning_follows_the_rate_over_time():
    t = thinned_arrivals(lambda x: np.where(x < 500, 1.0, 3.0), 3.0, 1000.0, np.random.default_rng(5))
    assert np.all(np.diff(t) >= 0)
    assert (t < 500).sum() == pytest.approx(500, rel=0.15) and (t >= 500).sum() == pytest.approx(1500, rel=0.1)
