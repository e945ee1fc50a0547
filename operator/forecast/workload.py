"""The workload forecaster: every series the P/D planner needs, from one :class:`Observation` per interval.

DOPD Algorithm 2 lines 5–9: each interval the Resource Monitor's averages (mean ISL i, mean OSL o, request count
r) are added to the predictor, which returns their one-step forecasts. Fulcrum also forecasts the concurrency
(DOPD §III-B: "the expected average concurrency"), the ISL/OSL quantile vectors (for eqs. 6–8), E[ISL²] (eq. 7)
and the squared coefficient of variation of inter-arrival times c_a² (eq. 10).

Series and their gaps (``observe``):

- ``rate`` = ``obs.rate_rps`` (requests/s): always a value; 0 for an interval without arrivals is real; a negative or
  non-finite rate (a broken counter) is a gap and does not count towards ``ready``.
- ``isl``, ``osl`` = ``obs.mean_isl``, ``obs.mean_osl`` (tokens): a gap when the interval had no arrivals, or when
  the mean is ≤ 0 (unknown: a real mean length is at least one token).
- ``concurrency`` = ``obs.concurrency`` (requests in the system): always a value.
- ISL/OSL quantile vectors: :class:`~fulcrum.forecast.distribution.QuantileForecaster`, rescaled so that their
  mean tracks the ISL/OSL mean forecast.
- ``isl_sq_mean``: running mean, over the last ``spec.window`` intervals with arrivals, of the normalised second
  moment E[ISL²]/E[ISL]² (≥ 1), multiplied by the square of the ISL mean forecast — so E[ISL²] moves with the
  forecast mean while keeping the recent shape. 0 before any interval with arrivals.
- ``arrival_cv2``: running mean of ``obs.arrival_cv2`` over the last ``spec.window`` intervals with at least three
  arrivals (fewer give no measurement); 1.0 (Poisson) before any.

Refits per interval: the ``select`` method staggers its own (series slots 0–3 of 4). With ``stagger_refits`` the
``arima`` method's four series refit at most one per interval as well: a series whose refit is due waits for an
interval in which no other has refitted, those already waiting first, then in the order rate, ISL, OSL,
concurrency (its cheap update runs meanwhile; :meth:`ArimaForecaster.observe`). Fulcrum's planner turns it on so
that its cycle stays within the 50-ms p99 of ``benchmarks/bench_planner_cycle.py``; the DOPD reference planner
leaves it off and refits every due series at once, as DOPD Alg. 2 does.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass

from fulcrum.api.llmserve import ForecasterMethod, ForecasterSpec
from fulcrum.errors import SpecError
from fulcrum.forecast.arima import ArimaForecaster
from fulcrum.forecast.base import Forecast, SeriesForecaster, check_level, check_steps, mean_of
from fulcrum.forecast.baselines import LastValue, MovingAverage, SeasonalNaive
from fulcrum.forecast.distribution import QuantileForecaster
from fulcrum.forecast.selector import SelectingForecaster
from fulcrum.observation import QUANTILE_LEVELS, Observation

__all__ = ["WorkloadForecast", "WorkloadForecaster", "make_series_forecaster", "required_history"]

#: Arrivals below which an interval's ``arrival_cv2`` is a default, not a measurement (see ``Observation``).
_MIN_ARRIVALS_FOR_CV2 = 3


@dataclass(frozen=True)
class WorkloadForecast:
    """Forecast of the load of the interval ``steps`` ahead (DOPD Alg. 2 line 9: i_next, o_next, r_next).

    Attributes:
        rate: arrival rate, requests/s.
        isl: mean prompt length, tokens.
        osl: mean output length, tokens.
        concurrency: time-averaged requests in the system, count.
        isl_quantiles: ISL at ``fulcrum.observation.QUANTILE_LEVELS``, tokens, non-decreasing, rescaled to the
            ``isl`` mean forecast; every level equal to that mean when means but no quantile vectors were
            observed; ``()`` before any mean ISL was observed.
        osl_quantiles: OSL at the same levels, tokens, by the same rules.
        isl_sq_mean: E[ISL²], tokens² (DOPD eq. 7); 0 before any arrivals; finite (clipped at the largest float).
        arrival_cv2: c_a², squared coefficient of variation of inter-arrival times (DOPD eq. 10); 1.0 by default.
        ready: whether the rate series has the history the method needs (see :func:`required_history`);
            before that the forecasts are last-value-like and planners may prefer reacting to observations.
    """

    rate: Forecast
    isl: Forecast
    osl: Forecast
    concurrency: Forecast
    isl_quantiles: tuple[float, ...]
    osl_quantiles: tuple[float, ...]
    isl_sq_mean: float
    arrival_cv2: float
    ready: bool


def make_series_forecaster(
    method: ForecasterMethod | str, spec: ForecasterSpec, slot: int = 0, slots: int = 1
) -> SeriesForecaster:
    """A fresh series forecaster for ``method`` with the settings of ``spec``.

    ``arima`` → ``ArimaForecaster(spec.order, spec.window, spec.refit_error)``; ``last_value`` → ``LastValue()``;
    ``moving_average`` → ``MovingAverage(spec.moving_average_window)``;
    ``seasonal_naive`` → ``SeasonalNaive(spec.season_length)``;
    ``select`` → ``SelectingForecaster.from_spec(spec, slot, slots)`` (refits only on cycles ≡ ``slot`` mod ``slots``).

    Raises:
        SpecError: for an unknown method name.
    """
    try:
        m = ForecasterMethod(method)
    except ValueError as exc:
        known = ", ".join(x.value for x in ForecasterMethod)
        raise SpecError(f"forecaster.method: unknown method {method!r} (known: {known})") from exc
    if m is ForecasterMethod.ARIMA:
        return ArimaForecaster(order=spec.order, window=spec.window, refit_error=spec.refit_error)
    if m is ForecasterMethod.LAST_VALUE:
        return LastValue()
    if m is ForecasterMethod.MOVING_AVERAGE:
        return MovingAverage(spec.moving_average_window)
    if m is ForecasterMethod.SELECT:
        return SelectingForecaster.from_spec(spec, slot, slots)
    return SeasonalNaive(spec.season_length)


def required_history(method: ForecasterMethod | str, spec: ForecasterSpec) -> int:
    """Non-gap intervals a method needs before its forecasts are its own (not a fallback).

    ARIMA: its ``min_points`` (8, raised to p + d + q + 2, capped at ``spec.window``); last value and moving
    average: 1; seasonal naive: ``spec.season_length``; select: the scored intervals before it may leave last value
    (9).

    Raises:
        SpecError: for an unknown method name.
    """
    series = make_series_forecaster(method, spec)
    if isinstance(series, ArimaForecaster):
        return series.min_points
    if isinstance(series, SeasonalNaive):
        return series.season
    if isinstance(series, SelectingForecaster):
        return series.required_points
    return 1


def _mean(values: deque[float], empty: float) -> float:
    """The mean of ``values`` (finite), ``empty`` when there are none; finite even where their plain sum overflows."""
    if not values:
        return empty
    value = sum(values) / len(values)
    return value if math.isfinite(value) else mean_of(values)


def _second_moment(shape: float, mean: float) -> float:
    """E[ISL²] = ``shape`` · ``mean``² (tokens², finite): clipped at the largest float where it would overflow (a
    mean ISL beyond ~1e154 tokens, i.e. broken metrics), instead of raising ``OverflowError``."""
    try:
        value = shape * mean**2
    except OverflowError:
        value = math.inf
    return min(value, sys.float_info.max)


class WorkloadForecaster:
    """One series forecaster per load series plus the length-distribution forecasters (see module doc).

    Args:
        spec: forecaster settings (method, ARIMA order, window, refit error, season length, prediction level);
            ``ForecasterSpec()`` defaults when None.
        stagger_refits: at most one ARIMA series refits per interval (module doc); no effect on other methods.

    Raises:
        SpecError: for an unknown ``spec.method``.
    """

    def __init__(self, spec: ForecasterSpec | None = None, *, stagger_refits: bool = False) -> None:
        self.spec = spec if spec is not None else ForecasterSpec()
        self.stagger_refits = stagger_refits
        # Four series, slots 0–3 of 4: a method that staggers its refits (select) never refits two in one cycle.
        self.rate = make_series_forecaster(self.spec.method, self.spec, 0, 4)
        self.isl = make_series_forecaster(self.spec.method, self.spec, 1, 4)
        self.osl = make_series_forecaster(self.spec.method, self.spec, 2, 4)
        self.concurrency = make_series_forecaster(self.spec.method, self.spec, 3, 4)
        self.isl_distribution = QuantileForecaster(QUANTILE_LEVELS)
        self.osl_distribution = QuantileForecaster(QUANTILE_LEVELS)
        self._required = required_history(self.spec.method, self.spec)
        self._rate_points = 0
        self._isl_points = 0
        self._osl_points = 0
        self._isl_shape: deque[float] = deque(maxlen=self.spec.window)  # E[ISL²]/E[ISL]² per interval
        self._cv2: deque[float] = deque(maxlen=self.spec.window)

    @property
    def ready(self) -> bool:
        """Whether enough intervals were observed for the method (``WorkloadForecast.ready`` of the next
        forecast), without forecasting."""
        return self._rate_points >= self._required

    def observe(self, obs: Observation) -> None:
        """Add the observation of the interval that just ended (DOPD Alg. 2 line 7). Never raises on values.

        Raises:
            ValueError: when a non-empty quantile vector does not have ``len(QUANTILE_LEVELS)`` entries.
        """
        rate = obs.rate_rps if math.isfinite(obs.rate_rps) and obs.rate_rps >= 0 else math.nan  # < 0: a gap
        arrived = obs.arrivals > 0
        isl = obs.mean_isl if arrived and obs.mean_isl > 0 else math.nan
        osl = obs.mean_osl if arrived and obs.mean_osl > 0 else math.nan
        self._observe_series([
            (self.rate, rate), (self.isl, isl), (self.osl, osl), (self.concurrency, obs.concurrency),
        ])
        self._rate_points += not math.isnan(rate)
        self._isl_points += not math.isnan(isl)
        self._osl_points += not math.isnan(osl)
        if arrived:
            self.isl_distribution.observe(obs.isl_quantiles, isl)
            self.osl_distribution.observe(obs.osl_quantiles, osl)
            if math.isfinite(isl) and math.isfinite(obs.isl_sq_mean) and obs.isl_sq_mean > 0:
                self._isl_shape.append(max(obs.isl_sq_mean / _second_moment(1.0, isl), 1.0))
        if obs.arrivals >= _MIN_ARRIVALS_FOR_CV2 and math.isfinite(obs.arrival_cv2) and obs.arrival_cv2 >= 0:
            self._cv2.append(obs.arrival_cv2)

    def _observe_series(self, values: list[tuple[SeriesForecaster, float]]) -> None:
        """Feed each series its value; with ``stagger_refits``, let at most one ARIMA series refit (module doc)."""
        if not self.stagger_refits:
            for series, value in values:
                series.observe(value)
            return
        refitted = False
        # those whose refit is already due (deferred before) first; sorted() is stable: rate, ISL, OSL, concurrency
        for series, value in sorted(values, key=lambda sv: not (isinstance(sv[0], ArimaForecaster)
                                                                and sv[0].refit_due)):
            if not isinstance(series, ArimaForecaster):
                series.observe(value)
                continue
            before = series.refits
            series.observe(value, allow_refit=not refitted)
            refitted = refitted or series.refits > before

    def forecast(self, steps: int = 1, level: float | None = None) -> WorkloadForecast:
        """Forecast of the interval ``steps`` ahead with one-sided bounds at ``level``.

        Args:
            steps: intervals ahead (≥ 1); the planner uses ceil((interval + pod start-up) / interval).
            level: level of the one-sided bounds in [0.5, 1); defaults to ``spec.prediction_level``.

        Raises:
            ValueError: for ``steps < 1`` or ``level`` outside [0.5, 1).
        """
        lvl = self.spec.prediction_level if level is None else float(level)
        check_steps(steps)
        check_level(lvl)
        isl = self.isl.forecast(steps, lvl)
        osl = self.osl.forecast(steps, lvl)
        shape = _mean(self._isl_shape, 1.0)
        return WorkloadForecast(
            rate=self.rate.forecast(steps, lvl),
            isl=isl,
            osl=osl,
            concurrency=self.concurrency.forecast(steps, lvl),
            isl_quantiles=self.isl_distribution.forecast(isl.mean) if self._isl_points else (),
            osl_quantiles=self.osl_distribution.forecast(osl.mean) if self._osl_points else (),
            isl_sq_mean=_second_moment(shape, isl.mean),
            arrival_cv2=_mean(self._cv2, 1.0),
            ready=self.ready,
        )
