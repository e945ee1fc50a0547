"""ARIMA load forecaster with DOPD's refit-on-error policy and multiplicative correction factor.

Source: DOPD §II-A (correction factor), §V-D and Algorithm 2 lines 5–9. Each interval the planner adds the
latest value (``PRED.ADD_DATA_POINT``) and takes the ARIMA one-step forecast

    X̂_{t+1|t} = μ + Σ_{j=1..p} φ_j X_{t+1−j} + Σ_{k=1..q} θ_k ε̂_{t+1−k}            (Alg. 2 line 8)

"After each prediction we compare the forecast to subsequently observed telemetry. If the prediction error is
large we re-fit the ARIMA parameters, otherwise we retain the current model" (§V-D): a refit costs
O(N·(p+q)²) for N points of history, a retained model O(p+q) per step.

Here:

- **Refit** (``statsmodels`` ``ARIMA(...).fit()`` on the last ``window`` non-gap values) when there is no model
  yet, when the mean absolute percentage error of the last ``error_points`` issued one-step forecasts exceeds
  ``refit_error``, or as a safety net after as many cheap updates as the model was fitted on points (so at 8, 16,
  32, 64 points while the window fills — estimates from few points are revisited once as many new ones came —
  then every ``window`` updates).
- **Cheap update** otherwise: :class:`ArimaFilter` runs the model's Kalman filter one step with the parameters
  kept (tens of microseconds, the same numbers as statsmodels), or, with
  ``fast_update=False``, statsmodels' ``results.extend([value])`` runs the filter itself (O((p+q)²), milliseconds).
- **Deferred refits**: ``observe(value, allow_refit=False)`` postpones a due refit (cheap update meanwhile) until an
  ``observe`` that allows it; the selecting forecaster uses it to stagger refits across series.
- **Correction factor** c (DOPD §II-A, §V-D: "comparing the most recent forecast with observed measurements
  and adjusting future forecasts accordingly ... attenuates systematic bias"): b = exponentially weighted mean
  (weight ``correction_alpha``) of log(actual / model forecast), each ratio clipped to ``correction_clip``;
  c = exp(k·b) with the positive-part James–Stein shrinkage k = max(0, 1 − se(b)²/b²), se(b)² = EW variance of
  the log ratios / effective sample size. A persistent bias (a level shift the parameters have not caught up
  with) gives k ≈ 1; mere noise gives k ≈ 0, so the factor does not add the noise of the last few errors to a
  well-fitted model. c is clipped to ``correction_clip``, multiplies the mean and both bounds, and is reset to 1
  at every refit (the new parameters already absorb the old bias).
- **Bounds**: one-sided, ``m ± z(level)·se`` in the model's space, with ``se`` the model's forecast standard
  error (see the transform below).

**Transform.** With ``log_transform`` (the default) and a window of strictly positive values, the model is fitted
on log values: load series are positive with multiplicative noise and upward spikes (on the first 400 points
of the ServeGen M-large 10-minute rate series this lowered the one-step MAPE from 0.127 to 0.108 in the
development runs; without the correction factor it was 0.124).
The forecast is then ``exp(m)`` (the median of the log-normal predictive law) with bounds ``exp(m ± z·se)``.
Otherwise (a zero in the window, or ``log_transform=False``) the model is fitted on the values divided by the
window's mean level (a better-conditioned likelihood for series in the thousands of tokens), and the bounds are
``mean ± z·se`` scaled back.

Percentage errors are taken relative to ``max(|actual|, 0.1 × the fitted window's mean level)`` so that an
interval near zero does not count as an infinite error.

Robustness: before ``min_points`` values (cold start), on a constant window, on a window shorter than p + d + q + 2
(more parameters than points), when a fit or an update fails
(``LinAlgError``, ``ValueError``, convergence trouble) or yields a non-finite or implausible forecast (more than
10× the largest value in the window), the forecaster answers like :class:`~fulcrum.forecast.baselines.LastValue`.
It never raises on data and never returns NaN. ``statsmodels`` warnings are silenced locally.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any

import numpy as np
from statsmodels.tsa.arima.model import ARIMA

from fulcrum.forecast.base import (
    APE_FLOOR,
    MODEL_ERRORS,
    Forecast,
    ModelSpace,
    capped_ape,
    check_level,
    check_steps,
    make_forecast,
    plausible_limit,
    z_value,
)
from fulcrum.forecast.baselines import LastValue
from fulcrum.forecast.correction import CorrectionFactor

__all__ = ["ArimaForecaster", "ArimaFilter"]



class ArimaFilter:
    """The cheap update of a fitted ARIMA(p, d, q): its Kalman filter continued with the parameters kept.

    Box & Jenkins (1990) §5 (DOPD's reference [33]) and DOPD Alg. 2 line 8: with the parameters fixed, the one-step
    forecast is the ARMA difference equation on w_t = Δ^d x_t,

        ŵ_{t+1} = μ + Σ_{j=1..p} φ_j (w_{t+1−j} − μ) + Σ_{k=1..q} θ_k ε_{t+1−k},

    which statsmodels evaluates as a Kalman filter over the model's state space (Durbin & Koopman 2012, §4.3):

        v = x − Z a − d,  F = Z P Zᵀ + H,  K = T P Zᵀ / F,  a ← T a + c + K v,  P ← T P Tᵀ + R Q Rᵀ − K F Kᵀ

    with the system matrices (Z, d, H, T, c, R, Q) of the fitted model and the filter's last predicted state (a, P).
    An h-step forecast iterates a ← T a + c, P ← T P Tᵀ + R Q Rᵀ and reads mean Z a + d, variance Z P Zᵀ + H.
    This is the very filter of ``results.extend``/``get_forecast`` (the same numbers, transient included), run on
    matrices of side max(p, q + 1) + d in tens of microseconds instead of the milliseconds statsmodels spends
    building a results object per value: DOPD §V-D's "If no refit is needed, the prediction cost is only O(p+q)"
    (here O(m²) for the state dimension m, a handful).

    Everything is in the model's space (log values, or values over the scale).
    """

    def __init__(self, results: Any) -> None:
        ssm = results.model.ssm

        def matrix(name: str) -> np.ndarray:
            return np.asarray(ssm[name], dtype=float)

        def last(v: np.ndarray) -> np.ndarray:  # a time-varying intercept (the ARIMA mean) is constant: take its last
            return v[..., -1] if v.ndim == 2 else v

        self._z = matrix("design")
        if self._z.ndim == 3:
            self._z = self._z[:, :, -1]
        self._d = float(last(matrix("obs_intercept"))[0])
        self._h = float(np.asarray(matrix("obs_cov")).reshape(-1)[-1])
        self._t = matrix("transition")
        self._t = self._t[:, :, -1] if self._t.ndim == 3 else self._t
        self._c = last(matrix("state_intercept"))
        r = matrix("selection")
        r = r[:, :, -1] if r.ndim == 3 else r
        q = matrix("state_cov")
        q = q[:, :, -1] if q.ndim == 3 else q
        self._rqr = r @ q @ r.T
        fr = results.filter_results
        self._a = np.array(fr.predicted_state[:, -1], dtype=float)
        self._p = np.array(fr.predicted_state_cov[:, :, -1], dtype=float)
        # With a concentrated scale the filter runs at σ² = 1 and ``results.scale`` is the estimated σ²: the mean
        # recursion does not depend on it (K = T P Zᵀ / F is scale-free), the variances are multiplied by it.
        self._sigma2 = float(results.scale) if math.isfinite(float(results.scale)) else 1.0

    def forecast(self, steps: int) -> tuple[float, float]:
        """(mean, standard error) of x̂_{t+steps}, model space."""
        a, p = self._a, self._p
        for _ in range(steps - 1):
            a = self._t @ a + self._c
            p = self._t @ p @ self._t.T + self._rqr
        mean = float((self._z @ a)[0]) + self._d
        var = (float((self._z @ p @ self._z.T)[0, 0]) + self._h) * self._sigma2
        return mean, math.sqrt(max(var, 0.0))

    def update(self, value: float) -> None:
        """Absorb the new value (model space): one Kalman filter step with the parameters kept."""
        zp = self._z @ self._p  # (1, m)
        f = float((zp @ self._z.T)[0, 0]) + self._h
        if not f > 0:
            raise FloatingPointError("non-positive forecast variance")
        v = value - float((self._z @ self._a)[0]) - self._d
        k = (self._t @ zp.T) / f  # (m, 1)
        self._a = self._t @ self._a + self._c + k[:, 0] * v
        self._p = self._t @ self._p @ self._t.T + self._rqr - (k @ k.T) * f


class ArimaForecaster:
    """ARIMA(p, d, q) one-step/h-step forecaster with refit-on-error and a correction factor (DOPD Alg. 2).

    Args:
        order: ARIMA order (p, d, q), non-negative integers. A constant term is fitted when d = 0.
        window: N, the number of most recent non-gap values a refit uses (≥ 2). Also the safety-net period:
            the model is refitted after ``window`` cheap updates in a row (fewer while the window fills).
        refit_error: refit when the mean absolute percentage error of the last ``error_points`` one-step
            forecasts exceeds this (0.25 = 25 %). Must be > 0.
        min_points: non-gap values needed before the first fit (raised to p + d + q + 2, capped at ``window``);
            until then the forecaster answers like last value. A ``window`` shorter than p + d + q + 2 is never
            fitted (more parameters than points): the forecaster then always answers like last value.
        correction: apply DOPD's multiplicative correction factor.
        error_points: how many recent one-step errors the refit test averages (≥ 1).
        correction_alpha: weight of the newest log(actual/forecast) in the correction factor's EWMA, (0, 1].
        correction_clip: (low, high) bounds of each ratio and of the factor.
        log_transform: fit on log values when the whole window is positive (see module doc).
        fast_update: run the cheap update and the forecasts with :class:`ArimaFilter` (one Kalman step,
            tens of microseconds) instead of statsmodels' ``results.extend``/``get_forecast`` (milliseconds; the same
            filter, the same numbers to rounding).
        concentrate_scale: with ``fast_update``, estimate σ² by concentrating it out of the likelihood and skip the
            parameter covariance: refits 2–3x faster (17–31 ms against 54–62 ms at 64 points on a busy CPU in the
            development runs), parameters within ~1e-3 of the plain fit, yet not identical (on the Azure
            conversation OSL series the one-step MAPE moved from 10.2 % to 11.0 %). Off by default so that the
            ``arima`` method keeps its numbers; the selector, whose refits land in planner cycles, turns it on.

    Attributes (counters, for tests and benchmarks):
        refits: successful parameter estimations.
        cheap_updates: values absorbed by a filter step with the parameters kept.
        fit_failures: fits or updates that raised or gave a non-finite model (each followed by a fallback).

    Raises:
        ValueError: for an invalid argument (never for data).
    """

    name = "arima"

    def __init__(
        self,
        order: tuple[int, int, int] = (2, 0, 1),
        window: int = 64,
        refit_error: float = 0.25,
        min_points: int = 8,
        correction: bool = True,
        error_points: int = 3,
        correction_alpha: float = 0.3,
        correction_clip: tuple[float, float] = (0.5, 2.0),
        log_transform: bool = True,
        fast_update: bool = True,
        concentrate_scale: bool = False,
    ) -> None:
        p, d, q = (int(x) for x in order)
        if min(p, d, q) < 0 or (p, d, q) != tuple(order):
            raise ValueError(f"order must be three non-negative integers, got {order!r}")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not refit_error > 0:
            raise ValueError(f"refit_error must be > 0, got {refit_error}")
        if error_points < 1:
            raise ValueError(f"error_points must be >= 1, got {error_points}")
        if not 0 < correction_alpha <= 1:
            raise ValueError(f"correction_alpha must be in (0, 1], got {correction_alpha}")
        lo, hi = correction_clip
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"correction_clip must satisfy 0 < low <= 1 <= high, got {correction_clip!r}")
        self._correction = CorrectionFactor(correction_alpha, (lo, hi))
        self.order = (p, d, q)
        self.window = int(window)
        self.refit_error = float(refit_error)
        self.min_points = min(max(int(min_points), p + d + q + 2), self.window)
        self.correction = bool(correction)
        self.error_points = int(error_points)
        self.correction_alpha = float(correction_alpha)
        self.correction_clip = (float(lo), float(hi))
        self.log_transform = bool(log_transform)
        self.fast_update = bool(fast_update)
        self.concentrate_scale = bool(concentrate_scale) and self.fast_update

        self.refits = 0
        self.cheap_updates = 0
        self.fit_failures = 0

        self._history: deque[float] = deque(maxlen=self.window)  # non-gap values, original units
        self._fallback = LastValue()
        self._results: Any = None  # statsmodels ARIMAResults, or None when no usable model
        self._recursion: ArimaFilter | None = None  # the cheap update of ``_results`` when ``fast_update``
        self._space = ModelSpace()  # the fitted window's: log values, or values / their mean |value|
        self._since_refit = 0
        self._fitted_on = self.window  # points the current model was fitted on
        self._errors: deque[float] = deque(maxlen=self.error_points)
        self._refit_deferred = False  # a refit was due but the caller did not allow it (see ``observe``)
        self._cache: dict[int, tuple[float, float] | None] = {}  # steps -> (m, se) in the model's space

    # ----------------------------------------------------------------------------------------- properties
    @property
    def points(self) -> int:
        """Non-gap values observed so far."""
        return self._fallback.points

    @property
    def ready(self) -> bool:
        """True once ``min_points`` non-gap values were seen (from then on a model is fitted, unless the window is
        constant or the fit failed, where last value answers)."""
        return self._results is not None or len(self._history) >= self.min_points

    @property
    def correction_factor(self) -> float:
        """Current multiplicative correction factor c (1.0 when ``correction`` is off)."""
        return self._correction.factor if self.correction else 1.0

    @property
    def has_model(self) -> bool:
        """Whether a fitted ARIMA model currently produces the forecasts (False: last-value fallback)."""
        return self._results is not None

    @property
    def refit_due(self) -> bool:
        """Whether the next ``observe`` would refit if allowed (a refit was deferred, or the error test or the
        safety net already asks for one)."""
        return self._refit_deferred or self._needs_refit()

    # ----------------------------------------------------------------------------------------------- API
    def observe(self, value: float, allow_refit: bool = True) -> None:
        """Add the value of the latest interval (NaN/±inf = gap, skipped); refit or cheap-update. Never raises.

        Args:
            value: the interval's value, in the series' unit.
            allow_refit: when False, a refit that is due is deferred (a cheap update runs instead, or, when no
                usable model exists or the value cannot enter it, the forecaster answers like last value) and
                :attr:`refit_due` stays True until an ``observe`` with ``allow_refit=True``. The selecting
                forecaster uses it to stagger the refits of different series (:mod:`~fulcrum.forecast.selector`).
        """
        v = float(value)
        if not math.isfinite(v):
            self._fallback.observe(math.nan)
            return
        if self._results is not None:
            self._score(v)
        self._fallback.observe(v)
        self._history.append(v)
        self._cache.clear()
        if self._needs_refit() or self._refit_deferred:
            if allow_refit:
                self._refit()
                return
            self._refit_deferred = True
        self._cheap_update(v, allow_refit)

    def forecast(self, steps: int = 1, level: float = 0.9) -> Forecast:
        """Forecast of the interval ``steps`` ahead: c·(mean, lower, upper) from the model, clipped at 0.

        Falls back to last value when no usable model exists. Raises ``ValueError`` only for ``steps < 1`` or
        ``level`` outside ``[0.5, 1)``.
        """
        check_steps(steps)
        check_level(level)
        raw = self._raw(int(steps))
        if raw is None:
            return self._fallback.forecast(steps, level)
        m, se = raw
        spread = z_value(level) * se
        c = self.correction_factor
        back = self._space.back
        return make_forecast(c * back(m), c * back(m - spread), c * back(m + spread))

    # ------------------------------------------------------------------------------------------ internals
    def _score(self, actual: float) -> None:
        """Record the error of the one-step forecast issued for this value and update the correction factor."""
        raw = self._raw(1)
        if raw is None:
            self._results = None  # the model gives no usable forecast: refit on this value
            return
        mean = self._space.back(raw[0])
        issued = mean * self.correction_factor
        self._errors.append(capped_ape(actual, issued, self._space.scale))
        if self.correction and mean > APE_FLOOR * self._space.scale and actual > 0:
            self._correction.update(actual, mean)

    def _needs_refit(self) -> bool:
        if len(self._history) < self.min_points:
            return False
        if self._results is None or self._since_refit >= self._fitted_on:
            return True
        # A single error beyond twice the bound is a structural break (a level shift): refit now, which also
        # resets the correction factor — otherwise the shock would enter the bias estimate and be applied again
        # on top of a model that has already moved to the new level.
        if self._errors and self._errors[-1] > 2.0 * self.refit_error:
            return True
        return len(self._errors) == self.error_points and float(np.mean(self._errors)) > self.refit_error

    def _refit(self) -> None:
        """Estimate the parameters on the window; on failure or a constant window leave no model."""
        y = np.fromiter(self._history, dtype=float)
        space = ModelSpace.of(y, log=self.log_transform)  # scale: the window's mean |value| (1 for zeros)
        self._results = None
        self._recursion = None
        self._cache.clear()
        self._since_refit = 0
        self._errors.clear()
        self._refit_deferred = False
        self._correction.reset()
        if float(np.ptp(y)) <= 1e-12 * max(space.scale, 1.0):
            return  # constant window: last value is exact; ARIMA's likelihood is degenerate
        if len(y) < sum(self.order) + 2:
            # More parameters than points (a window shorter than the order): not identifiable, and statsmodels spent
            # ~40 s per fit of ARIMA(32, 0, 32) on 4 points. Last value answers.
            return
        self._space = space
        endog = space.endog(y)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                # ``concentrate_scale`` (see Args) only with ``fast_update``: statsmodels' ``extend`` re-estimates a
                # concentrated σ² from the new values alone, which would make the slow path's bounds jump.
                if self.concentrate_scale:
                    # The parameters only, then one filter pass: ``fit`` would also run the smoother (a fifth of
                    # a fit's time), whose output nothing here reads.
                    model = ARIMA(endog, order=self.order, concentrate_scale=True)
                    results = model.filter(model.fit(cov_type="none", return_params=True))
                else:
                    results = ARIMA(endog, order=self.order).fit()
            except MODEL_ERRORS:
                self.fit_failures += 1
                return
        if not np.all(np.isfinite(np.asarray(results.params, dtype=float))):
            self.fit_failures += 1
            return
        self._recursion = ArimaFilter(results) if self.fast_update else None
        self._results = results
        self._fitted_on = len(y)
        self.refits += 1

    def _cheap_update(self, value: float, allow_refit: bool = True) -> None:
        """Filter one step with the parameters kept; refit instead (or, not allowed, drop the model and defer the
        refit) if the value or the update does not fit."""
        if self._results is None:
            return
        if self._space.logged and value <= 0:
            self._refit_or_defer(allow_refit)  # a zero cannot enter a log model: refit, on raw values
            return
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                if self._recursion is not None:
                    self._recursion.update(self._space.to_model(value))
                else:
                    self._results = self._results.extend(np.array([self._space.to_model(value)]))
            except MODEL_ERRORS:
                self.fit_failures += 1
                self._refit_or_defer(allow_refit)
                return
        self.cheap_updates += 1
        self._since_refit += 1

    def _refit_or_defer(self, allow_refit: bool) -> None:
        """Refit now, or drop the model (last value answers) and mark the refit as due."""
        if allow_refit:
            self._refit()
            return
        self._results = None
        self._cache.clear()
        self._refit_deferred = True

    def _raw(self, steps: int) -> tuple[float, float] | None:
        """Model forecast (m, se) ``steps`` ahead in the model's space, cached until the next value.

        None when there is no model, or its forecast is non-finite or implausible (mean beyond
        :func:`~fulcrum.forecast.base.plausible_limit`: ``PLAUSIBLE_MULTIPLE`` × the window's largest |value|).
        """
        if self._results is None:
            return None
        if steps in self._cache:
            return self._cache[steps]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                if self._recursion is not None:
                    m, se = self._recursion.forecast(steps)
                else:
                    pred = self._results.get_forecast(steps)
                    m = float(np.asarray(pred.predicted_mean)[-1])
                    se = float(np.asarray(pred.se_mean)[-1])
            except MODEL_ERRORS:
                self.fit_failures += 1
                m, se = math.nan, math.nan
        out: tuple[float, float] | None = None
        limit = plausible_limit(self._history)
        if math.isfinite(m) and math.isfinite(se) and se >= 0 and abs(self._space.back(m)) <= limit:
            out = (m, se)
        self._cache[steps] = out
        return out
