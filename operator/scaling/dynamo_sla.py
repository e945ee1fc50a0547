"""``dynamo-sla``: a re-implementation of NVIDIA Dynamo's SLA (throughput-based) planner, as a reference.

``fulcrum replay --compare`` measures Fulcrum's planner against it on the same trace and profile. The logic
follows Dynamo's own code, read in ``ai-dynamo/dynamo``:

- ``components/planner/src/dynamo/planner/utils/planner_core.py`` (``Planner.make_adjustments``,
  ``_compute_replica_requirements``; the same formulas live on in the later
  ``components/src/dynamo/planner/utils/prefill_planner.py`` / ``decode_planner.py``);
- ``components/planner/src/dynamo/planner/utils/perf_interpolation.py`` (``PrefillInterpolator``,
  ``DecodeInterpolator.find_best_throughput_per_gpu``);
- ``components/planner/src/dynamo/planner/utils/load_predictor.py`` (``ConstantPredictor``; NaN → 0);
- ``components/planner/src/dynamo/planner/defaults.py`` (``SLAPlannerDefaults``: adjustment interval 180 s,
  ``min_endpoint`` 1, ``load_predictor`` "arima", window 50, ``no_correction`` False);
- ``benchmarks/profiler/utils/profile_prefill.py`` / ``profile_decode.py`` (how "throughput per GPU" is
  profiled: prefill ``isl / ttft / num_gpus`` at batch one; decode output tokens/s / num_gpus at a KV load);
- ``components/src/dynamo/planner/core/budget.py`` (``proportional_clamp_pair``: the GPU-budget clamp).

One adjustment (every ``spec.scaling.interval_seconds``; Dynamo's default is 180 s):

1. observe the last interval: request count, mean ISL, mean OSL, TTFT, ITL; feed the three load series to
   their predictors (a value of 0 where there was none, as Dynamo's ``BasePredictor`` turns NaN into 0);
2. skip the adjustment (keep the pools) when the metrics are invalid — no request, or TTFT/ITL unknown
   (``Metrics.is_valid``: "no active requests, skipping adjustment");
3. correction factors: ``p_cf = TTFT_obs / TTFT_profile(ISL_obs)`` and
   ``d_cf = ITL_obs / ITL_profile(concurrency per decode instance, ISL_obs + OSL_obs/2)``;
4. predict the next interval's request count, ISL and OSL (constant = last value by default);
5. prefill: ``n_p = ceil(rate · ISL · min(1, p_cf) / thpt_p_per_gpu(ISL) / TP_p)`` with
   ``thpt_p_per_gpu(ISL) = ISL / TTFT_profile(ISL) / TP_p`` (tokens/s/GPU);
6. decode: ``ITL* = ITL_SLO / d_cf``; ``thpt_d_per_gpu`` = output tokens/s/GPU at the largest KV load
   whose ITL ≤ ITL* at context ``ISL + OSL/2``; ``n_d = ceil(rate · OSL / thpt_d_per_gpu / TP_d)``;
7. ``max(n, min_endpoint)`` per pool, then the GPU budget (proportional shrink under ``maxGPUs``).

Prefill and decode are sized *independently*, each from its own throughput curve — the point DOPD (§I,
§III) criticises: nothing couples the two pools' capacities or accounts for queueing between them.

Faithfulness notes (where the Fulcrum inputs differ from Dynamo's, and what was assumed):

- **The prefill correction is capped at 1** (``min(1, p_cf)`` in every Dynamo version that has the factor):
  an observed TTFT *above* the profile does not add prefill replicas, one below it (prefix-cache hits)
  removes some. The comment above that line in Dynamo says the opposite ("increase the number of prefill
  replicas linearly to account for the queueing delay"); the code is what runs, so it is the default here.
  ``DynamoSlaSettings.prefill_correction_cap = None`` lifts the cap (the commented intent).
- **Demand**: Dynamo's classic planner counted ``dynamo_frontend_requests_total``, which grows when a
  request *finishes* (fixed upstream in 2026 by counting started requests, ai-dynamo/dynamo PR #9526 and
  #11693). The default ``demand="completed"`` reproduces the classic behaviour (demand measured at
  completion hides queueing during a burst); ``demand="arrivals"`` is the later fix.
- **Latencies**: Dynamo uses the interval's *mean* TTFT and ITL; a Fulcrum :class:`Observation` carries
  them at the SLO percentile (``ttft_p_s``, ``tpot_p_s``), which makes both factors somewhat larger.
- **Concurrency per decode instance** for the expected ITL: Dynamo derives it with Little's law
  (``num_req / n_d · request_duration / interval``); here ``obs.concurrency / n_d``, the same quantity. Both
  count time spent waiting for prefill, so a prefill backlog inflates the expected ITL and lowers ``d_cf``
  (the ITL target is relaxed exactly when prefill is the bottleneck).
- **Decode interpolation**: Dynamo grids KV usage ∈ [0, 1] and context on 100 × 100 points (cubic
  ``griddata``) and scans down from full KV for the first point with ITL ≤ target; here the profile's
  bilinear TPOT(batch, context) is searched exactly for the largest integer batch ``b ≤ KV_cap / context``
  with TPOT ≤ target (TPOT is non-decreasing in batch, checked when the profile loads, so a bisection is
  exact). When no load meets the target, Dynamo takes the lowest-load point: here batch 1.
- **Prefill interpolation**: Dynamo interpolates profiled points with a cubic spline and clamps the ISL to
  the profiled range; here the profile's own interpolation (piecewise linear, quadratic extrapolation).
- **The TTFT target does not enter the prefill formula** in this Dynamo version (its profiler picks a TP
  meeting it); it is reported in ``inputs`` only.
- **GPU budget**: the classic planner rounds (and can overshoot ``max_gpu_budget`` by one engine); the clamp
  here follows the later ``proportional_clamp_pair`` (floors, never exceeds ``maxGPUs``; grows toward
  ``minGPUs`` when the step sizes allow it without exceeding ``maxGPUs``).
- **Predictors**: Dynamo offers constant, ARIMA (pmdarima ``auto_arima``, window 50), Kalman and Prophet,
  default ARIMA. Default here: constant (last value); ``predictor="arima"`` uses ``fulcrum.forecast``'s ARIMA
  (fixed order ``spec.scaling.forecaster.order``, refit on error, no correction factor) instead of an
  ``auto_arima`` search each interval; any series forecaster can be plugged in with ``predictor_factory``.
  Only the mean sizes the pools, as Dynamo uses only the point forecast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fulcrum.api.llmserve import LLMServeSpec
from fulcrum.errors import PlanningError
from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.capacity import slo_batch_limit
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.tp import check_fixed_tp, tp_candidates
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.target import ClusterTarget, PoolSize

__all__ = [
    "DynamoSlaSettings",
    "DynamoSlaPlanner",
    "LoadPredictor",
    "ConstantPredictor",
    "pick_tp",
    "clamp_to_gpu_budget",
    "prefill_throughput_per_gpu",
    "decode_best_batch",
    "decode_throughput_per_gpu",
]


class LoadPredictor(Protocol):
    """What the planner needs of a load predictor (a subset of ``fulcrum.forecast.SeriesForecaster``).

    ``observe`` takes one value per interval; ``forecast(steps, level)`` returns an object with ``mean``,
    ``lower`` and ``upper`` attributes (finite, ≥ 0).
    """

    def observe(self, value: float) -> None: ...

    def forecast(self, steps: int = 1, level: float = 0.9) -> Any: ...


@dataclass(frozen=True)
class _PointForecast:
    mean: float
    lower: float
    upper: float


class ConstantPredictor:
    """Dynamo's ``ConstantPredictor``: the next value is the last one (0 before any; NaN/inf stored as 0).

    Source: ``components/planner/src/dynamo/planner/utils/load_predictor.py`` (``BasePredictor.add_data_point``
    replaces NaN by 0; ``ConstantPredictor.predict_next`` returns the last value). Its bounds equal its mean.
    """

    name = "constant"

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        """Record the latest interval's value (same unit as the series); non-finite values count as 0."""
        v = float(value)
        self._last = v if math.isfinite(v) else 0.0

    def forecast(self, steps: int = 1, level: float = 0.9) -> _PointForecast:
        """The last value, with lower = upper = mean."""
        return _PointForecast(self._last, self._last, self._last)


