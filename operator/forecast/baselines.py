"""Baseline series forecasters: last value, moving average, seasonal naive.

They are the yardsticks the ARIMA forecaster must beat (DESIGN, forecaster row) and the fallback the ARIMA
forecaster uses at cold start. Each keeps its own recent one-step errors ``e = actual − forecast`` and derives
its prediction bounds from their empirical quantiles:

    upper = mean + max(Q_level(e), 0) · g(h),   lower = mean + min(Q_{1−level}(e), 0) · g(h)

with ``g(h) = √h`` for :class:`LastValue` (random-walk growth of the error over ``h`` steps) and ``g(h) = 1``
for :class:`MovingAverage` and :class:`SeasonalNaive` (stationary around a level or a season). With fewer than
``min_quantile_errors`` errors the normal approximation ``± z(level)·RMSE(e)`` is used instead; with none the
bounds equal the mean.

Gaps (NaN or ±inf) are skipped: no value, no error. :class:`SeasonalNaive` still counts a gap as one interval
so that its season stays aligned with time.
"""

from __future__ import annotations

import math
from collections import deque

from fulcrum.forecast.base import Forecast, check_level, check_steps, make_forecast, mean_of, z_value

__all__ = ["LastValue", "MovingAverage", "SeasonalNaive"]

#: Below this many recorded one-step errors the bounds use the normal approximation, not quantiles.
_MIN_QUANTILE_ERRORS = 20


class _ErrorTracking:
    """Shared machinery: one-step error record and bounds from it. Subclasses implement ``_point``."""

    name: str = "baseline"

    def __init__(self, error_window: int = 64) -> None:
        if error_window < 1:
            raise ValueError(f"error_window must be >= 1, got {error_window}")
        self._errors: deque[float] = deque(maxlen=error_window)
        self._sorted: list[float] | None = None  # the errors sorted, cached until the next observe
        self._seen = 0

    @property
    def points(self) -> int:
        """Non-gap values observed so far."""
        return self._seen

    def _point(self, steps: int) -> float | None:
        """Point forecast ``steps`` ahead, or None when nothing has been seen."""
        raise NotImplementedError

    def _update(self, value: float) -> None:
        """Add a value (``math.nan`` for a gap) to the state."""
        raise NotImplementedError

    def _horizon_factor(self, steps: int) -> float:
        return 1.0

    def observe(self, value: float) -> None:
        """Add the value of the latest interval; NaN/±inf is a gap. Never raises."""
        v = float(value)
        if not math.isfinite(v):
            self._update(math.nan)
            return
        predicted = self._point(1)
        if predicted is not None:
            self._errors.append(v - predicted)
            self._sorted = None
        self._update(v)
        self._seen += 1

    def forecast(self, steps: int = 1, level: float = 0.9) -> Forecast:
        """Forecast ``steps`` ahead with one-sided bounds at ``level`` (see module doc).

        Returns zeros before any value was seen. Raises ``ValueError`` for ``steps < 1`` or ``level`` outside
        ``[0.5, 1)``.
        """
        check_steps(steps)
        check_level(level)
        point = self._point(steps)
        if point is None:
            return make_forecast(0.0, 0.0, 0.0)
        up, down = self._error_bounds(level)
        g = self._horizon_factor(steps)
        return make_forecast(point, point + down * g, point + up * g)

    def _error_bounds(self, level: float) -> tuple[float, float]:
        """(upper offset ≥ 0, lower offset ≤ 0) from the recent one-step errors."""
        if not self._errors:
            return 0.0, 0.0
        if len(self._errors) < _MIN_QUANTILE_ERRORS:
            spread = z_value(level) * math.sqrt(mean_of(e * e for e in self._errors))
            return spread, -spread
        if self._sorted is None:
            self._sorted = sorted(self._errors)
        up = _quantile(self._sorted, level)
        down = _quantile(self._sorted, 1.0 - level)
        return max(up, 0.0), min(down, 0.0)


def _quantile(ordered: list[float], q: float) -> float:
    """``numpy.quantile(ordered, q)`` (method "linear", its interpolation formula) of a sorted non-empty list, in
    pure Python: the planner asks the bounds of every candidate every cycle, and ``numpy.quantile``'s overhead on
    64 values (tens of microseconds, more on a busy CPU) dominated the selector's cycle in the development runs."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    t = pos - lo
    a, b = ordered[lo], ordered[hi]
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


class LastValue(_ErrorTracking):
    """Forecast = the last non-gap value, for every horizon (naive / random-walk forecast).

    Args:
        error_window: how many recent one-step errors the bounds are computed from.
    """

    name = "last_value"

    def __init__(self, error_window: int = 64) -> None:
        super().__init__(error_window)
        self._last: float | None = None

    def _point(self, steps: int) -> float | None:
        return self._last

    def _update(self, value: float) -> None:
        if not math.isnan(value):
            self._last = value

    def _horizon_factor(self, steps: int) -> float:
        return math.sqrt(steps)


class MovingAverage(_ErrorTracking):
    """Forecast = mean of the last ``window`` non-gap values, for every horizon.

    Args:
        window: number of recent values averaged (≥ 1); fewer are averaged until ``window`` were seen.
        error_window: how many recent one-step errors the bounds are computed from.
    """

    name = "moving_average"

    def __init__(self, window: int, error_window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(error_window)
        self.window = window
        self._values: deque[float] = deque(maxlen=window)

    def _point(self, steps: int) -> float | None:
        if not self._values:
            return None
        # Recomputed (not a running sum) so that rounding errors cannot accumulate over long runs; ``mean_of``
        # does not overflow near the largest float.
        return mean_of(self._values)

    def _update(self, value: float) -> None:
        if not math.isnan(value):
            self._values.append(value)


class SeasonalNaive(_ErrorTracking):
    """Forecast of interval t+h = the value one season earlier (t+h−k·season, smallest k ≥ 1 landing ≤ t).

    Until a full season has been seen, or where that earlier interval was a gap, it falls back to the last
    non-gap value.

    Args:
        season: season length in intervals (≥ 1), e.g. 144 ten-minute intervals = one day.
        error_window: how many recent one-step errors the bounds are computed from.
    """

    name = "seasonal_naive"

    def __init__(self, season: int, error_window: int = 64) -> None:
        if season < 1:
            raise ValueError(f"season must be >= 1, got {season}")
        super().__init__(error_window)
        self.season = season
        self._recent: deque[float] = deque(maxlen=season)  # last `season` intervals, gaps as NaN
        self._last: float | None = None

    def _point(self, steps: int) -> float | None:
        if len(self._recent) == self.season:
            # Interval t+h maps to offset ((h−1) mod season) from the start of the stored season.
            value = self._recent[(steps - 1) % self.season]
            if not math.isnan(value):
                return value
        return self._last

    def _update(self, value: float) -> None:
        self._recent.append(value)
        if not math.isnan(value):
            self._last = value
