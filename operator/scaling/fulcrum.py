"""Fulcrum's planner: forecast the load of the interval new pods will serve, plan it, scale without oscillating.

Each tick (``spec.scaling.intervalSeconds``):

1. **observe**: feed the interval's admission-side measurements to the forecaster (DOPD Alg. 2 lines 5–7).
2. **forecast** at horizon h = ⌈(interval + pod start-up) / interval⌉ steps — the interval in which pods
   started now are ready (DESIGN principle 3) — taking the *upper* prediction bound of the request rate at
   ``forecaster.predictionLevel`` and the larger of the next step's and the horizon's; lengths as forecast
   distributions (quantiles rescaled to the forecast mean, DOPD eqs. 6–8). A backlog at admission adds the
   rate needed to drain it within one interval. In cold start (too little history) the observation is used.
3. **plan** with :func:`fulcrum.ratio.planner.plan` (eqs. 11–18, TP, Kingman headroom, Auto mode).
4. **scale** through :func:`fulcrum.scaling.policy.apply_scaling_policy` (reactive guard, hysteresis,
   cooldown, N/(N−1), max step, budget).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from fulcrum.api.llmserve import LLMServeSpec
from fulcrum.forecast.workload import WorkloadForecast, WorkloadForecaster
from fulcrum.observation import QUANTILE_LEVELS, Observation
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import Plan, PlannerSettings, WorkloadEstimate, plan
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.planner import Decision
from fulcrum.scaling.policy import ScalingSettings, ScalingState, apply_scaling_policy
from fulcrum.target import ClusterTarget, PoolSize

__all__ = ["FulcrumPlanner", "workload_from_forecast", "workload_from_observation", "forecast_dict"]


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


def plan_inputs(p: Plan) -> dict[str, Any]:
    """The numbers of a plan as a flat mapping for decisions, status and reports."""
    d: dict[str, Any] = dict(p.inputs)
    d.update(
        mode=p.mode, ratio=p.ratio, balanced_ratio=p.balanced_ratio, decode_concurrency=p.decode_concurrency,
        expected_ttft_s=p.expected_ttft_s, gpus=p.gpus, feasible=p.feasible, notes=list(p.notes),
    )
    return d


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
        max_headroom: float = 2.0,
    ) -> None:
        """
        Args:
            spec: the LLMServe spec (SLOs, limits, forecaster, mode).
            profile: the performance profile.
            settings: planner tunables (default: from the spec).
            scaling: scaling-policy tunables (default: from the spec).
            max_headroom: the rate planned for is at most this multiple of the highest rate observed in the
                last three intervals (caps the forecast after level shifts), plus the backlog.
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
        )
        self.forecaster = WorkloadForecaster(sc.forecaster)
        self.horizon_steps = max(1, math.ceil((sc.interval_seconds + sc.pod_startup_seconds) / sc.interval_seconds))
        self._state = ScalingState()
        self.last_plan: Plan | None = None
        self.max_headroom = max_headroom
        self._recent_rates: deque[float] = deque([0.0], maxlen=3)

    def initial(self) -> ClusterTarget:
        """Pools planned for the spec's starting sizes' worth of load: the initial counts with planned TPs."""
        sc = self.spec.scaling
        seed = plan(WorkloadEstimate.from_means(0.0, 1024, 256), self.profile, self.spec, self.settings)
        if seed.mode == "Unified":
            return ClusterTarget(unified=PoolSize(max(sc.initial_unified, 1), seed.unified.tp), routing=seed.routing)
        return ClusterTarget(
            prefill=PoolSize(max(sc.initial_prefill, 1), seed.prefill.tp),
            decode=PoolSize(max(sc.initial_decode, 1), seed.decode.tp),
            routing=seed.routing,
        )

    def estimate(self, obs: Observation) -> tuple[WorkloadEstimate, dict[str, dict[str, float]], str]:
        """The workload to plan for after observing ``obs`` (steps 1–2 of the module doc)."""
        self.forecaster.observe(obs)
        if math.isfinite(obs.rate_rps):
            self._recent_rates.append(max(obs.rate_rps, 0.0))
        level = self.spec.scaling.forecaster.prediction_level
        backlog_rate = obs.prefill_queue / self.tick_s if self.tick_s > 0 else 0.0
        fc_h = self.forecaster.forecast(self.horizon_steps, level)
        if not fc_h.ready:
            w = workload_from_observation(obs)
            return (
                WorkloadEstimate(w.rate_rps + backlog_rate, w.isl, w.osl, w.arrival_cv2),
                forecast_dict(fc_h),
                "cold start: planning for the observed load",
            )
        fc_1 = self.forecaster.forecast(1, level)
        # Right after a level shift a model refitted on a short window can extrapolate the jump (a positive MA
        # term) and its error variance is inflated, so the raw bound would provision for many times the load:
        # the planned rate is capped at max_headroom × the highest rate observed over the last intervals.
        base = max(self._recent_rates)
        rate = min(max(fc_h.rate.upper, fc_1.rate.upper), self.max_headroom * base) + backlog_rate
        return (
            workload_from_forecast(fc_h, rate),
            forecast_dict(fc_h),
            f"forecast P{level * 100:g} upper bound {rate:.2f} req/s at +{self.horizon_steps} intervals",
        )

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        """Observe, forecast, plan and scale (module doc). Never raises on odd observations."""
        workload, fc, why = self.estimate(obs)
        p = plan(workload, self.profile, self.spec, self.settings)
        self.last_plan = p
        need = {
            "prefill": float(p.inputs.get("prefill_need", p.prefill.replicas)),
            "decode": float(p.inputs.get("decode_need", p.decode.replicas)),
            "unified": float(p.inputs.get("unified_need", p.unified.replicas)),
        }
        nxt, self._state, reasons = apply_scaling_policy(
            p.target(), current, now_s=obs.time_s, obs=obs, state=self._state, settings=self.scaling, utilisation=need
        )
        reason = "; ".join(reasons) if reasons else "hold"
        return Decision(time_s=obs.time_s, target=nxt, reason=f"{reason} [{why}]", forecast=fc, inputs=plan_inputs(p))
