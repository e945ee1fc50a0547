"""ARIMA forecaster: accuracy against last value, refit policy, robustness, bounds (DOPD §V-D, Alg. 2 l.5–9)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from fulcrum.forecast import ArimaForecaster, LastValue, SeasonalNaive, backtest

SERVEGEN = Path("/work/shared/data/servegen/servegen_m-large_aggregate_10min.csv")


def ar1_series(n: int, phi: float, sigma: float, level: float, seed: int) -> list[float]:
    """level + AR(1) noise x_t = φ·x_{t−1} + N(0, σ²)."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + rng.normal(0.0, sigma)
    return [level + float(v) for v in x]


def servegen_rates(points: int) -> list[float]:
    if not SERVEGEN.exists():
        pytest.skip(f"ServeGen rate series not found at {SERVEGEN} (shared data not mounted)")
    with SERVEGEN.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [float(r["total_rate_rps"]) for r in rows[:points]]


def assert_valid(fc: object) -> None:
    mean, lower, upper = fc.mean, fc.lower, fc.upper  # type: ignore[attr-defined]
    assert all(math.isfinite(x) and x >= 0 for x in (mean, lower, upper))
    assert lower <= mean <= upper


def test_arima_beats_last_value_on_a_noisy_ar1_series() -> None:
    # For AR(1) with φ = 0.5 the last value's one-step error variance is 2σ²/(1+φ) = 1.33σ², the model's σ²:
    # a fitted ARIMA should be clearly better once its window has filled (scored after 64 points).
    values = ar1_series(400, phi=0.5, sigma=10.0, level=100.0, seed=0)
    scores = backtest(values, {"arima": ArimaForecaster, "last_value": LastValue}, warmup=64)
    assert scores["arima"].points == scores["last_value"].points == 336
    assert scores["arima"].mape < 0.95 * scores["last_value"].mape


def test_arima_on_the_servegen_rate_series_is_close_to_last_value_and_beats_the_other_baselines() -> None:
    # The ServeGen M-large aggregate rate at 10-minute resolution is a sum over ~40 clients: almost no
    # sampling noise, level shifts and spikes — close to a random walk, for which last value is the optimal
    # one-step forecast. ARIMA does not beat it here (development runs: MAPE 0.108 vs 0.094 on these 400
    # points), but must stay near it and beat the seasonal-naive baseline by far.
    values = servegen_rates(400)
    scores = backtest(
        values,
        {"arima": ArimaForecaster, "last_value": LastValue, "seasonal_naive": lambda: SeasonalNaive(144)},
    )
    arima, last, seasonal = scores["arima"], scores["last_value"], scores["seasonal_naive"]
    assert arima.points == 392
    assert arima.mape < 1.25 * last.mape
    assert arima.mape < 0.5 * seasonal.mape


def test_upper_bound_covers_about_level_of_actuals_on_a_stationary_series() -> None:
    values = ar1_series(300, phi=0.5, sigma=10.0, level=100.0, seed=3)
    f = ArimaForecaster()
    hits = []
    for t, v in enumerate(values):
        if t >= 64:
            hits.append(v <= f.forecast(1, level=0.9).upper)
        f.observe(v)
    assert 0.82 <= float(np.mean(hits)) <= 0.97


def test_upper_bound_covers_most_actuals_on_the_servegen_rate_series() -> None:
    values = servegen_rates(300)
    f = ArimaForecaster()
    hits = []
    for t, v in enumerate(values):
        if t >= 16:
            hits.append(v <= f.forecast(1, level=0.9).upper)
        f.observe(v)
    assert float(np.mean(hits)) >= 0.8


