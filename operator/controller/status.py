"""The LLMServe ``status``: conditions, the last forecast and plan with their numbers, pools, replicas.

Pure functions from what the loop decided and what the cluster reports to a status mapping (the caller
writes it through the status subresource). Paths (the printer columns in ``fulcrum.api.crd`` read some)::

    status:
      observedGeneration: 3
      conditions: [{type, status: "True"|"False", reason, message, lastTransitionTime}]  # Ready, Progressing,
                                                                                         # Degraded, ForecastReady, SLOFeasible
      forecast: {rate: 12.5, rateLower, rateUpper, islTokens, oslTokens, concurrency, horizonIntervals?}
      plan: {ratio, reason, time, decodeConcurrency, expectedTtftSeconds, gpus, mode, feasible,
             sloInfeasible?: [{metric, targetSeconds, bestSeconds, atIsl, atOsl, tp, plannedForSeconds}]}
      pools: {prefill: {ready, desired, tp}, decode: {...}, unified: {...}}
      routing: {ultraShortTokens, longRequestTokens, batchTimeoutSeconds, lengthAwareBatching, maxPrefillBatchTokens}
      sloAttainment: 0.97                      # last interval's, absent when nothing finished
      replicas: 5                              # instances ready now, all pools (scale subresource)
      selector: "fulcrum.dev/llmserve=llama"   # label selector of every worker pod
      lastObservation: {time, arrivals, rate, meanIsl, meanOsl}

``lastTransitionTime`` changes only when a condition's ``status`` flips (Kubernetes API conventions).

``SLOFeasible`` is written when the planner judges feasibility (the ``fulcrum`` policy: the plan's
``slo_infeasible``, :mod:`fulcrum.ratio.feasibility`): True/``Feasible``, or False with reason ``TTFTInfeasible``,
``TPOTInfeasible`` or ``TTFTAndTPOTInfeasible`` and a message with the target, the best the profile achieves and
the lengths; ``status.plan.sloInfeasible`` holds the same numbers. Reference policies leave it unset.
After an operator restart :func:`target_from_status` reads the target in force back from ``status.pools`` and
``status.routing``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from fulcrum.observation import ReadyCounts
from fulcrum.ratio.feasibility import SLOInfeasible, condition_reason
from fulcrum.scaling.loop import PLANNING_FAILED, LoopOutcome
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams


__all__ = [
    "CONDITION_TYPES",
    "set_condition",
    "get_condition",
    "target_from_status",
    "pools_status",
    "routing_status",
    "build_status",
    "rfc3339",
    "slo_infeasibility",
    "degraded_reason",
]

#: Condition types the operator maintains, in the order they are written.
CONDITION_TYPES: tuple[str, ...] = ("Ready", "Progressing", "Degraded", "ForecastReady", "SLOFeasible")


def rfc3339(now: datetime) -> str:
    """``2026-01-02T03:04:05Z`` (UTC, seconds), the format of Kubernetes timestamps."""
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_condition(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    """The condition of type ``type_``, or None."""
    for c in conditions or ():
        if c.get("type") == type_:
            return c
    return None


def set_condition(conditions: Sequence[Mapping[str, Any]] | None, type_: str, status: bool, reason: str,
                  message: str, now: datetime) -> list[dict[str, Any]]:
    """A new condition list with ``type_`` set; ``lastTransitionTime`` is kept unless ``status`` flips.

    Args:
        conditions: the current list (not modified).
        type_: e.g. ``Ready``; status: True/False; reason: CamelCase word; message: one human line.
        now: the time of a transition.
    """
    want = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions or ():
        if c.get("type") != type_:
            out.append(dict(c))
            continue
        found = True
        same = c.get("status") == want
        out.append({"type": type_, "status": want, "reason": reason, "message": message[:1000],
                    "lastTransitionTime": c.get("lastTransitionTime") if same and c.get("lastTransitionTime")
                    else rfc3339(now)})
    if not found:
        out.append({"type": type_, "status": want, "reason": reason, "message": message[:1000],
                    "lastTransitionTime": rfc3339(now)})
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(str(c.get("type")), len(order)))


def target_from_status(status: Mapping[str, Any] | None) -> ClusterTarget | None:
    """The target in force as the operator last wrote it (``status.pools.<pool>.{desired,tp}``), or None when
    the status holds none (a new resource) or is malformed."""
    pools = (status or {}).get("pools")
    if not isinstance(pools, Mapping):
        return None
    sizes: dict[Pool, PoolSize] = {}
    try:
        for pool in Pool:
            p = pools.get(pool.value) or {}
            sizes[pool] = PoolSize(int(p.get("desired", 0)), int(p.get("tp", 1)))
    except (TypeError, ValueError):
        return None
    routing = RoutingParams()
    r = (status or {}).get("routing")
    if isinstance(r, Mapping):
        try:
            routing = RoutingParams(
                ultra_short_tokens=int(r.get("ultraShortTokens", routing.ultra_short_tokens)),
                long_request_tokens=int(r.get("longRequestTokens", routing.long_request_tokens)),
                batch_timeout_s=float(r.get("batchTimeoutSeconds", routing.batch_timeout_s)),
                length_aware_batching=bool(r.get("lengthAwareBatching", routing.length_aware_batching)),
                max_prefill_batch_tokens=int(r.get("maxPrefillBatchTokens", routing.max_prefill_batch_tokens)),
                prefill_share=float(r["prefillShare"]) if r.get("prefillShare") is not None else None,
                decode_concurrency=int(r["decodeConcurrency"]) if r.get("decodeConcurrency") is not None else None,
            )
        except (TypeError, ValueError):
            routing = RoutingParams()
    return ClusterTarget.of(sizes, routing)


def routing_status(routing: RoutingParams) -> dict[str, Any]:
    """``status.routing``: the router's split-policy parameters in force (read back after a restart)."""
    return {"ultraShortTokens": routing.ultra_short_tokens, "longRequestTokens": routing.long_request_tokens,
            "batchTimeoutSeconds": routing.batch_timeout_s, "lengthAwareBatching": routing.length_aware_batching,
            "maxPrefillBatchTokens": routing.max_prefill_batch_tokens,
            **({"prefillShare": round(routing.prefill_share, 4)} if routing.prefill_share is not None else {}),
            **({"decodeConcurrency": routing.decode_concurrency} if routing.decode_concurrency is not None else {})}