@dataclass(frozen=True)
class DynamoSlaSettings:
    """Settings of :class:`DynamoSlaPlanner`, with the Dynamo default each stands for.

    Attributes:
        demand: which request count is "the number of requests" of an interval: ``"completed"`` (Dynamo's
            classic ``dynamo_frontend_requests_total``, counted at completion) or ``"arrivals"`` (admitted
            requests; Dynamo after PR #9526).
        predictor: load predictor of each series: ``"constant"`` (last value) or ``"arima"``
            (``fulcrum.forecast.arima.ArimaForecaster`` of order ``spec.scaling.forecaster.order`` without DOPD's
            correction factor; Dynamo's default is pmdarima ``auto_arima`` refitted every interval).
        prediction_window: intervals of history the ARIMA model sees (Dynamo ``load_prediction_window_size = 50``).
        correction: apply the correction factors (Dynamo ``no_correction = False``).
        prefill_correction_cap: upper cap on the prefill factor: Dynamo's ``min(1, p_cf)`` → 1.0;
            ``None`` = no cap (an observed TTFT above the profile adds prefill replicas).
        min_endpoint: fewest replicas of each pool (Dynamo ``min_endpoint = 1``).
        prediction_level: level of the bounds reported in ``Decision.forecast`` (the point forecast alone
            sizes the pools, as in Dynamo).
    """

    demand: Literal["completed", "arrivals"] = "completed"
    predictor: Literal["constant", "arima"] = "constant"
    prediction_window: int = 50
    correction: bool = True
    prefill_correction_cap: float | None = 1.0
    min_endpoint: int = 1
    prediction_level: float = 0.9

    def __post_init__(self) -> None:
        if self.demand not in ("completed", "arrivals"):
            raise ValueError(f"demand must be 'completed' or 'arrivals', got {self.demand!r}")
        if self.predictor not in ("constant", "arima"):
            raise ValueError(f"predictor must be 'constant' or 'arima', got {self.predictor!r}")
        if self.prediction_window < 2:
            raise ValueError(f"prediction_window must be >= 2, got {self.prediction_window}")
        if self.min_endpoint < 1:
            raise ValueError(f"min_endpoint must be >= 1, got {self.min_endpoint}")
        if self.prefill_correction_cap is not None and not self.prefill_correction_cap > 0:
            raise ValueError(f"prefill_correction_cap must be > 0 or None, got {self.prefill_correction_cap}")


