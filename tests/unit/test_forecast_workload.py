"""Workload forecaster over Observations (fulcrum.forecast.workload)."""

from __future__ import annotations

import math

import pytest

from fulcrum.api import ForecasterMethod, ForecasterSpec
from fulcrum.errors import SpecError
from fulcrum.forecast import (
    ArimaForecaster,
    LastValue,
    MovingAverage,
    SeasonalNaive,
    WorkloadForecaster,
    make_series_forecaster,
    required_history,
)
from fulcrum.observation import QUANTILE_LEVELS, Observation

ISL_Q = (200.0, 400.0, 800.0, 1200.0, 2000.0, 4000.0)
OSL_Q = (20.0, 50.0, 100.0, 150.0, 250.0, 500.0)


def busy(t: int, arrivals: int = 600, isl: float = 1000.0, osl: float = 120.0) -> Observation:
    return Observation(
        time_s=60.0 * (t + 1),
        interval_s=60.0,
        arrivals=arrivals,
        mean_isl=isl,
        mean_osl=osl,
        isl_quantiles=tuple(q * isl / 1000.0 for q in ISL_Q),
        osl_quantiles=OSL_Q,
        isl_sq_mean=2.0 * isl**2,
        arrival_cv2=1.5,
        concurrency=40.0,
    )


def empty(t: int) -> Observation:
    return Observation(time_s=60.0 * (t + 1), interval_s=60.0, arrivals=0, mean_isl=0.0, mean_osl=0.0)


def test_empty_intervals_give_rate_zero_but_leave_lengths_untouched() -> None:
    f = WorkloadForecaster(ForecasterSpec(method=ForecasterMethod.LAST_VALUE))
    f.observe(busy(0))
    f.observe(empty(1))
    fc = f.forecast(1)
    assert fc.rate.mean == 0.0  # no arrivals is a real rate
    assert fc.isl.mean == 1000.0  # but not a mean length of zero
    assert fc.osl.mean == 120.0
    assert fc.isl_quantiles == pytest.approx(ISL_Q)
    assert fc.arrival_cv2 == 1.5
    assert fc.isl_sq_mean == pytest.approx(2.0 * 1000.0**2)


def test_a_forecaster_that_saw_only_empty_intervals_returns_zeros_and_defaults() -> None:
    f = WorkloadForecaster()
    for t in range(12):
        f.observe(empty(t))
    fc = f.forecast(2, level=0.9)
    assert (fc.rate.mean, fc.isl.mean, fc.osl.mean, fc.concurrency.mean) == (0.0, 0.0, 0.0, 0.0)
    assert fc.isl_quantiles == () and fc.osl_quantiles == ()
    assert fc.isl_sq_mean == 0.0
    assert fc.arrival_cv2 == 1.0
    assert fc.ready  # 12 rate points ≥ the default selector's 9


def test_arima_workload_forecast_tracks_a_steady_load_and_is_ready_after_min_points() -> None:
    f = WorkloadForecaster(ForecasterSpec(method=ForecasterMethod.ARIMA))
    for t in range(30):
        obs = busy(t, arrivals=600 + (t % 3) * 30, isl=1000.0 + (t % 2) * 100.0)
        f.observe(obs)
        if t == 6:
            assert not f.forecast(1).ready  # 7 < 8 points
    fc = f.forecast(1, level=0.9)
    assert fc.ready
    assert fc.rate.mean == pytest.approx(10.5, rel=0.1)
    assert fc.rate.lower <= fc.rate.mean <= fc.rate.upper
    assert fc.isl.mean == pytest.approx(1050.0, rel=0.1)
    quantiles = fc.isl_quantiles
    assert len(quantiles) == len(QUANTILE_LEVELS)
    assert all(b >= a for a, b in zip(quantiles, quantiles[1:]))
    assert fc.isl_sq_mean == pytest.approx(2.0 * fc.isl.mean**2)  # shape E[ISL²]/E[ISL]² = 2 kept
    assert isinstance(f.rate, ArimaForecaster)


def test_arrival_cv2_ignores_intervals_with_too_few_arrivals() -> None:
    f = WorkloadForecaster(ForecasterSpec(method=ForecasterMethod.LAST_VALUE))
    f.observe(busy(0))  # cv2 1.5 measured
    f.observe(Observation(time_s=120.0, interval_s=60.0, arrivals=2, mean_isl=10.0, mean_osl=5.0, arrival_cv2=9.0))
    assert f.forecast(1).arrival_cv2 == 1.5