def pools_status(target: ClusterTarget, ready: ReadyCounts) -> dict[str, dict[str, int]]:
    """``status.pools``: per pool ``{ready, desired, tp}``."""
    return {p.value: {"ready": ready.of(p), "desired": size.replicas, "tp": size.tp} for p, size in target.pools()}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _forecast_status(outcome: LoopOutcome) -> dict[str, Any] | None:
    fc = outcome.forecast
    if not fc:
        return None
    out: dict[str, Any] = {}
    rate = fc.get("rate", {})
    for key, src in (("rate", "mean"), ("rateLower", "lower"), ("rateUpper", "upper")):
        v = _num(rate.get(src))
        if v is not None:
            out[key] = round(v, 4)
    for key, series in (("islTokens", "isl"), ("oslTokens", "osl"), ("concurrency", "concurrency")):
        v = _num(fc.get(series, {}).get("mean"))
        if v is not None:
            out[key] = round(v, 2)
    return out or None


def slo_infeasibility(outcome: LoopOutcome) -> tuple[SLOInfeasible, ...] | None:
    """The SLO targets the plan found out of reach (empty: both can be met), or None when the planner does not
    judge feasibility (the reference planners)."""
    return outcome.numbers.slo_infeasible


def _slo_condition(conds: list[dict[str, Any]], found: tuple[SLOInfeasible, ...], now: datetime) -> list[dict[str, Any]]:
    message = ("; ".join(f.message() for f in found) if found
               else "both targets can be met at the forecast lengths")
    return set_condition(conds, "SLOFeasible", not found, condition_reason(found), message, now)


def _plan_status(outcome: LoopOutcome, now: datetime) -> dict[str, Any]:
    n = outcome.numbers
    plan: dict[str, Any] = {"reason": outcome.reason[:1000], "time": rfc3339(now)}
    for key, value in (("ratio", n.ratio), ("decodeConcurrency", n.decode_concurrency),
                       ("expectedTtftSeconds", n.expected_ttft_s), ("gpus", n.gpus)):
        v = _num(value)
        if v is not None:
            plan[key] = round(v, 4)
    if n.mode is not None:
        plan["mode"] = n.mode
    if n.feasible is not None:
        plan["feasible"] = n.feasible
    found = slo_infeasibility(outcome)
    if found:
        plan["sloInfeasible"] = [
            {"metric": f.metric, "targetSeconds": round(f.target_s, 6), "bestSeconds": round(f.best_s, 6),
             "atIsl": round(f.at_isl, 1), "atOsl": round(f.at_osl, 1), "tp": f.tp,
             "plannedForSeconds": round(f.planned_for_s, 6)} for f in found]
    return plan