# ------------------------------------------------------------------------------------------------------ #
# Shared helpers (also used by ``dynamo-load``)                                                          #
# ------------------------------------------------------------------------------------------------------ #


_TP_FIELDS = {"prefill": "spec.scaling.tpPrefill", "decode": "spec.scaling.tpDecode"}


def pick_tp(fixed: int | None, profile: PerformanceProfile, phase: Literal["prefill", "decode"], max_model_len: int,
            *, max_tp: int) -> int:
    """TP of one pool: ``fixed`` if given, else the smallest TP ≤ ``max_tp`` the profile has for ``phase`` whose KV
    cache holds one ``max_model_len``-token sequence, as the ``fulcrum``, ``static`` and ``dopd`` planners require
    (the same candidates as theirs, :mod:`fulcrum.ratio.tp`): ``profile.kv_capacity_tokens(tp) >= max_model_len``
    tokens (DOPD eq. 11, V_mem/M_token). vLLM refuses to start an engine that cannot hold one such sequence, so a
    pool with a smaller TP would crash-loop its pods; and an instance is one pod, so a TP above the GPUs of one node
    (``spec.gpu.gpusPerNode``) could never be scheduled.

    Args:
        fixed: ``spec.scaling.tp_prefill`` / ``tp_decode`` (GPUs per instance), or ``None``. The spec refuses a fixed
            TP above ``gpu.gpusPerNode`` when it is validated.
        profile: the performance profile.
        phase: ``"prefill"`` or ``"decode"``.
        max_model_len: ``spec.engine.max_model_len``, tokens.
        max_tp: the largest TP to choose, ``spec.gpu.gpus_per_node`` (GPUs).

    Returns:
        The tensor-parallel size (GPUs per instance).

    Raises:
        PlanningError: the fixed TP has no table for ``phase`` in the profile; the fixed TP cannot hold one
            ``max_model_len``-token sequence (the message names ``spec.scaling.tpPrefill`` / ``tpDecode``;
            :func:`fulcrum.ratio.tp.check_fixed_tp`); no TP the profile has for ``phase`` holds the weights
            (``kv_capacity_tokens(tp) == 0``); the profile has no ``phase`` TP ≤ ``max_tp``; or none of those holds
            one ``max_model_len``-token sequence (:func:`fulcrum.ratio.tp.fits_max_model_len`: the message names the
            numbers and the fix, a smaller maxModelLen or a larger ``spec.gpu.gpusPerNode``).
    """
    tps = profile.prefill_tps if phase == "prefill" else profile.decode_tps
    if fixed is not None:
        if fixed not in tps:
            raise PlanningError(f"profile {profile.name!r} has no {phase} table for TP={fixed} (has {tps})")
        check_fixed_tp(profile, fixed, max_model_len, _TP_FIELDS[phase], tps)
        if profile.kv_capacity_tokens(fixed) <= 0:
            raise PlanningError(f"the model's weights do not fit a TP={fixed} {phase} instance of {profile.gpu_type}")
        return fixed
    holds_weights = [tp for tp in tps if profile.kv_capacity_tokens(tp) > 0]
    if not holds_weights:
        raise PlanningError(f"no {phase} TP in profile {profile.name!r} ({tps}) holds the model's weights")
    # the candidates of the fulcrum/static/dopd planners' TP choice: measured, ≤ max_tp, holding max_model_len
    return tp_candidates(profile, tps, None, max_tp, phase, max_model_len, _TP_FIELDS[phase])[0]