def test_quantile_vectors_of_the_wrong_length_raise() -> None:
    f = WorkloadForecaster()
    bad = Observation(time_s=60.0, interval_s=60.0, arrivals=5, mean_isl=10.0, mean_osl=5.0, isl_quantiles=(1.0,))
    with pytest.raises(ValueError):
        f.observe(bad)


def test_make_series_forecaster_builds_each_method_from_the_spec() -> None:
    spec = ForecasterSpec(order=(1, 1, 1), window=32, refit_error=0.5, season_length=24)
    arima = make_series_forecaster("arima", spec)
    assert isinstance(arima, ArimaForecaster)
    assert (arima.order, arima.window, arima.refit_error) == ((1, 1, 1), 32, 0.5)
    assert isinstance(make_series_forecaster(ForecasterMethod.LAST_VALUE, spec), LastValue)
    ma = make_series_forecaster("moving_average", spec)
    assert isinstance(ma, MovingAverage) and ma.window == spec.moving_average_window
    sn = make_series_forecaster("seasonal_naive", spec)
    assert isinstance(sn, SeasonalNaive) and sn.season == 24
    assert required_history("seasonal_naive", spec) == 24
    assert required_history("arima", spec) == 8
    assert required_history("last_value", spec) == 1
    with pytest.raises(SpecError):
        make_series_forecaster("prophet", spec)


def test_forecast_checks_its_arguments() -> None:
    f = WorkloadForecaster()
    with pytest.raises(ValueError):
        f.forecast(0)
    with pytest.raises(ValueError):
        f.forecast(1, level=1.5)
    assert not math.isnan(f.forecast(1).rate.mean)


def _refit_counts(f: WorkloadForecaster) -> list[int]:
    series = (f.rate, f.isl, f.osl, f.concurrency)
    assert all(isinstance(s, ArimaForecaster) for s in series)
    return [s.refits for s in series]  # type: ignore[union-attr]


def test_staggered_arima_refits_at_most_one_series_per_interval_and_defers_none_for_good() -> None:
    # a load whose every series shifts level at once (t = 20, 40): each series' refit test fires in the same
    # interval; unstaggered, several refit together, staggered one per interval and the rest in the next ones
    def obs(t: int) -> Observation:
        k = t // 20
        return busy(t, arrivals=600 * (1 + k), isl=1000.0 * (1 + k), osl=120.0 * (1 + k))

    spec = ForecasterSpec(method=ForecasterMethod.ARIMA)
    plain, staggered = WorkloadForecaster(spec), WorkloadForecaster(spec, stagger_refits=True)
    together = 0
    for t in range(60):
        before = (_refit_counts(plain), _refit_counts(staggered))
        plain.observe(obs(t))
        staggered.observe(obs(t))
        moved = [sum(b > a for a, b in zip(old, new)) for old, new in
                 zip(before, (_refit_counts(plain), _refit_counts(staggered)), strict=True)]
        together = max(together, moved[0])
        assert moved[1] <= 1, f"interval {t}: {moved[1]} series refitted"
    assert together >= 2  # the load does make several series due at once
    # rate, ISL and OSL refit at the first shift (t = 20, 21, 22: deferred in turn), and again at their safety
    # nets, which the staggered first fits left staggered; the constant concurrency never needs a model
    assert _refit_counts(staggered)[:3] == _refit_counts(plain)[:3] and min(_refit_counts(staggered)[:3]) >= 2
    assert not any(s.refit_due for s in (staggered.rate, staggered.isl, staggered.osl))  # type: ignore[union-attr]
    fc = staggered.forecast(1)
    assert fc.rate.mean == pytest.approx(30.0, rel=0.05)
    assert fc.isl.mean == pytest.approx(3000.0, rel=0.05)


def test_staggering_leaves_methods_other_than_arima_alone() -> None:
    spec = ForecasterSpec(method=ForecasterMethod.LAST_VALUE)
    f = WorkloadForecaster(spec, stagger_refits=True)
    for t in range(5):
        f.observe(busy(t, arrivals=60 * (t + 1)))
    assert f.forecast(1).rate.mean == pytest.approx(5.0)
