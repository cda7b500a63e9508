"""The one percentile definition: numpy's linear interpolation, with NaNs left out and counts as repeats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferd.measure.stats import percentile


def test_percentiles_interpolate_linearly_like_numpy_and_vllm():
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 50) == pytest.approx(2.5)
    assert percentile(v, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(v, 99) == pytest.approx(3.97)
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 4.0
    assert percentile([5.0], 99) == 5.0


def test_one_to_a_hundred_is_not_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    # nearest rank would say 50, 90 and 99; interpolation sits between the two nearest samples
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)


def test_no_values_and_nans():
    assert percentile([], 50) is None
    assert percentile([math.nan, math.nan], 50) is None
    assert percentile([1.0, math.nan, 3.0], 50) == pytest.approx(2.0)


@pytest.mark.parametrize("p", [0, 5, 37.5, 50, 90, 95, 99, 100])
def test_counts_are_the_values_repeated(p):
    rng = np.random.default_rng(3)
    values = rng.uniform(0, 1, 40)
    counts = rng.integers(0, 9, 40)
    expected = np.percentile(np.repeat(values, counts), p)
    assert percentile(values, p, counts) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_counts_edge_cases():
    assert percentile([1.0, 2.0], 50, [0, 0]) is None
    assert percentile([2.0, 1.0], 50, [1, 3]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], 50, [1])
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_decayed_rate_reads_a_steady_rate_and_halves_per_half_life():
    from inferd.measure.stats import DecayedRate

    r = DecayedRate(half_life_s=10)
    assert r.rate(0) == 0
    for t in range(0, 2000):  # 3 per second for a long time
        r.add(3 / 10, t / 10)
    assert abs(r.rate(199.9) - 3) < 0.1
    assert abs(r.rate(209.9) - 1.5) < 0.05  # nothing more for one half-life
    assert r.rate(199.9 + 1000) < 1e-20