def degraded_reason(degraded: str | None, outcome: LoopOutcome | None) -> str:
    """The Degraded condition's reason, and the Warning Event's when an interval turns degraded:
    ObservationUnavailable (nothing observed this interval), PlanningFailed
    (the planner failed on what was observed: :meth:`fulcrum.scaling.loop.ControlLoop.step`), Fault (anything
    else, e.g. a drain timeout) or AsExpected."""
    if not degraded:
        return "AsExpected"
    if outcome is not None and not outcome.observed:
        return "ObservationUnavailable"
    if outcome is not None and outcome.degraded is not None and outcome.degraded.startswith(PLANNING_FAILED):
        return "PlanningFailed"
    return "Fault"


def build_status(
    *,
    previous: Mapping[str, Any] | None,
    generation: int | None,
    target: ClusterTarget,
    ready: ReadyCounts,
    selector: str,
    now: datetime,
    outcome: LoopOutcome | None = None,
    degraded: str | None = None,
    draining: Sequence[str] = (),
    spec_error: str | None = None,
    apply_rejected: str | None = None,
) -> dict[str, Any]:
    """The status to write after one reconcile or interval.

    Args:
        previous: the status as read (its conditions keep their transition times; its forecast and plan are
            kept when this interval produced none).
        generation: ``metadata.generation`` that was reconciled.
        target: the target in force after this interval.
        ready: ready instances per pool (the Deployments' ``status.readyReplicas``).
        selector: label selector of the worker pods (``status.selector``).
        now: the current time (transition times, plan time).
        outcome: what the loop decided this interval, or None (a reconcile without a planner step).
        degraded: why the operator is degraded (e.g. Prometheus down, drain timed out), or None.
        draining: pod names being drained now (``status.draining``).
        spec_error: the spec is invalid (nothing applied): Degraded=True reason InvalidSpec, Ready=False.
        apply_rejected: the API server rejected the objects of this generation (its message): Degraded=True reason
            ApplyRejected (before ``degraded``'s message, which is appended); the rest as usual.

    When ``previous`` observed a later generation than ``generation`` and found it invalid (Degraded reason
    InvalidSpec), its ``observedGeneration`` and its ``Degraded`` and ``Ready`` conditions are kept: a drain of the
    last valid spec that ends meanwhile reports its pools without clearing that verdict.

    Returns:
        the whole ``status`` mapping, written as an RFC 7386 merge patch: a key of a nested field of ``previous``
        (``plan``, ``forecast``, ``routing``, ``pools``, ``lastObservation``) that this status no longer has
        (``plan.sloInfeasible`` once the SLO is in reach, ``plan.ratio`` of a Unified plan, ``routing.prefillShare``
        of a Disaggregated one) is None, so the patch deletes it instead of leaving it beside the new values.
    """
    prev = dict(previous or {})
    conds: list[dict[str, Any]] = [dict(c) for c in prev.get("conditions") or () if isinstance(c, Mapping)]
    status: dict[str, Any] = {k: v for k, v in prev.items() if k in ("forecast", "plan", "sloAttainment")}
    if spec_error is not None:
        conds = set_condition(conds, "Degraded", True, "InvalidSpec", spec_error, now)
        conds = set_condition(conds, "Ready", False, "InvalidSpec", "the spec is invalid; nothing was applied", now)
        status["conditions"] = conds
        if generation is not None:
            status["observedGeneration"] = int(generation)
        return status
    desired = {p: target.pool(p).replicas for p in Pool}
    short = [p.value for p in Pool if ready.of(p) < desired[p]]
    total_desired = sum(desired.values())
    is_ready = total_desired > 0 and not short
    msg_pools = ", ".join(f"{p} {ready.of(p)}/{desired[p]}" for p in Pool if desired[p] or ready.of(p))
    conds = set_condition(conds, "Ready", is_ready, "PoolsReady" if is_ready else "PoolsNotReady",
                          f"ready/desired: {msg_pools or 'no instances'}", now)
    progressing = bool(short) or bool(draining)
    why = ("draining " + ", ".join(draining)) if draining else (f"waiting for {', '.join(short)}" if short else "stable")
    conds = set_condition(conds, "Progressing", progressing,
                          "Draining" if draining else ("ScalingPools" if short else "Stable"), why, now)
    if apply_rejected is not None:
        conds = set_condition(conds, "Degraded", True, "ApplyRejected",
                              "; ".join([apply_rejected] + ([degraded] if degraded else [])), now)
    else:
        conds = set_condition(conds, "Degraded", degraded is not None, degraded_reason(degraded, outcome),
                              degraded or "observing, forecasting and planning normally", now)
    if outcome is not None:
        fr = outcome.forecast_ready
        conds = set_condition(conds, "ForecastReady", fr, "Forecasting" if fr else
                              ("NoObservation" if not outcome.observed else "ColdStart"),
                              "forecasting from history" if fr else
                              ("no observation this interval" if not outcome.observed
                               else "too little history: planning for the observed load"), now)
        fc = _forecast_status(outcome)
        if fc is not None:
            status["forecast"] = fc
        if outcome.observed:
            status["plan"] = _plan_status(outcome, now)
            found = slo_infeasibility(outcome)
            if found is not None:
                conds = _slo_condition(conds, found, now)
            obs = outcome.observation
            if obs is not None:
                att = _num(obs.slo_attainment)
                if att is not None:
                    status["sloAttainment"] = round(att, 4)
                status["lastObservation"] = {"time": rfc3339(now), "arrivals": obs.arrivals,
                                             "rate": round(obs.rate_rps, 4), "meanIsl": round(obs.mean_isl, 2),
                                             "meanOsl": round(obs.mean_osl, 2)}
    elif get_condition(conds, "ForecastReady") is None:
        conds = set_condition(conds, "ForecastReady", False, "NoHistory", "no interval observed yet", now)
    status["conditions"] = conds
    status["pools"] = pools_status(target, ready)
    status["routing"] = routing_status(target.routing)
    # the scale subresource's statusReplicasPath: instances ready now, all pools (what an HPA reads as current)
    status["replicas"] = ready.total
    status["selector"] = selector
    status["draining"] = list(draining)
    if generation is not None:
        status["observedGeneration"] = int(generation)
    _keep_newer_verdict(prev, status)
    return _delete_stale(prev, status)


