"""The forecaster contract: a :class:`Forecast` value and the :class:`SeriesForecaster` protocol.

A series forecaster sees one number per planner interval (mean ISL, mean OSL, request rate, concurrency;
DOPD §II-A, Alg. 2 line 7 ``PRED.ADD_DATA_POINT``) and predicts the value of a later interval with a
prediction interval (DOPD Alg. 2 lines 8–9). Fulcrum scales for the *upper* bound (DESIGN, principle 3),
so ``upper`` is a one-sided bound at ``level``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "APE_CAP",
    "APE_FLOOR",
    "MODEL_ERRORS",
    "PLAUSIBLE_MULTIPLE",
    "Forecast",
    "ModelSpace",
    "RefittingForecaster",
    "SeriesForecaster",
    "capped_ape",
    "check_level",
    "check_steps",
    "finite_or",
    "make_forecast",
    "mean_of",
    "plausible_limit",
    "z_value",
]

#: Errors a statsmodels fit, filter step or forecast may raise on degenerate data; all mean "fall back".
MODEL_ERRORS: tuple[type[BaseException], ...] = (
    np.linalg.LinAlgError,
    ValueError,
    IndexError,
    RuntimeError,
    OverflowError,
    ZeroDivisionError,
    FloatingPointError,
)
#: Denominator floor of a percentage error, as a share of the series' mean level.
APE_FLOOR = 0.1
#: A single percentage error counts at most this much (one zero interval must not dominate a mean).
APE_CAP = 10.0
#: A model forecast beyond this multiple of the window's largest |value| is treated as a failed model.
PLAUSIBLE_MULTIPLE = 10.0


@dataclass(frozen=True)
class Forecast:
    """Forecast of one series for the interval ``steps`` ahead.

    Attributes:
        mean: point forecast, in the series' unit (tokens, requests/s, requests); finite, ≥ 0.
        lower: one-sided lower prediction bound at the forecast's level: P(actual ≥ lower) ≈ level; ≤ mean.
        upper: one-sided upper prediction bound at the forecast's level: P(actual ≤ upper) ≈ level; ≥ mean.

    All three are clipped at 0 and are never NaN or infinite (build with :func:`make_forecast`).
    """

    mean: float
    lower: float
    upper: float


@runtime_checkable
class SeriesForecaster(Protocol):
    """One-step/h-step forecaster of one scalar series sampled once per planner interval.

    Contract:
        - ``observe`` is called once per interval, in time order, with the value of the interval that just
          ended; ``math.nan`` marks a gap (no data, e.g. mean ISL of an interval without arrivals). It never
          raises on any float, including NaN, ±inf (treated as a gap), zeros and constant series.
        - ``forecast(steps, level)`` returns the forecast of the interval ``steps`` ahead of the last observed
          one (``steps=1``: the next interval). It is side-effect free as far as the caller can tell (it may
          cache), never raises on any history (cold start included) and never returns NaN. It raises
          ``ValueError`` only for ``steps < 1`` or ``level`` outside ``[0.5, 1)``.
    """

    name: str

    def observe(self, value: float) -> None:
        """Add the value of the latest interval (NaN = gap)."""
        ...

    def forecast(self, steps: int = 1, level: float = 0.9) -> Forecast:
        """Forecast of the interval ``steps`` ahead with one-sided bounds at ``level``."""
        ...


@runtime_checkable
class RefittingForecaster(SeriesForecaster, Protocol):
    """A series forecaster with estimated parameters whose refits the caller may defer (DOPD §V-D: refit when the
    error grows, cheap update otherwise).

    Contract, on top of :class:`SeriesForecaster`:
        - ``observe(value, allow_refit=False)`` never refits: a refit that is due is postponed (the forecaster keeps
          answering with its current parameters, or like last value when it has none) and ``refit_due`` stays True.
          ``observe(value)`` behaves as ``allow_refit=True``.
        - ``refit_due``: whether the next ``observe`` would refit if allowed. Side-effect free.
        - ``refits``: parameter estimations so far (a counter, for schedulers, tests and benchmarks).
    """

    refits: int

    @property
    def refit_due(self) -> bool:
        """Whether a refit is due (deferred or wanted by the error test or the schedule)."""
        ...

    def observe(self, value: float, allow_refit: bool = True) -> None:
        """Add the value of the latest interval (NaN = gap); refit only if due and ``allow_refit``."""
        ...


def check_steps(steps: int) -> None:
    """Raise ``ValueError`` unless ``steps`` is an integer ≥ 1."""
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def check_level(level: float) -> None:
    """Raise ``ValueError`` unless 0.5 ≤ ``level`` < 1 (a one-sided bound below the median makes no sense)."""
    if not (0.5 <= level < 1.0):
        raise ValueError(f"level must be in [0.5, 1), got {level!r}")


def z_value(level: float) -> float:
    """Standard-normal quantile z(level), e.g. 1.2816 for 0.9 (one-sided bound)."""
    check_level(level)
    return NormalDist().inv_cdf(level)


def finite_or(value: float, default: float) -> float:
    """``value`` as a float if finite, else ``default``."""
    v = float(value)
    return v if math.isfinite(v) else float(default)


def make_forecast(mean: float, lower: float, upper: float) -> Forecast:
    """Build a valid :class:`Forecast`: non-finite parts replaced, all clipped at ≥ 0, lower ≤ mean ≤ upper.

    A non-finite ``mean`` becomes 0; a non-finite bound becomes the mean.
    """
    m = max(finite_or(mean, 0.0), 0.0)
    lo = min(max(finite_or(lower, m), 0.0), m)
    hi = max(finite_or(upper, m), m)
    return Forecast(mean=m, lower=lo, upper=hi)


def mean_of(values: Iterable[float]) -> float:
    """The mean of ``values`` (a non-empty iterable, any unit): ``math.fsum(values) / n``, or, when that sum
    overflows (values near the largest float, 1.8e308), the mean of the values divided by their largest |value|,
    scaled back, so that a forecaster fed such values never raises ``OverflowError``. An infinite value makes the
    mean that infinity (NaN for both signs); a NaN value makes it NaN.

    Raises:
        ZeroDivisionError: for an empty ``values``.
    """
    xs = list(values)
    try:
        return math.fsum(xs) / len(xs)
    except (OverflowError, ValueError):  # ValueError: fsum of -inf and +inf
        infinite = {x for x in xs if math.isinf(x)}
        if infinite:
            return infinite.pop() if len(infinite) == 1 else math.nan
        top = max(abs(x) for x in xs)
        return top * (math.fsum(x / top for x in xs) / len(xs))


def capped_ape(actual: float, forecast: float, level: float) -> float:
    """The absolute percentage error of ``forecast`` against ``actual``, as a share (0.25 = 25 %), capped at
    :data:`APE_CAP`; the denominator is at least :data:`APE_FLOOR` × ``level`` (the series' mean level, in its unit),
    so an interval near zero does not blow the error up. The refit tests (DOPD §V-D) and the selector's rolling
    backtest average these."""
    denom = max(abs(actual), APE_FLOOR * level, 1e-12)
    return min(abs(actual - forecast) / denom, APE_CAP)


@dataclass(frozen=True)
class ModelSpace:
    """The space a fitted window's linear model (ARIMA, ETS) sees its values in: their logs when the window is all
    positive and the log is wanted (a multiplicative load), else the values divided by the window's mean |value|,
    so that the optimiser's tolerances hold at any load's scale (requests/s or tokens alike).

    Attributes:
        logged: whether the model sees log values.
        scale: the window's mean |value| (1 for a window of zeros), the unit of the unlogged space.
    """

    logged: bool = False
    scale: float = 1.0

    @classmethod
    def of(cls, window: np.ndarray, log: bool = True) -> ModelSpace:
        """The space for ``window`` (a 1-D array of the series' values): logged when ``log`` and every value is
        positive."""
        with np.errstate(over="ignore"):
            level = float(np.mean(np.abs(window))) if window.size else 0.0
        if not math.isfinite(level):  # the sum overflowed (values near the largest float)
            level = mean_of(np.abs(window).tolist())
        return cls(logged=log and bool(np.all(window > 0)), scale=level if level > 0 else 1.0)

    def endog(self, window: np.ndarray) -> np.ndarray:
        """``window`` in this space (what the model is fitted on)."""
        return np.log(window) if self.logged else window / self.scale

    def to_model(self, value: float) -> float:
        """One value in this space (a logged space needs ``value`` > 0)."""
        return math.log(value) if self.logged else value / self.scale

    def back(self, x: float) -> float:
        """A value of this space back in the series' units (``inf`` on overflow, caught by :func:`make_forecast`)."""
        if self.logged:
            return math.exp(x) if x < 700.0 else math.inf
        return x * self.scale


def plausible_limit(window: Iterable[float]) -> float:
    """The largest |forecast| a fitted model may give on ``window`` before it counts as failed:
    :data:`PLAUSIBLE_MULTIPLE` × the window's largest |value| (0 for an empty window)."""
    return PLAUSIBLE_MULTIPLE * max((abs(x) for x in window), default=0.0)
