"""Length-distribution forecaster (fulcrum.forecast.distribution)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fulcrum.forecast import QuantileForecaster
from fulcrum.observation import QUANTILE_LEVELS


def test_quantile_forecast_is_the_ewma_of_recent_vectors() -> None:
    f = QuantileForecaster((0.5, 0.9), alpha=0.5)
    f.observe((100.0, 200.0))
    f.observe((200.0, 400.0))
    assert f.forecast() == pytest.approx((150.0, 300.0))


def test_quantile_forecast_is_rescaled_so_its_mean_tracks_the_mean_forecast() -> None:
    f = QuantileForecaster((0.25, 0.5, 0.75), alpha=1.0)
    f.observe((50.0, 100.0, 150.0), mean=100.0)
    assert f.forecast(mean=200.0) == pytest.approx((100.0, 200.0, 300.0))
    g = QuantileForecaster((0.25, 0.5, 0.75), alpha=1.0)
    g.observe((50.0, 100.0, 150.0))  # no mean given: taken from the quantile function (100 here)
    assert g.forecast(mean=150.0) == pytest.approx((75.0, 150.0, 225.0))


def test_quantile_forecasts_are_monotone_finite_and_non_negative_whatever_comes_in() -> None:
    rng = np.random.default_rng(4)
    f = QuantileForecaster(QUANTILE_LEVELS)
    for _ in range(50):
        raw = rng.normal(500.0, 400.0, len(QUANTILE_LEVELS))  # unsorted, some negative
        f.observe(tuple(raw), mean=float(rng.normal(500.0, 300.0)))
        for mean in (None, 0.0, 800.0, math.nan):
            q = f.forecast(mean)
            assert len(q) == len(QUANTILE_LEVELS)
            assert all(math.isfinite(x) and x >= 0 for x in q)
            assert all(b >= a for a, b in zip(q, q[1:]))


def test_empty_and_non_finite_vectors_are_gaps() -> None:
    f = QuantileForecaster((0.5, 0.9), alpha=0.5)
    assert f.forecast() == ()
    assert f.forecast(mean=300.0) == (300.0, 300.0)  # nothing seen: point mass at the mean forecast
    f.observe((100.0, 200.0))
    f.observe(())
    f.observe((math.nan, 1.0))
    assert f.points == 1
    assert f.forecast() == pytest.approx((100.0, 200.0))


def test_wrong_vector_length_and_bad_levels_raise_value_error() -> None:
    f = QuantileForecaster((0.5, 0.9))
    with pytest.raises(ValueError):
        f.observe((1.0, 2.0, 3.0))
    with pytest.raises(ValueError):
        QuantileForecaster((0.9, 0.5))
    with pytest.raises(ValueError):
        QuantileForecaster((0.0, 0.5))
    with pytest.raises(ValueError):
        QuantileForecaster((0.5,), alpha=0.0)