def _keep_newer_verdict(previous: Mapping[str, Any], status: dict[str, Any]) -> None:
    """A status built for an older generation than ``previous`` observed (a drain of the last valid spec ending
    after a newer spec was found invalid) reports the pools, but keeps the newer generation's
    ``observedGeneration`` and its InvalidSpec ``Degraded`` and ``Ready`` conditions: nothing of that spec was
    applied, and the verdict stands until a valid generation is reconciled."""
    seen, now = previous.get("observedGeneration"), status.get("observedGeneration")
    if not (isinstance(seen, int) and isinstance(now, int) and seen > now):
        return
    status["observedGeneration"] = seen
    prev_conds = [c for c in previous.get("conditions") or () if isinstance(c, Mapping)]
    degraded = get_condition(prev_conds, "Degraded")
    if degraded is None or degraded.get("reason") != "InvalidSpec":
        return
    kept = {t: dict(c) for t in ("Degraded", "Ready") if (c := get_condition(prev_conds, t)) is not None}
    status["conditions"] = [kept.get(str(c.get("type")), c) for c in status.get("conditions") or ()]


def _delete_stale(previous: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """``status`` with None (RFC 7386: delete) for every key of a nested mapping of ``previous`` that the same
    mapping in ``status`` lacks; top-level keys absent from ``status`` are left alone (kept by the merge)."""
    def stale(old: Mapping[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        out = dict(new)
        for k, v in old.items():
            if k not in out:
                out[k] = None
            elif isinstance(v, Mapping) and isinstance(out[k], dict):
                out[k] = stale(v, out[k])
        return out

    return {k: stale(previous[k], v) if isinstance(v, dict) and isinstance(previous.get(k), Mapping) else v
            for k, v in status.items()}
