"""Load forecasting for the planner loop (DOPD §II-A, §V-D, Algorithm 2 lines 5–9).

What belongs here: forecasters of the load series the P/D planner needs — request rate, mean ISL, mean OSL,
concurrency, the ISL/OSL quantile vectors, E[ISL²] and c_a² — one value per planner interval in, a forecast with
one-sided prediction bounds out; the baselines they are judged against; and the walk-forward backtest that judges
them.

What does not: reading traces or metrics (``fulcrum.traces``, the operator's Prometheus adapter), planning
decisions (``fulcrum.ratio``, ``fulcrum.scaling``), wall-clock reads in logic, and any I/O. Everything here is
pure; the only clock read is ``time.perf_counter`` in :mod:`~fulcrum.forecast.backtest`, which measures the
forecasters themselves.

Modules:

- ``base``: :class:`Forecast` and the :class:`SeriesForecaster` protocol.
- ``baselines``: :class:`LastValue`, :class:`MovingAverage`, :class:`SeasonalNaive`.
- ``correction``: :class:`CorrectionFactor`, DOPD's multiplicative correction factor.
- ``arima``: :class:`ArimaForecaster` (refit on error, O(p+q) cheap update otherwise, correction factor).
- ``ets``: :class:`EtsForecaster`, exponential smoothing with a damped trend (same refit policy).
- ``selector``: :class:`SelectingForecaster`, per-series choice among the above by trailing one-step MAPE, never
  worse than last value on that window; refits staggered across series.
- ``distribution``: :class:`QuantileForecaster` for length distributions.
- ``workload``: :class:`WorkloadForecaster` over :class:`~fulcrum.observation.Observation`, and
  :func:`make_series_forecaster`.
- ``backtest``: :func:`backtest`, :class:`BacktestScore`, :func:`default_factories`.
"""

from fulcrum.forecast.arima import ArimaForecaster, ArimaFilter
from fulcrum.forecast.backtest import BacktestScore, backtest, default_factories
from fulcrum.forecast.base import Forecast, RefittingForecaster, SeriesForecaster
from fulcrum.forecast.baselines import LastValue, MovingAverage, SeasonalNaive
from fulcrum.forecast.correction import CorrectionFactor
from fulcrum.forecast.distribution import QuantileForecaster
from fulcrum.forecast.ets import EtsForecaster
from fulcrum.forecast.selector import Candidate, Corrected, SelectingForecaster, default_candidates
from fulcrum.forecast.workload import (
    WorkloadForecast,
    WorkloadForecaster,
    make_series_forecaster,
    required_history,
)

__all__ = [
    "ArimaForecaster",
    "ArimaFilter",
    "BacktestScore",
    "Candidate",
    "Corrected",
    "CorrectionFactor",
    "EtsForecaster",
    "Forecast",
    "LastValue",
    "MovingAverage",
    "QuantileForecaster",
    "RefittingForecaster",
    "SeasonalNaive",
    "SelectingForecaster",
    "SeriesForecaster",
    "WorkloadForecast",
    "WorkloadForecaster",
    "backtest",
    "default_candidates",
    "default_factories",
    "make_series_forecaster",
    "required_history",
]
