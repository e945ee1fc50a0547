"""The ``static`` reference policy: the counts written in the spec, never changed (a fixed P/D deployment)."""

from __future__ import annotations

from fulcrum.api.llmserve import LLMServeSpec, Mode
from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.capacity import decode_capacity
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import PlannerSettings, ultra_short_threshold
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.tp import check_fixed_tp, choose_decode_tp, choose_prefill_tp, fits_max_model_len
from fulcrum.scaling.planner import Decision
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams

__all__ = ["StaticPlanner"]

#: Prompt and output lengths, tokens, a static deployment's TPs and router parameters are chosen at (it forecasts
#: nothing).
_NOMINAL_ISL, _NOMINAL_OSL = 1024, 256


class StaticPlanner:
    """Fixed pools from ``spec.scaling.initialPrefill/initialDecode/initialUnified`` (TP from the spec, else the
    TP the planner's TP choice gives, :mod:`fulcrum.ratio.tp`; Unified: the smallest measured TP whose KV cache
    holds one ``spec.engine.maxModelLen``-token sequence), or exactly ``target`` when one is given (a plan's pools,
    TPs and routing parameters, run unchanged: ``benchmarks/bench_plan_calibration.py``). Implements
    :class:`fulcrum.scaling.planner.Planner`.

    Raises:
        PlanningError: (without ``target``) no TP up to ``spec.gpu.gpusPerNode`` holds one maxModelLen-token
            sequence in its KV cache, or a TP the spec fixes does not (vLLM would refuse to start).
    """

    name = "static"
    forecaster: WorkloadForecaster | None = None  # never forecasts
    horizon_steps = 1

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, target: ClusterTarget | None = None) -> None:
        self.spec = spec
        self.tick_s = float(spec.scaling.interval_seconds)
        if target is not None:
            self._target = target
            return
        sc = spec.scaling
        s = PlannerSettings.from_spec(spec)
        tpot = spec.slo.tpot_ms / 1e3
        if spec.mode == Mode.UNIFIED:
            common = sorted(set(profile.prefill) & set(profile.decode))
            if sc.tp_unified:
                tp_u = sc.tp_unified
                check_fixed_tp(profile, tp_u, s.max_model_len, "spec.scaling.tpUnified", common or None)
            else:
                pool = common or sorted(profile.decode_tps)
                cands = [tp for tp in pool if tp <= s.max_tp] or pool  # (a pool only above max_tp: as before)
                tp_u = fits_max_model_len(profile, cands, s.max_model_len, phase="unified",
                                          max_tp=max(s.max_tp, max(cands)))[0]
            # the router config a static pool gets too: the batch at which one instance's TPOT reaches the SLO
            # (role reassignment counts decode-duty compute against it), at the nominal lengths
            cc = decode_capacity(profile, tp_u, _NOMINAL_ISL, _NOMINAL_OSL, tpot).cc if tp_u in profile.decode else 0
            self._target = ClusterTarget(unified=PoolSize(sc.initial_unified, tp_u),
                                         routing=RoutingParams(decode_concurrency=cc if cc >= 1 else None))
            return
        cap = choose_decode_tp(profile, _NOMINAL_ISL, _NOMINAL_OSL, tpot, fixed=sc.tp_decode, max_tp=s.max_tp,
                               max_model_len=s.max_model_len)
        tp_p = choose_prefill_tp(profile, LengthDistribution.point(_NOMINAL_ISL), spec.slo.ttft_ms / 1e3, 0.9,
                                 fixed=sc.tp_prefill, max_tp=s.max_tp, max_model_len=s.max_model_len)
        u = ultra_short_threshold(profile, tp_p, cap.tp, cap.step_s, tpot, s)
        self._target = ClusterTarget(
            prefill=PoolSize(sc.initial_prefill, tp_p),
            decode=PoolSize(sc.initial_decode, cap.tp),
            routing=RoutingParams(ultra_short_tokens=u, long_request_tokens=_NOMINAL_ISL, length_aware_batching=False),
        )

    def initial(self) -> ClusterTarget:
        return self._target

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        return Decision(time_s=obs.time_s, target=self._target, reason="static: counts from the spec")
