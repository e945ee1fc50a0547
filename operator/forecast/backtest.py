"""Walk-forward backtest of series forecasters: one-step-ahead MAPE and the cost of each step.

For each forecaster, the series is replayed in order: at each point ``t ≥ warmup`` the forecaster's one-step
forecast is taken *before* it sees ``values[t]``, then ``values[t]`` is observed. This is exactly how the planner
uses it (DOPD Alg. 2 lines 7–9), so the score is an out-of-sample one-step error.

MAPE = mean of |actual − forecast.mean| / actual over the scored points. Points whose actual is 0, negative, NaN
or infinite are **skipped** (a percentage error of a zero is undefined, a NaN is a gap); they are still observed.
``points`` says how many were scored; ``mape`` is NaN when none were.

Timing uses ``time.perf_counter`` around each call. It measures the forecasters; it is not part of any planning
decision, so the module stays pure in the sense of DESIGN principle 1 (no I/O).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fulcrum.api.llmserve import ForecasterMethod, ForecasterSpec
from fulcrum.forecast.base import SeriesForecaster
from fulcrum.forecast.workload import make_series_forecaster

__all__ = ["BacktestScore", "backtest", "default_factories"]


@dataclass(frozen=True)
class BacktestScore:
    """Score of one forecaster over one series.

    Attributes:
        mape: mean absolute percentage error of the one-step forecasts over scored points (0.1 = 10 %); NaN if
            no point was scored.
        points: scored points (``t ≥ warmup``, actual finite and > 0).
        fit_seconds: total seconds spent in ``observe`` (model updates and refits), over the whole series.
        forecast_ms_p50: median milliseconds of one ``forecast(1)`` call over the scored points.
        forecast_ms_p99: 99th percentile of the same, milliseconds.
    """

    mape: float
    points: int
    fit_seconds: float
    forecast_ms_p50: float
    forecast_ms_p99: float


def backtest(
    values: Sequence[float],
    factories: Mapping[str, Callable[[], SeriesForecaster]],
    warmup: int = 8,
) -> dict[str, BacktestScore]:
    """One-step-ahead walk-forward backtest of each forecaster on ``values`` (see module doc).

    Args:
        values: the series, one value per interval, in time order (NaN = gap).
        factories: name → a callable building a fresh forecaster.
        warmup: points observed before scoring starts (≥ 0).

    Returns:
        name → :class:`BacktestScore`, in the order of ``factories``.

    Raises:
        ValueError: for a negative ``warmup``.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    series = [float(v) for v in values]
    return {name: _score(series, factory(), warmup) for name, factory in factories.items()}


def _score(values: list[float], forecaster: SeriesForecaster, warmup: int) -> BacktestScore:
    errors: list[float] = []
    forecast_s: list[float] = []
    fit_s = 0.0
    for t, actual in enumerate(values):
        if t >= warmup and math.isfinite(actual) and actual > 0:
            start = time.perf_counter()
            predicted = forecaster.forecast(1)
            forecast_s.append(time.perf_counter() - start)
            errors.append(abs(actual - predicted.mean) / actual)
        start = time.perf_counter()
        forecaster.observe(actual)
        fit_s += time.perf_counter() - start
    ms = np.asarray(forecast_s) * 1e3
    return BacktestScore(
        mape=float(np.mean(errors)) if errors else math.nan,
        points=len(errors),
        fit_seconds=fit_s,
        forecast_ms_p50=float(np.percentile(ms, 50)) if ms.size else math.nan,
        forecast_ms_p99=float(np.percentile(ms, 99)) if ms.size else math.nan,
    )


def default_factories(spec: ForecasterSpec | None = None) -> dict[str, Callable[[], SeriesForecaster]]:
    """Factories of every method with ``spec``'s settings: ``arima``, ``last_value``, ``moving_average``,
    ``seasonal_naive``, ``select`` (see :func:`fulcrum.forecast.workload.make_series_forecaster`)."""
    s = spec if spec is not None else ForecasterSpec()

    def factory(method: ForecasterMethod) -> Callable[[], SeriesForecaster]:
        return lambda: make_series_forecaster(method, s)

    return {m.value: factory(m) for m in ForecasterMethod}
