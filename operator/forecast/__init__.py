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
- ``arima``: :class:`ArimaForecaster` (refit on error, cheap update otherwise, correction factor).
- ``distribution``: :class:`QuantileForecaster` for length distributions.
- ``workload``: :class:`WorkloadForecaster` over :class:`~fulcrum.observation.Observation`, and
  :func:`make_series_forecaster`.
- ``backtest``: :func:`backtest`, :class:`BacktestScore`, :func:`default_factories`.
"""

from fulcrum.forecast.arima import ArimaForecaster
from fulcrum.forecast.backtest import BacktestScore, backtest, default_factories
from fulcrum.forecast.base import Forecast, SeriesForecaster
from fulcrum.forecast.baselines import LastValue, MovingAverage, SeasonalNaive
from fulcrum.forecast.distribution import QuantileForecaster
from fulcrum.forecast.workload import (
    WorkloadForecast,
    WorkloadForecaster,
    make_series_forecaster,
    required_history,
)

__all__ = [
    "ArimaForecaster",
    "BacktestScore",
    "Forecast",
    "LastValue",
    "MovingAverage",
    "QuantileForecaster",
    "SeasonalNaive",
    "SeriesForecaster",
    "WorkloadForecast",
    "WorkloadForecaster",
    "backtest",
    "default_factories",
    "make_series_forecaster",
    "required_history",
]
