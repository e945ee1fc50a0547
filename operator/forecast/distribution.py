"""Forecast of a length DISTRIBUTION (ISL or OSL quantiles), not only of its mean.

DOPD's P/D ratio uses E[ISL²] and the ISL distribution (eqs. 6–8), not only the mean ISL: a forecast of the mean
alone hides the long prompts that dominate prefill time. :class:`QuantileForecaster` forecasts the next interval's
quantile vector (tokens at fixed levels, e.g. :data:`fulcrum.observation.QUANTILE_LEVELS`) as an exponentially
weighted mean of the recent vectors (the *shape* of the length distribution drifts slowly; ServeGen's 6-hour length
files show it). When the caller passes a forecast of the mean, the vector is rescaled so that its mean tracks it:

    q̂ = EWMA(q_t) · mean_forecast / EWMA(mean_t)

where ``mean_t`` is the observed mean length of each interval (given to :meth:`QuantileForecaster.observe`) or,
if not given, the mean of the piecewise-linear quantile function between the first and last level.

Outputs are non-decreasing across levels, finite and ≥ 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["QuantileForecaster"]


class QuantileForecaster:
    """EWMA forecaster of a quantile vector, optionally rescaled to a forecast mean.

    Args:
        levels: quantile levels in (0, 1), strictly increasing (e.g. ``QUANTILE_LEVELS``).
        alpha: weight of the newest vector in the EWMA, (0, 1]; 0.2 ≈ the last ~10 intervals.

    Raises:
        ValueError: for invalid levels or alpha.
    """

    def __init__(self, levels: Sequence[float], alpha: float = 0.2) -> None:
        lv = tuple(float(x) for x in levels)
        if not lv or any(not 0 < x < 1 for x in lv) or any(b <= a for a, b in zip(lv, lv[1:])):
            raise ValueError(f"levels must be strictly increasing values in (0, 1), got {levels!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.levels = lv
        self.alpha = float(alpha)
        self._vector: np.ndarray | None = None  # EWMA of observed quantile vectors, tokens
        self._mean: float | None = None  # EWMA of the observed means, tokens
        self._seen = 0

    @property
    def points(self) -> int:
        """Non-empty vectors observed so far."""
        return self._seen

    def observe(self, quantiles: Sequence[float], mean: float = math.nan) -> None:
        """Add the quantile vector (tokens) of the latest interval.

        Args:
            quantiles: tokens at ``levels``; empty for an interval without data (a gap, skipped). A vector
                with a NaN/inf entry is also treated as a gap; a decreasing one is made non-decreasing and
                negative values are clipped at 0.
            mean: observed mean length of the interval, tokens; NaN when unknown (then estimated from the
                quantiles).

        Raises:
            ValueError: when a non-empty vector's length differs from ``len(levels)``.
        """
        if len(quantiles) == 0:
            return
        if len(quantiles) != len(self.levels):
            raise ValueError(f"expected {len(self.levels)} quantiles (levels {self.levels}), got {len(quantiles)}")
        q = np.asarray(quantiles, dtype=float)
        if not np.all(np.isfinite(q)):
            return
        q = np.maximum.accumulate(np.maximum(q, 0.0))
        m = float(mean)
        if not (math.isfinite(m) and m > 0):
            m = self._quantile_mean(q)
        a = self.alpha
        self._vector = q if self._vector is None else (1 - a) * self._vector + a * q
        self._mean = m if self._mean is None else (1 - a) * self._mean + a * m
        self._seen += 1

    def forecast(self, mean: float | None = None) -> tuple[float, ...]:
        """Forecast of the next interval's quantile vector, tokens at ``levels``.

        Args:
            mean: forecast mean length (tokens) the vector should track; None keeps the EWMA's own scale.

        Returns:
            A non-decreasing tuple of finite values ≥ 0, of length ``len(levels)``. Before any vector was
            observed: the point mass at ``mean`` if given (every level equal to it), else ``()``.
        """
        m = None if mean is None or not math.isfinite(mean) or mean < 0 else float(mean)
        if self._vector is None:
            return () if m is None else tuple(m for _ in self.levels)
        q = self._vector
        if m is not None and self._mean is not None and self._mean > 0:
            q = q * (m / self._mean)
        q = np.maximum.accumulate(np.clip(np.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0), 0.0, None))
        return tuple(float(x) for x in q)

    def _quantile_mean(self, q: np.ndarray) -> float:
        """Mean of the piecewise-linear quantile function between the first and last level (tokens)."""
        lv = np.asarray(self.levels)
        if lv.size == 1:
            return float(q[0])
        widths = np.diff(lv)
        return float(np.sum(widths * (q[1:] + q[:-1]) / 2) / (lv[-1] - lv[0]))