def test_a_level_shift_triggers_refits_and_a_stable_series_only_cheap_updates() -> None:
    rng = np.random.default_rng(11)
    f = ArimaForecaster(window=64)
    for v in 100.0 + rng.normal(0.0, 3.0, 80):
        f.observe(float(v))
    # Scheduled refits at 8, 17, 35, 70 points (after as many cheap updates as points fitted on), then every
    # 64 updates (next at 134); in between, a stable series gets only cheap updates.
    refits_before = f.refits
    cheap_before = f.cheap_updates
    for v in 100.0 + rng.normal(0.0, 3.0, 20):
        f.observe(float(v))
    assert f.refits == refits_before
    assert f.cheap_updates == cheap_before + 20
    for v in 200.0 + rng.normal(0.0, 3.0, 10):  # level doubles: percentage errors far above 25 %
        f.observe(float(v))
    assert f.refits > refits_before
    assert f.forecast(1).mean == pytest.approx(200.0, rel=0.1)


def test_cold_start_forecasts_like_last_value_and_never_raises() -> None:
    f = ArimaForecaster(min_points=8)
    assert f.forecast(1).mean == 0.0
    for v in (5.0, 7.0, 6.0):
        f.observe(v)
        assert f.forecast(2).mean == v
    assert f.refits == 0
    assert not f.has_model


def test_constant_zero_and_gappy_series_never_raise_or_return_nan() -> None:
    rng = np.random.default_rng(5)
    series = {
        "constant": [42.0] * 40,
        "zeros": [0.0] * 40,
        "gaps": [math.nan if i % 3 == 0 else 50.0 + rng.normal(0.0, 5.0) for i in range(60)],
        "sparse": [0.0 if i % 4 else 9.0 for i in range(40)],
        "inf": [math.inf, 1.0, -math.inf, 2.0, 3.0, math.nan] * 6,
        "tiny_then_huge": [1e-9] * 10 + [1e9] * 10,
    }
    for name, values in series.items():
        f = ArimaForecaster()
        for v in values:
            f.observe(v)
            for steps in (1, 3):
                assert_valid(f.forecast(steps, level=0.9))
        if name == "constant":
            assert f.forecast(1).mean == pytest.approx(42.0)
            assert f.forecast(1).upper == pytest.approx(42.0)
        if name == "zeros":
            assert f.forecast(1).mean == 0.0


def test_series_shorter_than_the_order_falls_back_without_fitting() -> None:
    f = ArimaForecaster(order=(5, 1, 5), min_points=2)
    assert f.min_points == 13  # raised to p + d + q + 2
    for v in (1.0, 2.0, 3.0):
        f.observe(v)
    assert f.forecast(1).mean == 3.0
    assert f.refits == 0


def test_correction_factor_tracks_a_persistent_bias_and_stays_clipped() -> None:
    rng = np.random.default_rng(2)
    f = ArimaForecaster(window=64, refit_error=10.0)  # refits only by schedule: the factor must do the work
    for v in 100.0 + rng.normal(0.0, 2.0, 80):  # last scheduled refit at 70 points, the next at 134
        f.observe(float(v))
    refits = f.refits
    assert f.correction_factor == pytest.approx(1.0, abs=0.05)
    for v in 130.0 + rng.normal(0.0, 2.0, 12):
        f.observe(float(v))
    assert f.refits == refits
    assert f.correction_factor > 1.1
    assert 0.5 <= f.correction_factor <= 2.0
    uncorrected = ArimaForecaster(correction=False)
    assert uncorrected.correction_factor == 1.0


def test_h_step_forecasts_widen_with_the_horizon() -> None:
    values = ar1_series(120, phi=0.8, sigma=5.0, level=80.0, seed=9)
    f = ArimaForecaster()
    for v in values:
        f.observe(v)
    one, six = f.forecast(1, 0.9), f.forecast(6, 0.9)
    assert six.upper - six.mean > one.upper - one.mean
    assert f.forecast(1, 0.99).upper > f.forecast(1, 0.9).upper


def test_invalid_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError):
        ArimaForecaster(order=(-1, 0, 1))
    with pytest.raises(ValueError):
        ArimaForecaster(window=1)
    with pytest.raises(ValueError):
        ArimaForecaster(refit_error=0.0)
    with pytest.raises(ValueError):
        ArimaForecaster().forecast(0)
