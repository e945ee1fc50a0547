"""The ``dopd`` reference policy: DOPD Algorithm 2 as published, with no Fulcrum extras.

Every interval T (Alg. 2 lines 3–15):

- ARIMA one-step forecasts of the mean input length i_next, mean output length o_next and the load r_next
  (lines 7–9; the point forecast, no prediction bound, no start-up horizon);
- ttft_next = INTERP(ttft, i_next) at TP_p, tpot_next = INTERP(tpot, cc, context) at TP_d (lines 10–11);
- R_opt by eq. (15) (line 12), n_d = ⌈r_next / CC_max⌉ (line 13), n_p = R_opt · n_d (line 14), applied as is
  (line 15: no hysteresis, cooldown or reactive guard).

r_next is read as the forecast decode concurrency (the paper's "expected average concurrency"), obtained by
Little's law from the forecast rate: r = λ·(ttft + o·tpot). CC_max is the D-instance capacity of eqs.
(11)–(14). Request routing uses DOPD's own scheduler (§V-E): Alg. 1 length-aware batching with
i_next = the forecast ISL and ultra-short prompts prefilled locally.
"""

from __future__ import annotations

import logging
import math

from fulcrum.api.llmserve import ForecasterMethod, LLMServeSpec
from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.capacity import decode_capacity
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import PlannerSettings, initial_in_budget, ultra_short_threshold
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.tp import choose_decode_tp, choose_prefill_tp
from fulcrum.scaling.fulcrum import forecast_dict
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams

_log = logging.getLogger(__name__)

__all__ = ["DopdPlanner"]


