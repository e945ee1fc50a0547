"""Fulcrum's planner: forecast the load of the interval new pods will serve, plan it, scale without oscillating.

Each tick (``spec.scaling.intervalSeconds``):

1. **observe**: feed the interval's admission-side measurements to the forecaster (DOPD Alg. 2 lines 5–7).
2. **forecast** at horizon h = ⌈(interval + pod start-up) / interval⌉ steps — the interval in which pods
   started now are ready (DESIGN principle 3) — and at the next step. The rate planned for is the point forecast
   plus the **measured forecast error**: the empirical quantile, at the SLO percentile, of the residuals
   (observed − forecast rate, requests/s) of this planner's own past forecasts at that horizon, over the last
   ``residual_window`` intervals; the larger of the next step's and the horizon's. A predictable load thus gets
   little headroom and an erratic one much (DOPD Alg. 2 plans for the point forecast alone). Until
   ``min_residuals`` forecasts of a horizon have been scored, the one-step residuals' quantile × √h stands in,
   and before those the forecaster's upper prediction bound at ``forecaster.predictionLevel``. In cold start (too
   little history for the model) the last observation is the forecast; it is scored like one (so residuals exist
   when the model is ready) and planned for with its own residual quantile (their median while fewer than
   ``min_residuals`` are scored, :meth:`FulcrumPlanner.cold_start_level`). Once the model is ready the rate is
   capped at the highest rate observed over the last ``peak_window`` intervals, unless the point forecast is
   higher: a bursty load's residual quantile is its burst height, and mean + that would plan for bursts nobody
   has seen. The cap is off in cold start: a few intervals say little of the peak (capping there cost attainment
   on the conversation traces, where the first minutes are not the busiest). Lengths are forecast distributions
   (quantiles rescaled to the forecast mean, DOPD eqs. 6–8). A backlog at admission adds the rate
   that drains it over the horizon (:meth:`FulcrumPlanner.backlog_rate`).
   **Error budget**: while the SLO attainment of the last intervals leaves nearly all of the 1 − percentile budget
   unspent, the plans are made at a lower percentile and higher target utilisations (:meth:`FulcrumPlanner.budgeted`).
3. **plan** with :func:`fulcrum.ratio.planner.plan` (eqs. 11–18, TP, Kingman headroom); in Auto mode both modes
   are planned and :func:`fulcrum.scaling.mode.decide_mode` decides whether to switch (cost-weighed, with dwell
   time, make-before-break).
4. **scale** through :func:`fulcrum.scaling.policy.apply_scaling_policy` (reactive guard, hysteresis,
   cooldown, N/(N−1), max step, budget).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import numpy as np

from fulcrum.api.llmserve import LLMServeSpec, Mode
from fulcrum.forecast.workload import WorkloadForecast, WorkloadForecaster
from fulcrum.observation import QUANTILE_LEVELS, Observation
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import Plan, PlannerSettings, WorkloadEstimate, initial_in_budget, plan, plan_modes
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.mode import ModeName, ModeState, ModeSwitchSettings, decide_mode, other_mode
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.scaling.policy import ScalingSettings, ScalingState, apply_scaling_policy, reactive_pools
from fulcrum.target import ClusterTarget, Pool, PoolSize

_log = logging.getLogger(__name__)

__all__ = [
    "FulcrumPlanner", "workload_from_forecast", "workload_from_observation", "forecast_dict", "residual_quantile",
    "MODE_POOLS",
]

#: The pools each serving mode runs.
MODE_POOLS: dict[ModeName, tuple[Pool, ...]] = {"Disaggregated": Pool.disaggregated(), "Unified": (Pool.UNIFIED,)}


def residual_quantile(residuals: Sequence[float], q: float) -> float:
    """The empirical ``q``-quantile of forecast residuals (observed − forecast, requests/s), linear between
    order statistics (:func:`numpy.quantile`'s default); ``q`` is clipped to [0, 1]. Raises ValueError on an
    empty sequence."""
    if not residuals:
        raise ValueError("no residuals")
    return float(np.quantile(np.asarray(residuals, dtype=float), min(max(q, 0.0), 1.0)))


def _finite(x: float, default: float) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else default


def workload_from_observation(obs: Observation) -> WorkloadEstimate:
    """The observed interval as a workload estimate (cold start and the reactive path)."""
    isl = LengthDistribution.from_quantiles(QUANTILE_LEVELS, obs.isl_quantiles, _finite(obs.mean_isl, 0.0) or None)
    osl = LengthDistribution.from_quantiles(QUANTILE_LEVELS, obs.osl_quantiles, _finite(obs.mean_osl, 0.0) or None)
    return WorkloadEstimate(obs.rate_rps, isl, osl, _finite(obs.arrival_cv2, 1.0))


def workload_from_forecast(fc: WorkloadForecast, rate: float) -> WorkloadEstimate:
    """A forecast as a workload estimate, with ``rate`` (requests/s) chosen by the caller (mean or bound)."""
    isl_mean = _finite(fc.isl.mean, 1.0)
    osl_mean = _finite(fc.osl.mean, 1.0)
    isl = LengthDistribution.from_quantiles(QUANTILE_LEVELS, fc.isl_quantiles, isl_mean)
    osl = LengthDistribution.from_quantiles(QUANTILE_LEVELS, fc.osl_quantiles, osl_mean)
    return WorkloadEstimate(max(_finite(rate, 0.0), 0.0), isl, osl, _finite(fc.arrival_cv2, 1.0))


def forecast_dict(fc: WorkloadForecast) -> dict[str, dict[str, float]]:
    """``{"rate"|"isl"|"osl"|"concurrency": {"mean", "lower", "upper"}}`` of a workload forecast."""
    out: dict[str, dict[str, float]] = {}
    for key in ("rate", "isl", "osl", "concurrency"):
        f = getattr(fc, key)
        out[key] = {"mean": float(f.mean), "lower": float(f.lower), "upper": float(f.upper)}
    return out


def plan_numbers(p: Plan, **detail: object) -> PlanNumbers:
    """The numbers of a plan for decisions, status and reports; ``detail`` adds to the plan's own inputs."""
    return PlanNumbers(
        mode=p.mode, ratio=p.ratio, balanced_ratio=p.balanced_ratio, decode_concurrency=p.decode_concurrency,
        expected_ttft_s=p.expected_ttft_s, gpus=p.gpus, feasible=p.feasible, slo_infeasible=p.slo_infeasible,
        notes=p.notes, detail={**{k: v for k, v in p.inputs.items() if k != "slo_infeasible"}, **detail},
    )


class FulcrumPlanner:
    """The ``fulcrum`` policy (see module doc). Implements :class:`fulcrum.scaling.planner.Planner`."""

    name = "fulcrum"

    def __init__(
        self,
        spec: LLMServeSpec,
        profile: PerformanceProfile,
        *,
        settings: PlannerSettings | None = None,
        scaling: ScalingSettings | None = None,
        mode_switch: ModeSwitchSettings | None = None,
        max_headroom: float = 2.0,
        residual_window: int = 60,
        min_residuals: int = 5,
        min_level: float = 0.5,
        attainment_window: int = 15,
        peak_window: int = 60,
        unspent_share: float = 0.9,
        spend_step: float = 0.25,
    ) -> None:
        """
        Args:
            spec: the LLMServe spec (SLOs, limits, forecaster, mode).
            profile: the performance profile.
            settings: planner tunables (default: from the spec).
            scaling: scaling-policy tunables (default: from the spec).
            mode_switch: Auto-mode switch tunables (default: :class:`ModeSwitchSettings`, dwell at least five
                pod start-ups).
            max_headroom: the rate planned for is at most this multiple of the highest rate observed in the
                last three intervals (caps the forecast after level shifts), plus the backlog (:meth:`backlog_rate`).
            residual_window: forecast residuals kept per horizon, intervals (60: an hour at the shipped 60-s
                interval; long enough for a P90 quantile, short enough to follow a change of regime).
            min_residuals: residuals needed before their quantile replaces the forecaster's prediction bound
                (5: with fewer the quantile is the maximum of a handful; until then the bound over-provisions).
            min_level: lowest level the residual quantile is taken at when the SLO is met with room to spare
                (0.5: the median error, about DOPD's point forecast; :meth:`_adapt_level`).
            attainment_window: intervals of observed SLO attainment the headroom level follows (15: a quarter
                hour at the shipped 60-s interval).
            peak_window: intervals over which the highest observed rate caps the headroom (60: an hour at the
                shipped 60-s interval): the rate planned for is at most that peak, or the point forecast where
                the forecast itself is higher (a rising load keeps its forecast, not its error band).
            unspent_share: share of the error budget (1 − the SLO percentile) that must be unspent over the
                ``attainment_window`` before the plans spend it (0.9: attainment ≥ 99% for a P90 SLO;
                :meth:`budgeted`).
            spend_step: how much of the relaxation is taken per interval while that holds (0.25: fully in four).
        """
        self.spec = spec
        self.profile = profile
        self.tick_s = float(spec.scaling.interval_seconds)
        self.settings = settings or PlannerSettings.from_spec(spec)
        sc = spec.scaling
        self.scaling = scaling or ScalingSettings(
            max_step=sc.max_step,
            cooldown_s=sc.cooldown_seconds,
            slo_target=spec.slo.percentile / 100.0,
            max_gpus=sc.max_gpus,
            # the plans' continuous needs are already divided by the planner's target utilisation (0.9): the
            # N/(N−1) check asks that N−1 instances hold that need, not 80% of it on top
            scale_in_utilisation=1.0,
            startup_s=sc.pod_startup_seconds,
        )
        self.mode_switch = mode_switch or ModeSwitchSettings(
            min_dwell_s=max(900.0, 5 * sc.pod_startup_seconds), horizon_s=max(900.0, 5 * sc.pod_startup_seconds)
        )
        self.forecaster = WorkloadForecaster(sc.forecaster, stagger_refits=True)
        self.horizon_steps = max(1, math.ceil((sc.interval_seconds + sc.pod_startup_seconds) / sc.interval_seconds))
        self._state = ScalingState()
        self.last_plan: Plan | None = None
        #: the last ISL and OSL distributions planned from measured lengths (:meth:`_known_lengths`)
        self._last_lengths: tuple[LengthDistribution, LengthDistribution] | None = None
        self.max_headroom = max_headroom
        self.min_residuals = min_residuals
        # observed rates, req/s, newest last: the last 3 feed the max_headroom cap, the last peak_window the peak cap
        self._peak_window = max(1, peak_window)
        self._rates: deque[float] = deque([0.0], maxlen=max(3, self._peak_window))
        self._tick = 0
        # horizon (steps) → forecast means awaiting their actual: (tick due, mean rate req/s)
        self._due: dict[int, deque[tuple[int, float]]] = {}
        # horizon (steps) → residuals observed − forecast, requests/s, newest last
        self._residuals: dict[int, deque[float]] = {}
        self._residual_window = residual_window
        self._mode: ModeState | None = None
        self._slo_q = spec.slo.percentile / 100.0
        self._level = self._slo_q
        self.min_level = min_level
        self._attained: deque[tuple[int, float]] = deque(maxlen=attainment_window)
        self._planned_rates: deque[tuple[float, float]] = deque()  # (time s, rate req/s) over the switch horizon
        self.unspent_share = unspent_share
        self.spend_step = spend_step
        self._spend = 0.0
        # (spend, spec, settings) → budgeted(): built once per spend and per spec/settings object
        self._budgeted: tuple[tuple[float, int, int], tuple[LLMServeSpec, PlannerSettings]] | None = None
        self.initial_note: str | None = None  # why initial() cut the spec's initial counts (to maxGPUs), if it did

    def initial(self) -> ClusterTarget:
        """Pools planned for the spec's starting sizes' worth of load: the initial counts with planned TPs."""
        sc = self.spec.scaling
        seed = plan(WorkloadEstimate.from_means(0.0, 1024, 256), self.profile, self.spec, self.settings)
        mode: ModeName = "Unified" if seed.mode == Mode.UNIFIED.value else "Disaggregated"
        self._mode = ModeState(serving=mode, since_s=0.0)
        if mode == "Unified":
            wanted = {"u": max(sc.initial_unified, 1)}
            tps = {"u": seed.unified.tp}
        else:
            wanted = {"p": max(sc.initial_prefill, 1), "d": max(sc.initial_decode, 1)}
            tps = {"p": seed.prefill.tp, "d": seed.decode.tp}
        counts = self._initial_in_budget(wanted, tps)
        if mode == "Unified":
            return ClusterTarget(unified=PoolSize(counts["u"], tps["u"]), routing=seed.routing)
        return ClusterTarget(
            prefill=PoolSize(counts["p"], tps["p"]), decode=PoolSize(counts["d"], tps["d"]), routing=seed.routing,
        )

    def _initial_in_budget(self, wanted: dict[str, int], tps: dict[str, int]) -> dict[str, int]:
        """The initial counts ``wanted`` (at the planned TPs ``tps``), cut to ``spec.scaling.maxGPUs`` when they
        need more (:func:`fulcrum.ratio.planner.initial_in_budget`: the planner's own budget fit). Below minGPUs
        they are kept: the first interval's plan tops them up. A cut is logged; ``self.initial_note`` holds it
        (None when nothing was cut)."""
        counts, self.initial_note = initial_in_budget(wanted, tps, self.spec.scaling.max_gpus)
        if self.initial_note is not None:
            _log.warning("%s", self.initial_note)
        return counts

    def _score_forecasts(self, obs: Observation) -> None:
        """Turn the forecasts due at this tick into residuals (observed − forecast rate, requests/s)."""
        self._tick += 1
        for h, due in self._due.items():
            while due and due[0][0] <= self._tick:
                t, mean = due.popleft()
                if t == self._tick and math.isfinite(obs.rate_rps):
                    self._residuals.setdefault(h, deque(maxlen=self._residual_window)).append(obs.rate_rps - mean)

    def _bound(self, fc: WorkloadForecast, steps: int) -> tuple[float, str]:
        """Rate to plan for from the forecast ``steps`` ahead: mean + the residual quantile at the SLO
        percentile (requests/s), or the forecaster's upper bound while too few residuals are known."""
        mean = _finite(fc.rate.mean, 0.0)
        self._due.setdefault(steps, deque()).append((self._tick + steps, mean))
        q = self._level
        res = self._residuals.get(steps, deque())
        if len(res) >= self.min_residuals:
            return max(mean + residual_quantile(res, q), 0.0), f"residual P{q * 100:g}"
        # Too few h-step residuals yet (they take h intervals to score): the one-step residuals, whose spread
        # grows about as √h with the horizon for a random-walk-like series (ARIMA(0,1,1) without drift).
        res1 = self._residuals.get(1, deque())
        if len(res1) >= self.min_residuals:
            return max(mean + residual_quantile(res1, q) * math.sqrt(steps), 0.0), f"1-step residual P{q * 100:g}·√{steps}"
        return _finite(fc.rate.upper, mean), f"P{self.spec.scaling.forecaster.prediction_level * 100:g} bound"

    def residuals(self, steps: int) -> tuple[float, ...]:
        """The forecast residuals scored so far ``steps`` intervals ahead (observed − forecast rate, requests/s),
        oldest first, at most ``residual_window`` of them; empty before the first is due."""
        return tuple(self._residuals.get(steps, ()))

    @property
    def headroom_level(self) -> float:
        """The level (0–1) of the residual quantile the rate is planned at now (:meth:`_adapt_level`)."""
        return self._level

    def _adapt_level(self, obs: Observation) -> None:
        """Follow the observed SLO attainment with the level of the residual quantile planned for.

        The SLO percentile q is the level while the SLO is at risk; when the attainment pooled over the last
        ``attainment_window`` intervals (at least 100 completions) exceeds q + (1 − q)/2 (95% for a P90 SLO), the
        headroom is more than the SLO needs and the level steps down by 0.05 per interval, to ``min_level``; the
        moment it falls under q + (1 − q)/5 (92%) the level returns to q at once. A load the forecaster predicts
        well is then planned near its point forecast (what DOPD Alg. 2 does), an erratic one at the percentile.
        At the lowest level, an attainment that leaves ``unspent_share`` of the error budget unspent steps up the
        spend of :meth:`budgeted`; under q + (1 − q)/5 the spend returns to 0 with the level.
        """
        if obs.completed > 0 and math.isfinite(obs.slo_attainment):
            self._attained.append((obs.completed, obs.slo_attainment))
        n = sum(c for c, _ in self._attained)
        if n < 100:
            return
        a = sum(c * x for c, x in self._attained) / n
        q = self._slo_q
        if a < q + (1.0 - q) / 5.0:
            self._level = q
            self._spend = 0.0
        elif a > q + (1.0 - q) / 2.0:
            if self._level <= self.min_level and a >= 1.0 - (1.0 - q) * (1.0 - self.unspent_share):
                self._spend = min(1.0, self._spend + self.spend_step)
            self._level = max(self.min_level, self._level - 0.05)

    @property
    def budget_spend(self) -> float:
        """The share (0–1) of the error budget's relaxation the plans use now (:meth:`budgeted`)."""
        return self._spend

    def budgeted(self) -> tuple[LLMServeSpec, PlannerSettings]:
        """The spec and settings the plans are made with: the spec's own, or relaxed by the error budget.

        The SLO asks that a share q of the requests meet it (the percentile); 1 − q may miss: the error budget.
        While the attainment pooled over the last ``attainment_window`` intervals leaves at least ``unspent_share``
        of that budget unspent (≥ 99% for a P90 SLO at the default 0.9) and the headroom level is already at
        ``min_level`` (:meth:`_adapt_level`), the spend s steps up by ``spend_step`` per interval, to 1; under
        q + (1 − q)/5 (92%) it returns to 0 at once, with the level. At spend s the plans are made for the
        percentile q − s·(1 − q) (P90 → P80, at least P50) with the prefill and decode target utilisations raised
        by s·(1 − target) (0.9 → 1.0), i.e. for a per-interval attainment the SLO over the window still allows.
        The per-interval plans of :func:`fulcrum.ratio.planner.plan` hold the percentile in every interval; a
        steady load that a cheaper deployment serves at 95% was planned a deployment serving 100% (issue 13: the
        70B H100 example kept two prefill instances through the synthetic trace's steady 5 req/s, where one
        serves 95.7%). The reactive guard still grows a pool behind an interval under the percentile.
        """
        s = self._spend
        if s <= 0.0:
            return self.spec, self.settings
        key = (s, id(self.spec), id(self.settings))
        if self._budgeted is not None and self._budgeted[0] == key:
            return self._budgeted[1]  # asked several times a tick (plans, the peak check, the reason): built once
        q = self._slo_q
        slo = self.spec.slo.model_copy(update={"percentile": max(q - s * (1.0 - q), 0.5) * 100.0})
        st = self.settings
        settings = replace(
            st,
            prefill_target_utilisation=st.prefill_target_utilisation + s * (1.0 - st.prefill_target_utilisation),
            decode_target_utilisation=st.decode_target_utilisation + s * (1.0 - st.decode_target_utilisation),
        )
        out = self.spec.model_copy(update={"slo": slo}), settings
        self._budgeted = (key, out)
        return out

    def _budget_note(self) -> str:
        """``; error budget: planned at P80, ρ ≤ 1.00`` while the plans spend it (:meth:`budgeted`), else empty."""
        if self._spend <= 0.0:
            return ""
        spec, settings = self.budgeted()
        rho = settings.prefill_target_utilisation
        return f"; error budget: planned at P{spec.slo.percentile:.3g}, ρ ≤ {rho:.2f}"

    def cold_start_level(self, n: int) -> float:
        """The level (0–1) of the one-step residual quantile planned for in cold start, with ``n`` residuals scored.

        The level the rate is planned at after cold start (:attr:`headroom_level`: the SLO percentile, lower
        while the SLO is met with room to spare) once ``min_residuals`` residuals exist; at most their median
        before. The P90 of a handful of residuals is their largest, and in cold start the largest is typically
        one jump of the load: planning the new level plus that jump again asks for a second burst on top of the
        first. Measured (issue 13): the
        synthetic bursty-then-steady trace jumps 1.67 → 7.38 req/s at 180 s; with the residuals' P90 the 70B H100
        example planned 12.7 req/s and a third prefill instance (3.82 GPU-h), and the Auto example's code-trace
        replay nine prefill instances at 16.8 req/s for a burst of 8.9 (12.87 GPU-h); with the median 10.6 req/s
        and two prefill instances (3.73 GPU-h), and 12.27 GPU-h at the same 84.8% attainment. A ramp keeps its
        headroom: its residuals are all positive, and so is their median (the Azure conversation trace's first
        minutes, 3.2 → 5.9 req/s, plan as before).
        """
        return self._level if n >= self.min_residuals else min(self._level, 0.5)

    def backlog_rate(self, obs: Observation) -> float:
        """Requests/s added to the planned rate for the prompts queued at the end of ``obs``: the backlog spread
        over the planning horizon, ``prefill_queue / (h · interval)``.

        The rate planned for is the one at +h intervals, when pods started now are ready; capacity that comes
        then cannot drain the backlog sooner, and the instances in place drain part of it meanwhile. Draining
        it within one interval (as until 2026-11-27) planned bursts of the Azure code trace, whose 30-s backlogs
        reach hundreds of prompts, at up to nine prefill instances where six hold them (issue 13).
        """
        span = self.horizon_steps * self.tick_s
        return max(obs.prefill_queue, 0) / span if span > 0 else 0.0

    def _known_lengths(self, w: WorkloadEstimate, isl_mean: float, osl_mean: float, loaded: bool,
                       why: str, forecast: dict[str, dict[str, float]]) -> tuple[WorkloadEstimate, str]:
        """``w`` with lengths that were measured: when there is load (``loaded``) but the mean ISL or OSL the
        estimate was built from (``isl_mean``, ``osl_mean``) is unknown (NaN, infinite, ≤ 0),
        :func:`workload_from_observation` / :func:`workload_from_forecast` would plan 1-token requests (a
        prefill pool of 0); the last lengths planned from measurements stand in. Valid lengths are kept as
        they are and remembered.

        Raises:
            _LengthsUnknown: load with unknown lengths and none measured before (nothing to size the pools by);
                it carries ``forecast``, the tick's forecast, for the Decision that holds the pools.
        """
        def ok(x: float) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

        isl_ok, osl_ok = ok(isl_mean), ok(osl_mean)
        if isl_ok and osl_ok:
            self._last_lengths = (w.isl, w.osl)
            return w, why
        if not loaded:
            return w, why
        if self._last_lengths is None:
            raise _LengthsUnknown(
                f"{w.rate_rps:.3g} req/s to plan but no {'prompt' if not isl_ok else 'output'} length measured "
                "yet: cannot size the pools", forecast)
        last_isl, last_osl = self._last_lengths
        w = WorkloadEstimate(w.rate_rps, w.isl if isl_ok else last_isl, w.osl if osl_ok else last_osl,
                             w.arrival_cv2)
        self._last_lengths = (w.isl, w.osl)  # the measured one of the two, if any, and the last of the other
        unknown = " and ".join(n for n, good in (("prompt", isl_ok), ("output", osl_ok)) if not good)
        return w, f"{why}; {unknown} lengths unknown: planning the last measured ones"

    def estimate(self, obs: Observation) -> tuple[WorkloadEstimate, dict[str, dict[str, float]], str]:
        """The workload to plan for after observing ``obs`` (steps 1–2 of the module doc).

        Load with unknown lengths (a mean ISL or OSL NaN or 0) is planned at the last measured lengths
        (:meth:`_known_lengths`), never as 1-token requests.

        Raises:
            _LengthsUnknown: load with unknown lengths before any were measured (:meth:`step` holds the pools).
        """
        self.forecaster.observe(obs)
        self._score_forecasts(obs)
        self._adapt_level(obs)
        if math.isfinite(obs.rate_rps):
            self._rates.append(max(obs.rate_rps, 0.0))
        level = self.spec.scaling.forecaster.prediction_level
        backlog_rate = self.backlog_rate(obs)
        fc_h = self.forecaster.forecast(self.horizon_steps, level)
        if not fc_h.ready:
            w = workload_from_observation(obs)
            # The observation is the forecast in cold start (a naive forecast): score it like one, so residuals
            # exist once the model is ready, and plan for its measured error so far: the one-step residuals'
            # quantile, which with a handful of them is about their maximum, already an extreme value (not
            # stretched by √h as later); none → no headroom.
            observed = _finite(obs.rate_rps, 0.0)
            for steps in {1, self.horizon_steps}:
                self._due.setdefault(steps, deque()).append((self._tick + steps, observed))
            res1 = self._residuals.get(1, deque())
            level = self.cold_start_level(len(res1))
            head = max(residual_quantile(res1, level), 0.0) if res1 else 0.0
            fc = forecast_dict(fc_h)
            w, why = self._known_lengths(
                WorkloadEstimate(w.rate_rps + head + backlog_rate, w.isl, w.osl, w.arrival_cv2),
                obs.mean_isl, obs.mean_osl, obs.arrivals > 0,
                f"cold start: planning for the observed load + {head:.2f} req/s of its measured error "
                f"(P{level * 100:g} of {len(res1)} residuals)", fc,
            )
            return w, fc, why
        fc_1 = self.forecaster.forecast(1, level)
        r_h, how_h = self._bound(fc_h, self.horizon_steps)
        r_1, how_1 = (r_h, how_h) if self.horizon_steps == 1 else self._bound(fc_1, 1)
        # Right after a level shift a model refitted on a short window can extrapolate the jump (a positive MA
        # term) and its error variance is inflated, so the raw bound would provision for many times the load:
        # the planned rate is capped at max_headroom × the highest rate observed over the last intervals.
        base = max(itertools.islice(reversed(self._rates), 3))
        rate = min(max(r_h, r_1), self.max_headroom * base)
        # The error band is no reason to plan above every rate seen in the last peak_window intervals: a bursty
        # load's residual quantile is the height of its bursts, added to a mean that already holds part of one
        # (planning 15 req/s for bursts of 8). Above the peak only the point forecast counts (a rising trend).
        point = max(_finite(fc_h.rate.mean, 0.0), _finite(fc_1.rate.mean, 0.0))
        peak = max(itertools.islice(reversed(self._rates), self._peak_window))
        rate = min(rate, max(peak, point)) + backlog_rate
        fc = forecast_dict(fc_h)
        w, why = self._known_lengths(
            workload_from_forecast(fc_h, rate), fc_h.isl.mean, fc_h.osl.mean, rate > 0,
            f"forecast {rate:.2f} req/s (mean + {how_h}) at +{self.horizon_steps} intervals", fc,
        )
        return w, fc, why

    def _plans(self, workload: WorkloadEstimate, current: ClusterTarget) -> dict[ModeName, Plan]:
        """Both modes' plans for Auto (Unified left out when the profile cannot plan it), :func:`plan_modes`."""
        spec, settings = self.budgeted()
        plans = plan_modes(workload, self.profile, spec, settings, current_tp_unified=_current_tp(current))
        return cast(dict[ModeName, Plan], plans)

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        """Observe, forecast, plan and scale (module doc). Never raises on odd observations: load whose lengths
        were never measured holds the pools in force. Raises :class:`~fulcrum.errors.PlanningError` only for a
        load no deployment can serve (a mean prompt no TP's KV memory holds), which
        :class:`~fulcrum.scaling.loop.ControlLoop` turns into holding the pools and reporting Degraded."""
        try:
            workload, fc, why = self.estimate(obs)
        except _LengthsUnknown as err:
            return Decision(time_s=obs.time_s, target=current, reason=f"hold: {err}", forecast=err.forecast)
        if self.spec.mode == Mode.AUTO:
            plans = self._plans(workload, current)
            if len(plans) == 2:
                return self._step_auto(obs, current, plans, fc, why, workload)
            p = plans["Disaggregated"]
        else:
            spec, settings = self.budgeted()
            p = plan(workload, self.profile, spec, settings, current_tp_unified=_current_tp(current))
        self.last_plan = p
        nxt, self._state, reasons = apply_scaling_policy(
            p.target(), current, now_s=obs.time_s, obs=obs, state=self._state, settings=self.scaling,
            utilisation=_needs(p), out_of_reach=_out_of_reach(p),
        )
        reason = "; ".join(reasons) if reasons else "hold"
        return Decision(time_s=obs.time_s, target=nxt, reason=f"{reason} [{why}{self._budget_note()}]", forecast=fc,
                        numbers=plan_numbers(p))

    def _peak_confirms(self, serving: ModeName, workload: WorkloadEstimate, plans: dict[ModeName, Plan],
                       current: ClusterTarget) -> tuple[bool, str]:
        """Whether the other mode is no dearer (and feasible where the serving one is) at the peak: the highest
        rate planned for over the switch horizon, or observed over the last ``peak_window`` intervals if higher
        (:func:`decide_mode`'s ``confirm``); ``plans`` are this tick's, at ``workload``, reused when this tick's
        rate is the peak.

        The observed hour counts because a switch holds for the dwell time at least: a lull of one horizon is no
        reason to leave the mode that is cheaper at the load of the last hour. (Until 2026-11-28 only the
        horizon's planned rates counted: on the Azure code trace, whose load pauses for a quarter hour near its
        end, the Auto example switched to Unified in the pause at 3,120 s and overlapped both modes' pools when
        the load came back: 74.4% / 8.80 GPU-h, dominated by the same spec pinned to Disaggregated, 75.3% / 8.07;
        now 75.3% / 8.07.)

        A tie at the peak lets the switch through: the saving off the peak is what :func:`decide_mode` has
        weighed, and at the peak the other mode costs the same. (Until 2026-11-28 a tie vetoed it: on the
        synthetic trace both modes plan 8 GPUs at its bursts' 8.8 req/s, which kept the steady half, where
        Unified holds 4 GPUs to Disaggregated's 8, from switching until the last burst left the horizon.)
        """
        observed = itertools.islice(reversed(self._rates), self._peak_window)
        peak = max(max(r for _, r in self._planned_rates), *observed)
        if peak > workload.rate_rps:
            plans = self._plans(WorkloadEstimate(peak, workload.isl, workload.osl, workload.arrival_cv2), current)
        other = other_mode(serving)
        if other not in plans or (plans[serving].feasible and not plans[other].feasible):
            return False, f"{other} cannot serve the horizon's peak of {peak:.2f} req/s within the SLOs"
        if plans[other].gpus > plans[serving].gpus and plans[serving].feasible:
            return False, (f"at the horizon's peak of {peak:.2f} req/s {other} needs {plans[other].gpus} GPUs, "
                           f"{serving} {plans[serving].gpus}")
        return True, ""

    def _step_auto(
        self, obs: Observation, current: ClusterTarget, plans: dict[ModeName, Plan], fc: dict[str, dict[str, float]],
        why: str, workload: WorkloadEstimate,
    ) -> Decision:
        """One Auto-mode tick: the mode switch (:func:`decide_mode`), then the scaling policy on its pools."""
        self._planned_rates.append((obs.time_s, workload.rate_rps))
        while self._planned_rates and self._planned_rates[0][0] < obs.time_s - self.mode_switch.horizon_s:
            self._planned_rates.popleft()
        state = self._mode or ModeState(serving="Unified" if current.unified.replicas else "Disaggregated")
        serving = state.serving
        to = state.switching_to
        new_ready = to is not None and sum(current.pool(n).replicas for n in MODE_POOLS[to]) > 0 and all(
            obs.ready.of(n) >= current.pool(n).replicas for n in MODE_POOLS[to]
        )
        serving_gpus = sum(current.pool(n).gpus for n in MODE_POOLS[serving])
        other = other_mode(serving)
        md = decide_mode(
            state, now_s=obs.time_s,
            gpus={m: p.gpus for m, p in plans.items()},
            feasible={m: p.feasible for m, p in plans.items()},
            new_pools_ready=new_ready,
            pressure=bool(reactive_pools(obs, self.scaling, _out_of_reach(*plans.values()))) or obs.prefill_queue > max(obs.arrivals, 1),
            room=serving_gpus + plans[other].gpus <= self.spec.scaling.max_gpus,
            startup_s=self.spec.scaling.pod_startup_seconds,
            settings=self.mode_switch,
            confirm=lambda serving: self._peak_confirms(serving, workload, plans, current),
        )
        self._mode = md.state
        now_serving = md.state.serving
        p = plans[now_serving]
        self.last_plan = p
        if md.phase in ("start", "starting"):
            # make-before-break: the serving pools may grow but not shrink; the new mode's pools start
            new_mode = md.state.switching_to
            assert new_mode is not None
            pools = {n: _at_least(p.target().pool(n), current.pool(n)) for n in MODE_POOLS[serving]}
            pools.update({n: plans[new_mode].target().pool(n) for n in MODE_POOLS[new_mode]})
            planned = ClusterTarget.of(pools, p.routing)
            needs = {**{n: _needs(plans[new_mode])[n] for n in MODE_POOLS[new_mode]},
                     **{n: _needs(p)[n] for n in MODE_POOLS[serving]}}
        else:
            planned, needs = p.target(), _needs(p)
            if md.phase == "cut-over":  # the new pools do not shrink in the tick they take over
                planned = ClusterTarget.of(
                    {n: _at_least(planned.pool(n), current.pool(n)) for n in MODE_POOLS[now_serving]}, p.routing)
        nxt, self._state, reasons = apply_scaling_policy(
            planned, current, now_s=obs.time_s, obs=obs, state=self._state, settings=self.scaling, utilisation=needs,
            out_of_reach=_out_of_reach(p),
        )
        if md.phase == "cut-over":  # the old mode's pools drain now: the new ones are ready
            nxt = ClusterTarget.of(
                {n: (PoolSize(0, size.tp) if n in MODE_POOLS[serving] else size) for n, size in nxt.pools()},
                nxt.routing)
        reasons = [md.reason] + reasons if md.phase != "steady" else reasons
        reason = "; ".join(reasons) if reasons else "hold"
        numbers = plan_numbers(p, mode_phase=md.phase, mode_serving=now_serving, mode_reason=md.reason,
                               gpus_disaggregated=plans["Disaggregated"].gpus, gpus_unified=plans["Unified"].gpus)
        return Decision(time_s=obs.time_s, target=nxt, reason=f"{reason} [{why}{self._budget_note()}]", forecast=fc,
                        numbers=numbers)


class _LengthsUnknown(Exception):
    """Load to plan whose lengths were never measured (:meth:`FulcrumPlanner._known_lengths`), with the tick's
    forecast (series → mean/lower/upper) for the Decision that holds the pools."""

    def __init__(self, message: str, forecast: dict[str, dict[str, float]]) -> None:
        super().__init__(message)
        self.forecast = forecast


def _out_of_reach(*plans: Plan) -> dict[str, float]:
    """The SLO metrics (``"ttft"``, ``"tpot"``) every one of ``plans`` found out of the profile's reach at the
    forecast lengths (:func:`fulcrum.ratio.feasibility.slo_feasibility`), each with the target the plans were
    sized for instead (the largest, seconds): the reactive guard judges those metrics by it
    (:func:`fulcrum.scaling.policy.reactive_pools`)."""
    if not plans:
        return {}
    found = [{f.metric: f.planned_for_s for f in p.slo_infeasible} for p in plans]
    common = set(found[0]).intersection(*found[1:])
    return {m: max(f[m] for f in found) for m in sorted(common)}


def _current_tp(current: ClusterTarget) -> int | None:
    """The TP the unified pool runs now (None: no unified pool), which its next plan keeps unless another TP
    gains ``PlannerSettings.tp_switch_gain``."""
    return current.unified.tp if current.unified.replicas > 0 else None


def _needs(p: Plan) -> dict[Pool, float]:
    """Continuous instance needs per pool of a plan (for the N/(N−1) check)."""
    planned = p.target()
    return {n: float(p.need.get(n, planned.pool(n).replicas)) for n in Pool}


def _at_least(want: PoolSize, have: PoolSize) -> PoolSize:
    """``want``, but never fewer instances than ``have`` (a TP change, to a non-empty pool, still applies)."""
    if want.replicas and want.tp != have.tp:
        return want
    return have if have.replicas > want.replicas else want