def clamp_to_gpu_budget(
    n_p: int, n_d: int, tp_p: int, tp_d: int, min_gpus: int, max_gpus: int, min_endpoint: int = 1
) -> tuple[int, int]:
    """Fit (prefill, decode) replica counts into the GPU band ``[min_gpus, max_gpus]``.

    Follows Dynamo's ``proportional_clamp_pair`` (``components/src/dynamo/planner/core/budget.py``): above
    the ceiling both pools shrink by the same factor (floors; decode gets what prefill leaves, never more
    than it asked for); below the floor both grow by the same factor (ceilings) unless that would pass the
    ceiling, in which case the counts are kept. Each pool keeps at least ``min_endpoint`` replicas.

    Args:
        n_p, n_d: wanted replicas (instances).
        tp_p, tp_d: GPUs per prefill / decode instance.
        min_gpus, max_gpus: the budget (GPUs).
        min_endpoint: fewest replicas per pool.

    Returns:
        ``(n_p, n_d)`` with ``n_p·tp_p + n_d·tp_d ≤ max_gpus``.

    Raises:
        PlanningError: ``min_endpoint`` instances of each pool alone exceed ``max_gpus``.
    """
    floor_gpus = min_endpoint * (tp_p + tp_d)
    if floor_gpus > max_gpus:
        raise PlanningError(
            f"{min_endpoint} prefill (TP={tp_p}) + {min_endpoint} decode (TP={tp_d}) instances need "
            f"{floor_gpus} GPUs, more than maxGPUs={max_gpus}"
        )
    n_p, n_d = max(n_p, min_endpoint), max(n_d, min_endpoint)
    total = n_p * tp_p + n_d * tp_d
    if total > max_gpus:
        scale = max_gpus / total
        max_p = (max_gpus - min_endpoint * tp_d) // tp_p
        new_p = max(min_endpoint, min(max_p, math.floor(n_p * scale)))
        new_d = max(min_endpoint, min(n_d, (max_gpus - new_p * tp_p) // tp_d))
        n_p, n_d = new_p, new_d
    elif total < min_gpus:
        scale = min_gpus / total
        new_p = max(min_endpoint, math.ceil(n_p * scale))
        new_d = max(min_endpoint, math.ceil(max(0, min_gpus - new_p * tp_p) / tp_d))
        if new_p * tp_p + new_d * tp_d <= max_gpus:
            n_p, n_d = new_p, new_d
    assert n_p * tp_p + n_d * tp_d <= max_gpus
    return n_p, n_d


def prefill_throughput_per_gpu(profile: PerformanceProfile, tp: int, isl: float) -> float:
    """Prefill throughput of one TP-``tp`` instance per GPU at prompt length ``isl``, tokens/s/GPU.

    Dynamo's profiler definition (``benchmarks/profiler/utils/profile_prefill.py``):
    ``isl / ttft(isl) / num_gpus`` with the TTFT of one request alone (no batching). ``isl`` below 1 token
    is taken as 1.
    """
    x = max(float(isl), 1.0)
    return x / profile.ttft(x, tp) / tp


def decode_best_batch(profile: PerformanceProfile, tp: int, itl_s: float, context: float) -> int:
    """Largest decode batch of a TP-``tp`` instance whose step time stays ≤ ``itl_s`` at ``context`` tokens.

    The batch is bounded by the KV cache (``b · context ≤ kv_capacity_tokens(tp)``, Dynamo's KV usage ≤ 1).
    When even one request misses ``itl_s``, returns 1 (Dynamo's ``find_best_throughput_per_gpu`` falls back
    to the lowest-load point).

    Args:
        profile: the performance profile.
        tp: tensor-parallel size of the decode instance.
        itl_s: ITL target, seconds.
        context: mean context length (prompt + generated so far), tokens.

    Returns:
        The batch size (requests), ≥ 1.
    """
    ctx = max(float(context), 1.0)
    b_max = max(int(profile.kv_capacity_tokens(tp) // ctx), 1)
    return max(slo_batch_limit(profile, tp, ctx, itl_s, b_max), 1)


def decode_throughput_per_gpu(profile: PerformanceProfile, tp: int, itl_s: float, context: float) -> tuple[float, int, float]:
    """Best decode throughput per GPU that still meets ``itl_s`` at ``context`` tokens.

    Dynamo ``DecodeInterpolator.find_best_throughput_per_gpu`` (``utils/perf_interpolation.py``); throughput
    per GPU is output tokens/s / num_gpus (``benchmarks/profiler/utils/profile_decode.py``).

    Returns:
        ``(tokens/s/GPU, batch, step seconds)`` at the batch of :func:`decode_best_batch`.
    """
    ctx = max(float(context), 1.0)
    b = decode_best_batch(profile, tp, itl_s, ctx)
    step = profile.tpot(b, ctx, tp)
    return b / step / tp, b, step


# ------------------------------------------------------------------------------------------------------ #
# The planner                                                                                            #
# ------------------------------------------------------------------------------------------------------ #


def _finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@dataclass
class _Corrections:
    """Correction factors carried between adjustments (Dynamo keeps them on the planner object)."""

    prefill: float = 1.0
    decode: float = 1.0
    inputs: dict[str, float] = field(default_factory=dict)


class DynamoSlaPlanner:
    """Dynamo's SLA planner for Disaggregated serving (P and D pools; the unified pool stays empty).

    Args:
        spec: the ``LLMServe`` spec: SLOs (``slo.tpot_ms`` is Dynamo's ITL target), ``scaling`` (interval,
            TPs, initial pools, ``minGPUs``/``maxGPUs``).
        profile: the performance profile (TTFT and TPOT tables).
        settings: see :class:`DynamoSlaSettings`; Dynamo's behaviour by default.
        predictor_factory: builds one predictor per load series (request count, ISL, OSL); overrides
            ``settings.predictor`` (default :class:`ConstantPredictor`). Any ``fulcrum.forecast`` series
            forecaster fits.

    Raises:
        PlanningError: no usable TP for a pool (a TP must be at most ``spec.gpu.gpusPerNode`` and hold the weights
            plus one ``spec.engine.maxModelLen``-token sequence of KV cache; a pinned ``tpPrefill``/``tpDecode`` that
            does not is named: :func:`pick_tp`), or one instance of each pool exceeds ``maxGPUs``.

    Attributes:
        name: ``"dynamo-sla"``.
        tick_s: the adjustment interval, ``spec.scaling.interval_seconds`` (Dynamo's default is 180 s).
        forecaster: None (its load predictors are Dynamo's, not a :class:`WorkloadForecaster`).
        horizon_steps: 1 (the predictors forecast the next interval).
    """

    def __init__(
        self,
        spec: LLMServeSpec,
        profile: PerformanceProfile,
        settings: DynamoSlaSettings | None = None,
        predictor_factory: Callable[[], LoadPredictor] | None = None,
    ) -> None:
        self.name = "dynamo-sla"
        self.tick_s = float(spec.scaling.interval_seconds)
        self.forecaster: WorkloadForecaster | None = None  # Dynamo's own load predictors, fitted on what it sees
        self.horizon_steps = 1  # they predict the next interval
        self._spec = spec
        self._profile = profile
        self._settings = settings or DynamoSlaSettings()
        max_tp = spec.gpu.gpus_per_node  # one instance is one pod: its TP fits one node
        self._tp_p = pick_tp(spec.scaling.tp_prefill, profile, "prefill", spec.engine.max_model_len, max_tp=max_tp)
        self._tp_d = pick_tp(spec.scaling.tp_decode, profile, "decode", spec.engine.max_model_len, max_tp=max_tp)
        self._min_gpus = spec.scaling.min_gpus
        self._max_gpus = spec.scaling.max_gpus
        clamp_to_gpu_budget(1, 1, self._tp_p, self._tp_d, 0, self._max_gpus, self._settings.min_endpoint)
        make = predictor_factory or self._default_predictor_factory()
        self._num_req_predictor: LoadPredictor = make()
        self._isl_predictor: LoadPredictor = make()
        self._osl_predictor: LoadPredictor = make()
        self._cf = _Corrections()

    def _default_predictor_factory(self) -> Callable[[], LoadPredictor]:
        """The factory ``settings.predictor`` names (ARIMA imported only when asked for: statsmodels is heavy)."""
        if self._settings.predictor == "constant":
            return ConstantPredictor
        from fulcrum.forecast.arima import ArimaForecaster

        order = tuple(self._spec.scaling.forecaster.order)
        window = self._settings.prediction_window

        def arima() -> LoadPredictor:
            return ArimaForecaster(order=(order[0], order[1], order[2]), window=window, min_points=5, correction=False)

        return arima

    def initial(self) -> ClusterTarget:
        """The starting pools: ``spec.scaling.initial_prefill/initial_decode`` (≥ ``min_endpoint``) in budget."""
        s = self._spec.scaling
        n_p, n_d = self._clamp(s.initial_prefill, s.initial_decode)
        return ClusterTarget(prefill=PoolSize(n_p, self._tp_p), decode=PoolSize(n_d, self._tp_d))

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        """One adjustment from the interval that just ended (Dynamo ``observe_metrics`` + ``make_adjustments``).

        Never raises on odd observations; an interval without requests or latencies keeps ``current``.
        """
        num_req = float(obs.completed if self._settings.demand == "completed" else obs.arrivals)
        isl, osl = float(obs.mean_isl), float(obs.mean_osl)
        self._num_req_predictor.observe(num_req)
        self._isl_predictor.observe(isl)
        self._osl_predictor.observe(osl)
        forecast = self._forecast(obs.interval_s)

        ttft, itl = float(obs.ttft_p_s), float(obs.tpot_p_s)
        valid = num_req > 0 and all(_finite_positive(x) for x in (isl, osl, ttft, itl))
        if not valid or not obs.interval_s > 0:
            return Decision(
                time_s=obs.time_s,
                target=self._keep(current),
                reason="dynamo-sla: no valid metrics this interval (no requests or no TTFT/ITL); adjustment skipped",
                forecast=forecast,
                numbers=PlanNumbers(detail={"num_req": num_req, "isl": isl, "osl": osl, "ttft_s": ttft, "itl_s": itl}),
            )
        if self._settings.correction:
            self._update_corrections(obs, current, isl, osl, ttft, itl)
        return self._adjust(obs, current, forecast)

    # -- internals --------------------------------------------------------------------------------------

    def _clamp(self, n_p: int, n_d: int) -> tuple[int, int]:
        return clamp_to_gpu_budget(
            n_p, n_d, self._tp_p, self._tp_d, self._min_gpus, self._max_gpus, self._settings.min_endpoint
        )

    def _keep(self, current: ClusterTarget) -> ClusterTarget:
        """``current`` when it has this planner's TPs and fits the budget, else its pools clamped into it."""
        n_p, n_d = current.prefill.replicas, current.decode.replicas
        m = self._settings.min_endpoint
        if (
            current.prefill.tp == self._tp_p
            and current.decode.tp == self._tp_d
            and n_p >= m
            and n_d >= m
            and current.gpus <= self._max_gpus
        ):
            return current
        n_p, n_d = self._clamp(n_p, n_d)
        return ClusterTarget(prefill=PoolSize(n_p, self._tp_p), decode=PoolSize(n_d, self._tp_d), routing=current.routing)

    def _forecast(self, interval_s: float) -> dict[str, dict[str, float]]:
        level = self._settings.prediction_level
        out: dict[str, dict[str, float]] = {}
        for key, pred in (("rate", self._num_req_predictor), ("isl", self._isl_predictor), ("osl", self._osl_predictor)):
            f = pred.forecast(1, level)
            scale = 1.0 / interval_s if key == "rate" and interval_s > 0 else 1.0
            vals = {k: float(getattr(f, k)) * scale for k in ("mean", "lower", "upper")}
            out[key] = {k: (max(v, 0.0) if math.isfinite(v) else 0.0) for k, v in vals.items()}
        return out

    def _update_corrections(
        self, obs: Observation, current: ClusterTarget, isl: float, osl: float, ttft: float, itl: float
    ) -> None:
        """Dynamo ``make_adjustments``: p_cf = TTFT_obs / TTFT_profile(ISL); d_cf = ITL_obs / ITL_profile."""
        expect_ttft = self._profile.ttft(isl, self._tp_p)
        n_d = obs.ready.decode if obs.ready.decode > 0 else max(current.decode.replicas, 1)
        concurrency = max(float(obs.concurrency), 0.0) if math.isfinite(obs.concurrency) else 0.0
        per_instance = concurrency / n_d
        context = isl + osl / 2
        expect_itl = self._profile.tpot(per_instance, context, self._tp_d)
        self._cf.prefill = ttft / expect_ttft
        self._cf.decode = itl / expect_itl
        self._cf.inputs = {
            "expected_ttft_s": expect_ttft,
            "observed_ttft_s": ttft,
            "expected_itl_s": expect_itl,
            "observed_itl_s": itl,
            "decode_concurrency_per_instance": per_instance,
        }

    def _adjust(self, obs: Observation, current: ClusterTarget, forecast: dict[str, dict[str, float]]) -> Decision:
        """Dynamo ``_compute_replica_requirements`` on the predicted load."""
        s = self._settings
        rate = forecast["rate"]["mean"]  # predicted requests / interval_s (Dynamo: next_num_req / duration)
        isl, osl = forecast["isl"]["mean"], forecast["osl"]["mean"]

        p_cf = self._cf.prefill
        p_factor = p_cf if s.prefill_correction_cap is None else min(s.prefill_correction_cap, p_cf)
        prefill_tokens_s = rate * isl * p_factor
        p_thpt = prefill_throughput_per_gpu(self._profile, self._tp_p, isl)
        n_p_raw = math.ceil(prefill_tokens_s / p_thpt / self._tp_p)

        itl_slo = self._spec.slo.tpot_ms / 1e3
        d_cf = self._cf.decode
        corrected_itl = itl_slo / d_cf if d_cf > 0 else itl_slo
        context = isl + osl / 2
        d_thpt, d_batch, d_step = decode_throughput_per_gpu(self._profile, self._tp_d, corrected_itl, context)
        decode_tokens_s = rate * osl
        n_d_raw = math.ceil(decode_tokens_s / d_thpt / self._tp_d)

        n_p, n_d = self._clamp(n_p_raw, n_d_raw)
        budget_note = ""
        if n_p < max(n_p_raw, s.min_endpoint) or n_d < max(n_d_raw, s.min_endpoint):
            budget_note = f"; shrunk to fit maxGPUs={self._max_gpus}"
        reason = (
            f"dynamo-sla: prefill {prefill_tokens_s:.0f} tok/s / {p_thpt * self._tp_p:.0f} per instance → {n_p_raw}; "
            f"decode {decode_tokens_s:.0f} tok/s / {d_thpt * self._tp_d:.0f} per instance "
            f"(ITL* {corrected_itl * 1e3:.1f} ms at {context:.0f} tokens) → {n_d_raw}{budget_note}"
        )
        inputs: dict[str, Any] = {
            **self._cf.inputs,
            "p_correction_factor": p_cf,
            "p_correction_applied": p_factor,
            "d_correction_factor": d_cf,
            "predicted_rate_rps": rate,
            "predicted_isl": isl,
            "predicted_osl": osl,
            "prefill_tokens_per_s": prefill_tokens_s,
            "prefill_thpt_per_gpu": p_thpt,
            "ttft_target_s": self._spec.slo.ttft_ms / 1e3,
            "itl_target_s": itl_slo,
            "corrected_itl_s": corrected_itl,
            "decode_context_tokens": context,
            "decode_batch_at_itl": d_batch,
            "decode_step_s": d_step,
            "decode_thpt_per_gpu": d_thpt,
            "decode_tokens_per_s": decode_tokens_s,
            "n_p_raw": n_p_raw,
            "n_d_raw": n_d_raw,
            "tp_p": self._tp_p,
            "tp_d": self._tp_d,
        }
        target = ClusterTarget(
            prefill=PoolSize(n_p, self._tp_p), decode=PoolSize(n_d, self._tp_d), routing=current.routing
        )
        assert target.gpus <= self._max_gpus
        numbers = PlanNumbers(mode="Disaggregated", ratio=n_p / n_d if n_d else math.nan, gpus=target.gpus, detail=inputs)
        return Decision(time_s=obs.time_s, target=target, reason=reason, forecast=forecast, numbers=numbers)
