"""The ``static`` reference policy: the counts written in the spec, never changed (a fixed P/D deployment)."""

from __future__ import annotations

import logging

from fulcrum.api.llmserve import LLMServeSpec, Mode
from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.capacity import decode_capacity
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import PlannerSettings, initial_in_budget, ultra_short_threshold
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.tp import check_fixed_tp, choose_decode_tp, choose_prefill_tp, tp_candidates
from fulcrum.scaling.planner import Decision
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams

_log = logging.getLogger(__name__)

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

    The spec's counts are cut to ``spec.scaling.maxGPUs`` when they need more GPUs at those TPs, as the Fulcrum
    planner cuts its initial pools (:func:`initial_in_budget`): the cut is logged, held in :attr:`initial_note` and
    named in every decision's reason. A given ``target`` is not cut.

    Attributes:
        initial_note: why the spec's counts were cut to maxGPUs, None when they were not.

    Raises:
        PlanningError: (without ``target``) the profile measures no TP up to ``spec.gpu.gpusPerNode`` (an instance
            is one pod), none of those holds one maxModelLen-token sequence in its KV cache, or a TP the spec fixes
            does not (vLLM would refuse to start).
    """

    name = "static"
    forecaster: WorkloadForecaster | None = None  # never forecasts
    horizon_steps = 1

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, target: ClusterTarget | None = None) -> None:
        self.spec = spec
        self.tick_s = float(spec.scaling.interval_seconds)
        self.initial_note: str | None = None
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
                # measured, ≤ gpusPerNode (one instance is one pod), holding maxModelLen: the smallest
                tp_u = tp_candidates(profile, pool, None, s.max_tp, "unified", s.max_model_len,
                                      "spec.scaling.tpUnified")[0]
            # the router config a static pool gets too: the batch at which one instance's TPOT reaches the SLO
            # (role reassignment counts decode-duty compute against it), at the nominal lengths
            cc = decode_capacity(profile, tp_u, _NOMINAL_ISL, _NOMINAL_OSL, tpot).cc if tp_u in profile.decode else 0
            counts = self._in_budget({"u": sc.initial_unified}, {"u": tp_u})
            self._target = ClusterTarget(unified=PoolSize(counts["u"], tp_u),
                                         routing=RoutingParams(decode_concurrency=cc if cc >= 1 else None))
            return
        cap = choose_decode_tp(profile, _NOMINAL_ISL, _NOMINAL_OSL, tpot, fixed=sc.tp_decode, max_tp=s.max_tp,
                               max_model_len=s.max_model_len)
        tp_p = choose_prefill_tp(profile, LengthDistribution.point(_NOMINAL_ISL), spec.slo.ttft_ms / 1e3, 0.9,
                                 fixed=sc.tp_prefill, max_tp=s.max_tp, max_model_len=s.max_model_len)
        u = ultra_short_threshold(profile, tp_p, cap.tp, cap.step_s, tpot, s)
        counts = self._in_budget({"p": sc.initial_prefill, "d": sc.initial_decode}, {"p": tp_p, "d": cap.tp})
        self._target = ClusterTarget(
            prefill=PoolSize(counts["p"], tp_p),
            decode=PoolSize(counts["d"], cap.tp),
            routing=RoutingParams(ultra_short_tokens=u, long_request_tokens=_NOMINAL_ISL, length_aware_batching=False),
        )

    def _in_budget(self, wanted: dict[str, int], tps: dict[str, int]) -> dict[str, int]:
        """The spec's counts cut to maxGPUs (:func:`initial_in_budget`); a cut is logged and kept in
        :attr:`initial_note`."""
        counts, self.initial_note = initial_in_budget(wanted, tps, self.spec.scaling.max_gpus)
        if self.initial_note is not None:
            _log.warning("%s", self.initial_note)
        return counts

    def initial(self) -> ClusterTarget:
        return self._target

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        reason = "static: counts from the spec"
        if self.initial_note is not None:
            reason += f"; {self.initial_note}"
        return Decision(time_s=obs.time_s, target=self._target, reason=reason)
