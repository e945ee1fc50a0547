"""The LLMServe status is written as an RFC 7386 merge patch (``KubeObjects.write_status``): a nested status field
that no longer applies must leave the stored status, not linger beside the new values (and be read back after an
operator restart)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from fulcrum.controller.objects import InMemoryObjects
from fulcrum.controller.status import build_status, get_condition, target_from_status
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.feasibility import SLOInfeasible
from fulcrum.scaling.loop import LoopOutcome
from fulcrum.scaling.planner import PlanNumbers
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
UNIFIED = ClusterTarget(unified=PoolSize(4, 2),
                        routing=RoutingParams(ultra_short_tokens=64, prefill_share=0.25, decode_concurrency=88))
DISAGG = ClusterTarget(prefill=PoolSize(3, 1), decode=PoolSize(2, 2), routing=RoutingParams(ultra_short_tokens=64))


def _outcome(target: ClusterTarget, numbers: PlanNumbers, rate: dict[str, float]) -> LoopOutcome:
    obs = Observation(time_s=60.0, interval_s=60.0, arrivals=600, mean_isl=1000.0, mean_osl=150.0,
                      slo_attainment=0.9, completed=500)
    return LoopOutcome(target=target, reason="plan", observed=True, changes={Pool.PREFILL: (1, 3)},
                       forecast={"rate": rate, "isl": {"mean": 1000.0}, "osl": {"mean": 150.0}},
                       numbers=numbers, observation=obs, forecast_ready=True)


def _write(objs: InMemoryObjects, target: ClusterTarget, outcome: LoopOutcome, now: datetime) -> dict:
    previous = (objs.get("fulcrum.dev/v1alpha1", "LLMServe", "default", "llama") or {}).get("status")
    st = build_status(previous=previous, generation=1, target=target, ready=ReadyCounts(), selector="s", now=now,
                      outcome=outcome)
    assert objs.write_status("default", "llama", st)
    return dict((objs.get("fulcrum.dev/v1alpha1", "LLMServe", "default", "llama") or {})["status"])


def test_status_fields_that_no_longer_apply_leave_the_merge_patched_status() -> None:
    objs = InMemoryObjects()
    objs.put({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "metadata": {"name": "llama"}})
    tpot = SLOInfeasible("tpot", target_s=0.08, best_s=0.09, at_isl=14000, at_osl=2000, tp=2, planned_for_s=0.099)
    first = _outcome(UNIFIED, PlanNumbers(ratio=math.nan, decode_concurrency=88.0, expected_ttft_s=0.5, gpus=8,
                                          mode="Unified", feasible=False, slo_infeasible=(tpot,)),
                     {"mean": 10.0, "lower": 8.0, "upper": 12.0})
    st = _write(objs, UNIFIED, first, T0)
    assert st["plan"]["sloInfeasible"] and st["routing"]["prefillShare"] == 0.25 and st["forecast"]["rateLower"] == 8

    then = _outcome(DISAGG, PlanNumbers(ratio=1.5, decode_concurrency=60.0, expected_ttft_s=0.4, gpus=7,
                                        mode="Disaggregated", feasible=True, slo_infeasible=()),
                    {"mean": 10.0, "upper": 12.0})
    st = _write(objs, DISAGG, then, T0 + timedelta(minutes=1))
    assert get_condition(st["conditions"], "SLOFeasible")["status"] == "True"  # type: ignore[index]
    assert "sloInfeasible" not in st["plan"]  # was kept beside SLOFeasible=True
    assert "prefillShare" not in st["routing"] and "decodeConcurrency" not in st["routing"]
    assert "rateLower" not in st["forecast"]
    assert target_from_status(st) == DISAGG  # an operator restart reads back the routing in force, not a stale share
    assert st["plan"]["ratio"] == 1.5

    back = _outcome(UNIFIED, PlanNumbers(ratio=math.nan, decode_concurrency=88.0, expected_ttft_s=0.5, gpus=8,
                                         mode="Unified", feasible=True, slo_infeasible=()),
                    {"mean": 10.0, "lower": 8.0, "upper": 12.0})
    st = _write(objs, UNIFIED, back, T0 + timedelta(minutes=2))
    assert "ratio" not in st["plan"]  # the printer column Ratio must not show the disaggregated plan's ratio
    assert target_from_status(st) == UNIFIED


def test_keys_the_operator_keeps_between_intervals_are_not_removed() -> None:
    objs = InMemoryObjects()
    objs.put({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "metadata": {"name": "llama"},
              "status": {"kopf": {"progress": {}}}})
    st = _write(objs, DISAGG, _outcome(DISAGG, PlanNumbers(ratio=1.5, gpus=7), {"mean": 10.0}), T0)
    blind = LoopOutcome(target=DISAGG, reason="hold", observed=False, degraded="Prometheus down")
    previous = st
    st2 = build_status(previous=previous, generation=1, target=DISAGG, ready=ReadyCounts(), selector="s",
                       now=T0 + timedelta(minutes=1), outcome=blind, degraded="Prometheus down")
    objs.write_status("default", "llama", st2)
    live = (objs.get("fulcrum.dev/v1alpha1", "LLMServe", "default", "llama") or {})["status"]
    assert live["plan"] == st["plan"] and live["forecast"] == st["forecast"]
    assert live["lastObservation"] == st["lastObservation"] and live["kopf"] == {"progress": {}}


def test_a_status_of_an_older_generation_keeps_the_newer_ones_invalid_spec_verdict() -> None:
    ok = build_status(previous=None, generation=1, target=DISAGG, ready=ReadyCounts(3, 2, 0), selector="s", now=T0)
    invalid = build_status(previous=ok, generation=2, target=ClusterTarget(), ready=ReadyCounts(), selector="",
                           now=T0 + timedelta(minutes=1), spec_error="spec.engine.extraArgs: bad")
    merged = {**ok, **invalid}
    late = build_status(previous=merged, generation=1, target=DISAGG.with_replicas(Pool.PREFILL, 2),
                        ready=ReadyCounts(2, 2, 0), selector="s", now=T0 + timedelta(minutes=2))
    assert late["observedGeneration"] == 2 and late["pools"]["prefill"]["desired"] == 2
    assert get_condition(late["conditions"], "Degraded") == get_condition(invalid["conditions"], "Degraded")
    assert get_condition(late["conditions"], "Ready") == get_condition(invalid["conditions"], "Ready")
    fixed = build_status(previous=late, generation=3, target=DISAGG, ready=ReadyCounts(3, 2, 0), selector="s",
                         now=T0 + timedelta(minutes=3))
    assert fixed["observedGeneration"] == 3
    assert get_condition(fixed["conditions"], "Degraded")["reason"] == "AsExpected"  # type: ignore[index]
