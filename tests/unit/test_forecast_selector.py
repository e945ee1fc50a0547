"""Model-selecting forecaster (fulcrum.forecast.selector): never worse than last value on the trailing window, picks
structure where there is some, staggers refits, keeps bounds ordered; ETS and the ARIMA Kalman step it relies on."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fulcrum.api import ForecasterMethod, ForecasterSpec
from fulcrum.forecast import (
    ArimaFilter,
    ArimaForecaster,
    Corrected,
    CorrectionFactor,
    EtsForecaster,
    MovingAverage,
    SelectingForecaster,
    WorkloadForecaster,
    backtest,
    default_candidates,
    make_series_forecaster,
    required_history,
)
from fulcrum.forecast.selector import BASELINE
from fulcrum.observation import Observation
from fulcrum.traces import interval_series, load_trace


def random_walk(n: int, seed: int, level: float = 100.0, sigma: float = 0.08) -> list[float]:
    """Geometric random walk: log x_t = log x_{t−1} + N(0, σ²)."""
    rng = np.random.default_rng(seed)
    return [float(level * math.exp(v)) for v in np.cumsum(rng.normal(0.0, sigma, n))]


def seasonal(n: int, seed: int, period: int = 12, noise: float = 0.02) -> list[float]:
    """100·(1 + 0.5·sin(2πt/period)) with 2 % multiplicative noise: a clear season, little else."""
    rng = np.random.default_rng(seed)
    return [100.0 * (1 + 0.5 * math.sin(2 * math.pi * t / period)) * (1 + rng.normal(0.0, noise)) for t in range(n)]


def selector(season: int = 144) -> SelectingForecaster:
    return SelectingForecaster(default_candidates(ForecasterSpec(season_length=season)))


def run_checking_the_choice(values: list[float], sel: SelectingForecaster) -> list[str]:
    """Feed ``values``; after each, the chosen candidate's trailing error must not exceed last value's."""
    chosen = []
    for v in values:
        sel.observe(v)
        scores = sel.scores()
        if sel.chosen != BASELINE:
            assert scores[sel.chosen] < scores[BASELINE]
        assert scores[sel.chosen] <= scores[BASELINE] or math.isnan(scores[BASELINE])
        chosen.append(sel.chosen)
    return chosen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_random_walks_the_choice_never_has_a_higher_trailing_error_than_last_value(seed: int) -> None:
    run_checking_the_choice(random_walk(160, seed), selector())


def test_on_a_seasonal_series_the_choice_never_has_a_higher_trailing_error_than_last_value() -> None:
    run_checking_the_choice(seasonal(120, seed=4), selector(season=12))


def test_on_the_azure_conversation_trace_the_choice_never_has_a_higher_trailing_error_than_last_value() -> None:
    series = interval_series(load_trace("azure-conv-2023").requests, 60.0)
    for name in ("rate", "isl", "osl"):
        run_checking_the_choice(series[name], selector(season=1440))


def test_before_enough_scored_intervals_it_answers_like_last_value() -> None:
    sel = selector()
    for v in [10.0, 20.0, 30.0, 40.0, 50.0]:
        sel.observe(v)
        assert sel.chosen == BASELINE
        assert sel.forecast(1).mean == v


def test_it_picks_the_seasonal_model_on_a_clearly_seasonal_series() -> None:
    chosen = run_checking_the_choice(seasonal(120, seed=5), selector(season=12))
    assert chosen[-1] == "seasonal_naive"
    assert chosen[-30:].count("seasonal_naive") >= 25


def test_it_picks_a_trend_following_model_on_a_steady_ramp() -> None:
    # On a ramp the last value lags by one step every interval; ETS's trend, and the baselines times DOPD's
    # correction factor (which learns the steady ratio actual/forecast), do not.
    rng = np.random.default_rng(6)
    ramp = [100.0 + 5.0 * t + float(rng.normal(0.0, 1.0)) for t in range(80)]
    sel = selector()
    chosen = run_checking_the_choice(ramp, sel)
    assert all(c != BASELINE for c in chosen[20:])
    assert sel.scores()[chosen[-1]] < 0.5 * sel.scores()[BASELINE]


def test_bounds_are_ordered_and_widen_with_the_level_and_horizon() -> None:
    sel = selector(season=12)
    for t, v in enumerate(seasonal(80, seed=7) + random_walk(80, seed=8)):
        sel.observe(v)
        if t < 2:
            continue
        for steps in (1, 3):
            low, high = sel.forecast(steps, 0.8), sel.forecast(steps, 0.95)
            for f in (low, high):
                assert all(math.isfinite(x) and x >= 0 for x in (f.mean, f.lower, f.upper))
                assert f.lower <= f.mean <= f.upper
            assert high.upper >= low.upper - 1e-9 * max(1.0, low.upper)
            assert high.lower <= low.lower + 1e-9 * max(1.0, low.lower)


def test_gaps_zeros_and_constants_never_raise_nor_give_nan() -> None:
    sel = selector(season=4)
    for v in [math.nan, 0.0, 0.0, 5.0, math.inf, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 0.0, -math.inf, 7.0] * 3:
        sel.observe(v)
        f = sel.forecast(2)
        assert all(math.isfinite(x) for x in (f.mean, f.lower, f.upper))


def busy(t: int, rng: np.random.Generator) -> Observation:
    arrivals = int(600 * (1 + 0.3 * math.sin(t / 5)) * (1 + rng.normal(0.0, 0.05)))
    return Observation(
        time_s=60.0 * (t + 1),
        interval_s=60.0,
        arrivals=arrivals,
        mean_isl=1000.0 * (1 + rng.normal(0.0, 0.1)),
        mean_osl=120.0 * (1 + rng.normal(0.0, 0.1)),
        concurrency=40.0 * (1 + rng.normal(0.0, 0.1)),
    )


def test_the_four_series_of_a_workload_forecaster_never_refit_in_the_same_cycle() -> None:
    f = WorkloadForecaster(ForecasterSpec(method=ForecasterMethod.SELECT, window=16))
    series = (f.rate, f.isl, f.osl, f.concurrency)
    rng = np.random.default_rng(9)
    refitting_cycles = 0
    for t in range(120):
        before = [s.refits for s in series]  # type: ignore[attr-defined]
        f.observe(busy(t, rng))
        moved = [s.refits - b for s, b in zip(series, before)]  # type: ignore[attr-defined]
        assert sum(m > 0 for m in moved) <= 1, f"cycle {t}: several series refitted {moved}"
        assert max(moved) <= 1, f"cycle {t}: one series refitted several candidates {moved}"
        refitting_cycles += max(moved)
    assert refitting_cycles >= 12  # every series fitted ARIMA and ETS, and refitted on schedule


def test_select_is_the_default_forecaster_method_with_a_warm_up() -> None:
    assert ForecasterSpec().method is ForecasterMethod.SELECT
    spec = ForecasterSpec(method=ForecasterMethod.SELECT)
    assert isinstance(make_series_forecaster("select", spec), SelectingForecaster)
    assert required_history("select", spec) == 9


def test_the_fast_arima_scores_like_the_statsmodels_path() -> None:
    # The fast path concentrates σ² out of the fit (another optimiser path, parameters within ~1e-3 on these
    # series) and runs the Kalman step itself: the forecasts differ slightly, the accuracy does not.
    values = random_walk(150, seed=10)
    for order in [(0, 1, 1), (2, 0, 1)]:
        factories = {
            "fast": lambda: ArimaForecaster(order=order, concentrate_scale=True),
            "slow": lambda: ArimaForecaster(order=order, fast_update=False),
        }
        scores = backtest(values, factories)
        assert scores["fast"].mape == pytest.approx(scores["slow"].mape, rel=0.05)


def test_the_arima_kalman_step_continues_the_fitted_filter_exactly() -> None:
    from statsmodels.tsa.arima.model import ARIMA

    values = random_walk(60, seed=11)
    for order in [(0, 1, 1), (2, 0, 1), (1, 1, 1)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = ARIMA(np.log(values[:40]), order=order, concentrate_scale=True).fit(cov_type="none")
            step = ArimaFilter(results)
            for v in values[40:]:
                step.update(math.log(v))
            extended = results.extend(np.log(values[40:]))
        mean, se = step.forecast(3)
        ref = extended.get_forecast(3)
        assert mean == pytest.approx(float(np.asarray(ref.predicted_mean)[-1]), rel=1e-9)
        # statsmodels re-estimates a concentrated σ² on the extension alone; the filter keeps the fitted one
        ref_se = float(np.asarray(ref.se_mean)[-1]) * math.sqrt(results.scale / extended.scale)
        assert se == pytest.approx(ref_se, rel=1e-9)


def test_ets_recursion_continues_the_statsmodels_fit() -> None:
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    values = [100.0 + 3.0 * t + 4.0 * math.sin(t) for t in range(40)]
    f = EtsForecaster(window=30, min_points=30, correction=False)
    for v in values[:30]:
        f.observe(v)
    for v in values[30:]:
        f.observe(v, allow_refit=False)  # the recursion only
    alpha, beta, phi = f.params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = ExponentialSmoothing(
            np.log(values[:30]), trend="add", damped_trend=True, initialization_method="estimated"
        ).fit(use_brute=False)
        ref = ExponentialSmoothing(
            np.log(values), trend="add", damped_trend=True, initialization_method="known",
            initial_level=fit.params["initial_level"], initial_trend=fit.params["initial_trend"],
        ).fit(smoothing_level=alpha, smoothing_trend=beta, damping_trend=phi, optimized=False)
    assert f.refits == 1
    assert f.forecast(2).mean == pytest.approx(math.exp(float(ref.forecast(2)[-1])), rel=1e-9)


def test_the_correction_factor_learns_a_persistent_bias_and_ignores_noise() -> None:
    biased, noisy = CorrectionFactor(), CorrectionFactor()
    rng = np.random.default_rng(12)
    for _ in range(30):
        biased.update(120.0, 100.0)  # the model is 20 % low, every time
        noisy.update(100.0 * math.exp(float(rng.normal(0.0, 0.1))), 100.0)
    assert biased.factor == pytest.approx(1.2, rel=0.02)
    assert abs(noisy.factor - 1.0) < 0.05
    biased.reset()
    assert biased.factor == 1.0


def test_a_corrected_baseline_scales_its_forecast_and_bounds_by_the_factor() -> None:
    inner, wrapped = MovingAverage(3), Corrected(MovingAverage(3))
    for t in range(40):
        v = 100.0 * 1.05**t  # the moving average lags a 5 %-per-interval growth by a steady ratio
        inner.observe(v)
        wrapped.observe(v)
    c = wrapped.correction.factor
    assert c > 1.05
    a, b = inner.forecast(1), wrapped.forecast(1)
    assert b.mean == pytest.approx(c * a.mean) and b.upper == pytest.approx(c * a.upper)
    assert abs(b.mean - 100.0 * 1.05**40) < abs(a.mean - 100.0 * 1.05**40)


def test_invalid_selector_settings_raise() -> None:
    cands = default_candidates(ForecasterSpec())
    with pytest.raises(ValueError):
        SelectingForecaster([c for c in cands if c.name != BASELINE])
    with pytest.raises(ValueError):
        SelectingForecaster(cands, slot=4, slots=4)
    with pytest.raises(ValueError):
        SelectingForecaster(cands, t_crit=-1.0)
    with pytest.raises(ValueError):
        SelectingForecaster(cands, window=8, min_scored=9)