class DopdPlanner:
    """DOPD Alg. 2 (see module doc). Implements :class:`fulcrum.scaling.planner.Planner`.

    Attributes:
        initial_note: why :meth:`initial` cut the spec's initial counts to ``spec.scaling.maxGPUs``, None when it
            did not (set by each call of :meth:`initial`).
    """

    name = "dopd"
    horizon_steps = 1  # Alg. 2 plans for the next interval's point forecast

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, *, settings: PlannerSettings | None = None) -> None:
        """Fix the P and D TPs once (:mod:`fulcrum.ratio.tp`, at 1024/256 tokens).

        Raises:
            PlanningError: no TP up to ``settings.max_tp`` holds one ``settings.max_model_len``-token sequence in
                its KV cache, or a TP ``spec.scaling`` fixes does not (vLLM would refuse to start).
        """
        self.spec = spec
        self.profile = profile
        self.tick_s = float(spec.scaling.interval_seconds)
        self.settings = settings or PlannerSettings.from_spec(spec)
        fspec = spec.scaling.forecaster.model_copy(update={"method": ForecasterMethod.ARIMA})
        self.forecaster = WorkloadForecaster(fspec)
        tpot_slo = spec.slo.tpot_ms / 1e3
        # TPs whose KV cache cannot hold one maxModelLen sequence are never chosen (vLLM would not start)
        self.tp_d = choose_decode_tp(profile, 1024, 256, tpot_slo, fixed=spec.scaling.tp_decode, max_tp=self.settings.max_tp,
                                     max_model_len=self.settings.max_model_len).tp
        self.tp_p = choose_prefill_tp(
            profile, LengthDistribution.point(1024), spec.slo.ttft_ms / 1e3, 0.9,
            fixed=spec.scaling.tp_prefill, max_tp=self.settings.max_tp, max_model_len=self.settings.max_model_len,
        )
        self.initial_note: str | None = None

    def initial(self) -> ClusterTarget:
        """The spec's initial counts (at least one of each pool) at the fixed TPs, cut to ``spec.scaling.maxGPUs``
        as the Fulcrum planner cuts its initial pools (:func:`fulcrum.ratio.planner.initial_in_budget`; a cut is
        logged and kept in :attr:`initial_note`)."""
        sc = self.spec.scaling
        counts, self.initial_note = initial_in_budget(
            {"p": max(sc.initial_prefill, 1), "d": max(sc.initial_decode, 1)}, {"p": self.tp_p, "d": self.tp_d},
            sc.max_gpus,
        )
        if self.initial_note is not None:
            _log.warning("%s", self.initial_note)
        return ClusterTarget(prefill=PoolSize(counts["p"], self.tp_p), decode=PoolSize(counts["d"], self.tp_d))

    def _in_budget(self, n_p: int, n_d: int) -> tuple[int, int]:
        """``(n_p, n_d)`` instances within the GPU budget, as any deployment has one (not part of Alg. 2): over
        ``spec.scaling.maxGPUs`` both pools shrink by the same factor (floors, at least one instance each); when
        that floor of one instance lifts the total over maxGPUs again, the pools above one instance give up the
        excess, the one using more GPUs first. Only one instance of each pool can stay over maxGPUs (the least a
        disaggregated deployment can be)."""
        tp_p, tp_d = self.tp_p, self.tp_d
        gpus = n_p * tp_p + n_d * tp_d
        max_gpus = self.spec.scaling.max_gpus
        if gpus > max_gpus:
            f = max_gpus / gpus
            n_p, n_d = max(int(n_p * f), 1), max(int(n_d * f), 1)
            # a pool floored up to one instance can lift the total over maxGPUs: take the excess from the pools
            # above one instance, the one using more GPUs first
            counts, tps = {"p": n_p, "d": n_d}, {"p": tp_p, "d": tp_d}
            over = n_p * tp_p + n_d * tp_d - max_gpus
            for k in sorted(counts, key=lambda k: -counts[k] * tps[k]):
                if over <= 0:
                    break
                cut = min(counts[k] - 1, math.ceil(over / tps[k]))
                counts[k] -= cut
                over -= cut * tps[k]
            n_p, n_d = counts["p"], counts["d"]
        return n_p, n_d

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        self.forecaster.observe(obs)
        fc = self.forecaster.forecast(1, self.spec.scaling.forecaster.prediction_level)
        ok = fc.ready
        rate = fc.rate.mean if ok else obs.rate_rps
        i_next = fc.isl.mean if ok else obs.mean_isl
        o_next = fc.osl.mean if ok else obs.mean_osl
        rate = rate if math.isfinite(rate) and rate > 0 else 0.0
        i_next = i_next if math.isfinite(i_next) and i_next > 0 else 1024.0
        o_next = o_next if math.isfinite(o_next) and o_next > 0 else 256.0
        tpot_slo = self.spec.slo.tpot_ms / 1e3
        cap = decode_capacity(self.profile, self.tp_d, i_next, o_next, tpot_slo,
                              bandwidth_utilisation=self.settings.bandwidth_utilisation, graph_headroom=self.settings.graph_headroom)
        cc_max = max(cap.cc, 1)
        ttft_next = self.profile.ttft(i_next, self.tp_p)
        # Little's law at a full batch; then the step time at the batch each D-instance will actually run
        r_next = rate * (ttft_next + o_next * cap.step_s)
        n_d = math.ceil(r_next / cc_max - 1e-9) if rate > 0 else 0
        per_d = r_next / n_d if n_d else 0.0
        tpot_next = self.profile.tpot(max(per_d, 1.0), cap.context_tokens, self.tp_d)
        r_opt = per_d * ttft_next / (o_next * tpot_next) if n_d else 0.0
        n_p = math.ceil(r_opt * n_d - 1e-9) if n_d else 0
        if rate > 0 or self.spec.scaling.min_gpus > 0:
            # serving needs one instance of each pool; minGPUs > 0 keeps them through idle intervals
            n_p, n_d = max(n_p, 1), max(n_d, 1)
        n_p, n_d = self._in_budget(n_p, n_d)
        u = ultra_short_threshold(self.profile, self.tp_p, self.tp_d, tpot_next, tpot_slo, self.settings)
        target = ClusterTarget(
            prefill=PoolSize(n_p, self.tp_p),
            decode=PoolSize(n_d, self.tp_d),
            routing=RoutingParams(
                ultra_short_tokens=u, long_request_tokens=max(int(i_next), 1), batch_timeout_s=0.05,
                length_aware_batching=True, max_prefill_batch_tokens=max(int(i_next), self.settings.max_model_len),
            ),
        )
        return Decision(
            time_s=obs.time_s,
            target=target,
            reason=f"Alg. 2: R_opt={r_opt:.2f}, n_p={n_p}, n_d={n_d} for r_next={r_next:.1f}",
            forecast=forecast_dict(fc),
            numbers=PlanNumbers(
                mode="Disaggregated", ratio=float(r_opt), decode_concurrency=float(cc_max), gpus=target.gpus,
                detail={"r_next": r_next, "i_next": i_next, "o_next": o_next, "ttft_next_s": ttft_next,
                        "tpot_next_s": tpot_next, "cc_max": cc_max, "rate_rps": rate},
            ),
        )
