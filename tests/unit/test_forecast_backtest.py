"""Walk-forward backtest (fulcrum.forecast.backtest)."""

from __future__ import annotations

import math

import pytest

from fulcrum.api import ForecasterSpec
from fulcrum.forecast import LastValue, MovingAverage, backtest, default_factories


def test_backtest_scores_one_step_forecasts_made_before_each_value_is_seen() -> None:
    values = [10.0, 20.0, 40.0, 40.0]
    scores = backtest(values, {"last": LastValue}, warmup=1)
    # forecasts 10, 20, 40 against actuals 20, 40, 40: errors 0.5, 0.5, 0
    assert scores["last"].points == 3
    assert scores["last"].mape == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert scores["last"].fit_seconds >= 0
    assert 0 <= scores["last"].forecast_ms_p50 <= scores["last"].forecast_ms_p99


def test_backtest_skips_zero_and_gap_actuals_but_still_observes_them() -> None:
    values = [10.0, 0.0, math.nan, 30.0]
    scores = backtest(values, {"ma": lambda: MovingAverage(4)}, warmup=1)
    # only t=3 is scored: forecast mean(10, 0) = 5 against 30
    assert scores["ma"].points == 1
    assert scores["ma"].mape == pytest.approx(25.0 / 30.0)


def test_backtest_with_nothing_to_score_reports_nan_mape_and_zero_points() -> None:
    scores = backtest([0.0, 0.0, 0.0], {"last": LastValue}, warmup=0)
    assert scores["last"].points == 0
    assert math.isnan(scores["last"].mape)
    with pytest.raises(ValueError):
        backtest([1.0], {"last": LastValue}, warmup=-1)


def test_default_factories_build_a_fresh_forecaster_of_each_method() -> None:
    factories = default_factories(ForecasterSpec(window=16, moving_average_window=4, season_length=24))
    assert list(factories) == ["arima", "last_value", "moving_average", "seasonal_naive", "select"]
    for name, factory in factories.items():
        a, b = factory(), factory()
        assert a is not b
        assert a.name == name
    assert factories["moving_average"]().window == 4  # type: ignore[attr-defined]
    assert factories["seasonal_naive"]().season == 24  # type: ignore[attr-defined]
