"""Can the profile meet the SLOs at all, at the forecast lengths? And what to plan for when it cannot.

A TTFT or TPOT target can be out of reach of the hardware whatever the instance count: the decode step of a
single request at a long context can already exceed the TPOT target, and the prefill of the prompt at the SLO
percentile can already exceed the TTFT target on an idle instance. The planner then used to buy instances up to
``maxGPUs`` (a D-instance of one request each) without meeting anything. Instead it now:

1. reports each unmeetable target as an :class:`SLOInfeasible` (the target, the best the profile achieves and
   the lengths it was judged at), carried by the plan to the operator's status condition and Event, to
   ``fulcrum replay`` and to ``fulcrum plan``;
2. sizes for the best achievable value with a small slack (:func:`relaxed_slo`), not for the cap.

The best values, at batch 1 and without queueing, over the TPs the planner may choose (fixed TP, or every
measured TP ≤ ``max_tp`` that holds the weights):

- TPOT: ``min_TP tpot(1, ISL + OSL/2, TP)`` — the profiled step of one request at the mean context of eq. (13);
- TTFT: ``min_TP ttft(ISL_q, TP)`` (+ the KV transfer of ``ISL_q`` tokens when disaggregated) — the prefill of the
  prompt at the SLO percentile q on an idle instance.

Pure: no I/O, deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from fulcrum.api.llmserve import SLOSpec
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.profile import PerformanceProfile

__all__ = ["SLOMetric", "SLOInfeasible", "slo_feasibility", "relaxed_slo", "condition_reason"]

#: The SLO targets a plan can find out of reach.
SLOMetric = Literal["ttft", "tpot"]


@dataclass(frozen=True)
class SLOInfeasible:
    """One SLO target the profile cannot meet at the forecast lengths, whatever the instance count.

    Attributes:
        metric: ``"ttft"`` or ``"tpot"``.
        target_s: the spec's target, seconds.
        best_s: the best the profile achieves (batch 1, no queueing, best TP), seconds; > ``target_s``.
        at_isl: prompt length it was judged at, tokens (TTFT: the ISL at the SLO percentile; TPOT: the mean ISL).
        at_osl: mean output length, tokens.
        tp: the TP at which ``best_s`` is reached.
        planned_for_s: the target the plan sized for instead, ``best_s · (1 + slack)``, seconds.
    """

    metric: SLOMetric
    target_s: float
    best_s: float
    at_isl: float
    at_osl: float
    tp: int
    planned_for_s: float

    @property
    def reason(self) -> str:
        """CamelCase reason for a condition or Event: ``TTFTInfeasible`` or ``TPOTInfeasible``."""
        return f"{self.metric.upper()}Infeasible"

    def message(self) -> str:
        """One human line with the numbers, e.g. ``TPOT target 80 ms cannot be met: best 94.2 ms at batch 1
        (TP2, ISL 15000, OSL 2000 tokens); planning for 103.6 ms``."""
        what = "at batch 1" if self.metric == "tpot" else "on an idle instance"
        return (f"{self.metric.upper()} target {self.target_s * 1e3:.4g} ms cannot be met: best "
                f"{self.best_s * 1e3:.4g} ms {what} (TP{self.tp}, ISL {self.at_isl:.0f}, OSL {self.at_osl:.0f} "
                f"tokens); planning for {self.planned_for_s * 1e3:.4g} ms")

    def as_dict(self) -> dict[str, float | int | str]:
        """Plain mapping (JSON, status): the fields, seconds and tokens."""
        return {"metric": self.metric, "target_s": self.target_s, "best_s": self.best_s, "at_isl": self.at_isl,
                "at_osl": self.at_osl, "tp": self.tp, "planned_for_s": self.planned_for_s}


def _tps(available: Iterable[int], fixed: int | None, max_tp: int) -> list[int]:
    avail = sorted(available)
    if fixed is not None:
        return [fixed] if fixed in avail else []
    return [tp for tp in avail if tp <= max_tp]


def slo_feasibility(
    profile: PerformanceProfile,
    slo: SLOSpec,
    isl: LengthDistribution,
    osl: LengthDistribution,
    *,
    prefill_tps: Iterable[int],
    decode_tps: Iterable[int],
    fixed_prefill: int | None = None,
    fixed_decode: int | None = None,
    max_tp: int = 8,
    kv_link_gbps: float | None = None,
    kv_transfer_overhead_s: float = 0.0,
    slack: float = 0.1,
) -> tuple[SLOInfeasible, ...]:
    """The SLO targets out of reach at these lengths (module doc), TTFT first; empty when both can be met.

    Args:
        profile: the performance profile.
        slo: the targets and their percentile.
        isl / osl: forecast length distributions, tokens.
        prefill_tps / decode_tps: TPs the planner may use for the prefill and decode work (in Unified mode
            both are the TPs measured for both phases).
        fixed_prefill / fixed_decode: a TP pinned by the spec (only it is considered).
        max_tp: largest TP considered.
        kv_link_gbps / kv_transfer_overhead_s: KV link bandwidth (GB/s) and fixed cost per transfer (s) when
            prefill and decode run on different instances (the percentile prompt's transfer adds to its TTFT);
            ``None`` in Unified mode.
        slack: the planned-for value is ``best · (1 + slack)``.

    A TP without room for the weights is skipped; with no TP left the metric is not judged (the planner
    raises its own :class:`~fulcrum.errors.PlanningError`).
    """
    q = min(max(slo.percentile / 100.0, 0.5), 0.999)
    mean_isl, mean_osl = max(isl.mean(), 1.0), max(osl.mean(), 1.0)
    out: list[SLOInfeasible] = []
    isl_q = isl.quantile(q)
    p_tps = [tp for tp in _tps(prefill_tps, fixed_prefill, max_tp) if profile.kv_capacity_tokens(tp) > 0]
    if p_tps:
        extra = (kv_transfer_overhead_s + profile.kv_transfer_seconds(isl_q, kv_link_gbps)) if kv_link_gbps else 0.0
        best_ttft, tp_t = min((profile.ttft(isl_q, tp) + extra, tp) for tp in p_tps)
        target = slo.ttft_ms / 1e3
        if best_ttft > target:
            out.append(SLOInfeasible("ttft", target, best_ttft, isl_q, mean_osl, tp_t, best_ttft * (1 + slack)))
    d_tps = [tp for tp in _tps(decode_tps, fixed_decode, max_tp) if profile.kv_capacity_tokens(tp) > 0]
    if d_tps:
        context = mean_isl + mean_osl / 2.0
        best_tpot, tp_d = min((profile.tpot(1, context, tp), tp) for tp in d_tps)
        target = slo.tpot_ms / 1e3
        if best_tpot > target:
            out.append(SLOInfeasible("tpot", target, best_tpot, mean_isl, mean_osl, tp_d, best_tpot * (1 + slack)))
    return tuple(out)


def relaxed_slo(slo: SLOSpec, infeasible: Iterable[SLOInfeasible]) -> SLOSpec:
    """``slo`` with each out-of-reach target replaced by what the plan sizes for (``planned_for_s``)."""
    update: dict[str, float] = {}
    for f in infeasible:
        update[f"{f.metric}_ms"] = f.planned_for_s * 1e3
    return slo.model_copy(update=update) if update else slo


def condition_reason(infeasible: Iterable[SLOInfeasible]) -> str:
    """The ``SLOFeasible`` condition's reason: ``Feasible``, ``TTFTInfeasible``, ``TPOTInfeasible`` or
    ``TTFTAndTPOTInfeasible``."""
    found = {f.metric for f in infeasible}
    metrics = [m for m in ("ttft", "tpot") if m in found]
    if not metrics:
        return "Feasible"
    return "And".join(m.upper() for m in metrics) + "Infeasible"
