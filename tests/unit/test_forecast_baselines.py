"""Baseline forecasters and the Forecast contract (fulcrum.forecast.base, fulcrum.forecast.baselines)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from fulcrum.forecast import Forecast, LastValue, MovingAverage, SeasonalNaive, SeriesForecaster
from fulcrum.forecast.base import ModelSpace, make_forecast

Z90 = NormalDist().inv_cdf(0.9)


def test_last_value_forecasts_the_last_non_gap_value_for_every_horizon() -> None:
    f = LastValue()
    for v in (3.0, 5.0, math.nan, 7.0, math.nan):
        f.observe(v)
    assert f.forecast(1).mean == 7.0
    assert f.forecast(5).mean == 7.0


def test_moving_average_averages_the_last_window_values_skipping_gaps() -> None:
    f = MovingAverage(3)
    for v in (1.0, 2.0, math.nan, 3.0, 4.0):
        f.observe(v)
    assert f.forecast(1).mean == pytest.approx((2.0 + 3.0 + 4.0) / 3)
    g = MovingAverage(3)
    g.observe(6.0)
    assert g.forecast(1).mean == 6.0  # fewer than `window` values: their mean


def test_seasonal_naive_repeats_the_last_season_once_a_full_season_was_seen() -> None:
    f = SeasonalNaive(season=4)
    for v in (10.0, 20.0, 30.0):
        f.observe(v)
    assert f.forecast(1).mean == 30.0  # not a full season yet: last value
    f.observe(40.0)
    assert [f.forecast(h).mean for h in range(1, 9)] == [10.0, 20.0, 30.0, 40.0] * 2
    f.observe(11.0)
    assert f.forecast(1).mean == 20.0


def test_seasonal_naive_falls_back_to_the_last_value_where_last_season_was_a_gap() -> None:
    f = SeasonalNaive(season=3)
    for v in (math.nan, 5.0, 6.0):
        f.observe(v)
    assert f.forecast(1).mean == 6.0  # one season ago was a gap
    assert f.forecast(2).mean == 5.0


def test_baseline_bounds_come_from_the_empirical_quantiles_of_their_own_errors() -> None:
    f = LastValue()
    values = [100.0 + (5.0 if i % 2 else -5.0) for i in range(41)]  # one-step errors are exactly ±10
    for v in values:
        f.observe(v)
    fc = f.forecast(1, level=0.9)
    assert fc.mean == values[-1]
    assert fc.upper == pytest.approx(values[-1] + 10.0)
    assert fc.lower == pytest.approx(values[-1] - 10.0)
    assert f.forecast(4, level=0.9).upper == pytest.approx(values[-1] + 10.0 * 2)  # √h growth for last value


def test_baseline_bounds_use_the_normal_approximation_with_few_errors() -> None:
    f = MovingAverage(1)
    for v in (10.0, 13.0, 10.0):  # errors +3, -3: RMSE 3
        f.observe(v)
    fc = f.forecast(1, level=0.9)
    assert fc.upper == pytest.approx(10.0 + Z90 * 3.0)
    assert fc.lower == pytest.approx(10.0 - Z90 * 3.0)


@pytest.mark.parametrize("factory", [LastValue, lambda: MovingAverage(4), lambda: SeasonalNaive(3)])
def test_baselines_never_raise_or_return_nan_on_empty_constant_zero_or_gappy_series(factory: object) -> None:
    f = factory()  # type: ignore[operator]
    assert isinstance(f, SeriesForecaster)
    assert f.forecast(1) == Forecast(0.0, 0.0, 0.0)  # nothing seen yet
    for v in [math.nan, 0.0, 0.0, math.inf, 5.0, 5.0, -math.inf, math.nan, 0.0, 5.0]:
        f.observe(v)
        fc = f.forecast(3, level=0.95)
        assert all(math.isfinite(x) and x >= 0 for x in (fc.mean, fc.lower, fc.upper))
        assert fc.lower <= fc.mean <= fc.upper


def test_forecast_arguments_are_checked() -> None:
    f = LastValue()
    with pytest.raises(ValueError):
        f.forecast(0)
    with pytest.raises(ValueError):
        f.forecast(1, level=0.4)
    with pytest.raises(ValueError):
        f.forecast(1, level=1.0)
    with pytest.raises(ValueError):
        MovingAverage(0)
    with pytest.raises(ValueError):
        SeasonalNaive(0)


def test_make_forecast_clips_at_zero_and_replaces_non_finite_parts() -> None:
    assert make_forecast(-3.0, -5.0, 2.0) == Forecast(0.0, 0.0, 2.0)
    assert make_forecast(math.nan, math.nan, math.inf) == Forecast(0.0, 0.0, 0.0)
    assert make_forecast(5.0, 7.0, 4.0) == Forecast(5.0, 5.0, 5.0)  # bounds never cross the mean


def test_moving_average_upper_bound_covers_about_level_of_a_stationary_series() -> None:
    rng = np.random.default_rng(7)
    f = MovingAverage(8)
    hits = []
    for i, v in enumerate(50.0 + rng.normal(0.0, 5.0, 600)):
        if i >= 50:
            hits.append(v <= f.forecast(1, level=0.9).upper)
        f.observe(float(v))
    assert 0.85 <= float(np.mean(hits)) <= 0.95


def test_model_space_logs_an_all_positive_window_and_scales_any_other_by_its_mean_magnitude() -> None:
    up = np.array([2.0, 4.0, 8.0])
    logged = ModelSpace.of(up)
    assert logged.logged and logged.scale == pytest.approx(14.0 / 3.0)
    assert logged.endog(up) == pytest.approx(np.log(up))
    assert logged.back(logged.to_model(5.0)) == pytest.approx(5.0)
    assert logged.back(800.0) == math.inf  # overflow is inf, which make_forecast turns into a fallback
    with_zero = ModelSpace.of(np.array([0.0, 3.0, -3.0]))
    assert not with_zero.logged and with_zero.scale == pytest.approx(2.0)
    assert with_zero.endog(np.array([0.0, 3.0, -3.0])) == pytest.approx([0.0, 1.5, -1.5])
    assert with_zero.back(with_zero.to_model(-7.0)) == pytest.approx(-7.0)
    assert not ModelSpace.of(up, log=False).logged
    assert ModelSpace.of(np.zeros(4)).scale == 1.0 and ModelSpace.of(np.array([])).scale == 1.0
