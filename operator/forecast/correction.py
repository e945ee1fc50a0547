"""DOPD's multiplicative correction factor, shared by every model forecaster (DOPD §II-A, §V-D).

DOPD §II-A: "applying a multiplicative scaling (correction) factor can be effective. By comparing the most recent
forecast with observed measurements and adjusting future forecasts accordingly, the scaling factor attenuates
systematic bias between predicted and actual values"; §V-D derives correction factors "from the recently observed
averages" and combines them with the forecasts. DOPD gives no formula; Fulcrum's is

    b_t = (1 − a)·b_{t−1} + a·r_t,          r_t = log(clip(actual_t / forecast_t, lo, hi))
    v_t = (1 − a)·v_{t−1} + a·(r_t − b_t)²
    k   = max(0, 1 − (v_t / n_eff) / b_t²),   n_eff = (2 − a) / a        (positive-part James–Stein shrinkage)
    c   = clip(exp(k·b_t), lo, hi)

A persistent bias (a level shift the model has not caught up with) gives k ≈ 1; mere noise gives k ≈ 0, so the
factor does not add the noise of the last few errors to a well-fitted model. The forecast issued is c × the model's
forecast (mean and both bounds). Pure arithmetic, O(1) per update.
"""

from __future__ import annotations

import math

__all__ = ["CorrectionFactor"]


class CorrectionFactor:
    """Shrunk exponentially weighted mean of log(actual / forecast), exponentiated (module doc).

    Args:
        alpha: a, the weight of the newest log ratio, in (0, 1]; 0.3 ≈ the last ~6 intervals.
        clip: (lo, hi) bounds of each ratio and of the factor, 0 < lo ≤ 1 ≤ hi.

    Raises:
        ValueError: for an invalid argument.
    """

    def __init__(self, alpha: float = 0.3, clip: tuple[float, float] = (0.5, 2.0)) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"correction alpha must be in (0, 1], got {alpha}")
        lo, hi = clip
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"correction clip must satisfy 0 < low <= 1 <= high, got {clip!r}")
        self.alpha = float(alpha)
        self.clip = (float(lo), float(hi))
        self._bias = 0.0
        self._var = 0.0
        self._factor = 1.0

    @property
    def factor(self) -> float:
        """Current factor c (dimensionless, in ``clip``; 1.0 before any update and after :meth:`reset`)."""
        return self._factor

    def reset(self) -> None:
        """Forget the bias (after a refit: the new parameters already absorb it)."""
        self._bias = 0.0
        self._var = 0.0
        self._factor = 1.0

    def update(self, actual: float, model_forecast: float) -> None:
        """Add one (actual, uncorrected model forecast) pair, both in the series' unit and > 0; others are ignored."""
        if not (actual > 0 and model_forecast > 0 and math.isfinite(actual) and math.isfinite(model_forecast)):
            return
        lo, hi = self.clip
        r = math.log(min(max(actual / model_forecast, lo), hi))
        a = self.alpha
        self._bias = (1 - a) * self._bias + a * r
        self._var = (1 - a) * self._var + a * (r - self._bias) ** 2
        n_eff = (2 - a) / a
        se2 = self._var / n_eff
        k = max(0.0, 1.0 - se2 / self._bias**2) if self._bias != 0 else 0.0
        self._factor = min(max(math.exp(k * self._bias), lo), hi)
