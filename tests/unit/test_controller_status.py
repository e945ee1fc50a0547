"""LLMServe status (fulcrum.controller.status): conditions and their transition times, numbers, restart read-back."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from fulcrum.api.crd import PRINTER_COLUMNS
from fulcrum.scaling.loop import LoopOutcome
from fulcrum.scaling.planner import PlanNumbers
from fulcrum.controller.status import build_status, get_condition, set_condition, target_from_status
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.target import ClusterTarget, Pool, PoolSize, RoutingParams

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
TARGET = ClusterTarget(prefill=PoolSize(4, 1), decode=PoolSize(2, 2),
                       routing=RoutingParams(ultra_short_tokens=64, long_request_tokens=1024, batch_timeout_s=0.05,
                                             length_aware_batching=True, prefill_share=0.25,
                                             decode_concurrency=88))


def outcome(observed: bool = True, att: float = 0.95) -> LoopOutcome:
    o = Observation(time_s=60.0, interval_s=60.0, arrivals=600, mean_isl=1000.0, mean_osl=150.0,
                    slo_attainment=att, completed=500)
    if not observed:
        return LoopOutcome(target=TARGET, reason="hold: no observation", observed=False, degraded="Prometheus down")
    return LoopOutcome(target=TARGET, reason="prefill: 1→4 (forecast needs 4)", observed=True,
                       changes={Pool.PREFILL: (1, 4)},
                       forecast={"rate": {"mean": 10.0, "lower": 8.0, "upper": 12.5}, "isl": {"mean": 1000.0},
                                 "osl": {"mean": 150.0}},
                       numbers=PlanNumbers(ratio=4.58, decode_concurrency=235.0, expected_ttft_s=0.8, gpus=8,
                                           mode="Disaggregated", feasible=True),
                       observation=o, forecast_ready=True)


def _path(d: dict, json_path: str):
    node = d
    for part in json_path.strip(".").split(".")[1:]:
        node = node[part]
    return node


def test_a_condition_keeps_its_transition_time_until_its_status_flips() -> None:
    c = set_condition([], "Ready", False, "PoolsNotReady", "waiting", T0)
    c = set_condition(c, "Ready", False, "PoolsNotReady", "still waiting", T0 + timedelta(minutes=1))
    assert get_condition(c, "Ready")["lastTransitionTime"] == "2026-05-01T12:00:00Z"
    assert get_condition(c, "Ready")["message"] == "still waiting"
    c = set_condition(c, "Ready", True, "PoolsReady", "ok", T0 + timedelta(minutes=2))
    assert get_condition(c, "Ready")["lastTransitionTime"] == "2026-05-01T12:02:00Z"
    c = set_condition(c, "Degraded", False, "AsExpected", "fine", T0)
    assert [x["type"] for x in c] == ["Ready", "Degraded"]


def test_status_carries_the_forecast_plan_pools_and_the_printer_column_paths() -> None:
    st = build_status(previous=None, generation=3, target=TARGET, ready=ReadyCounts(4, 1, 0),
                      selector="fulcrum.dev/llmserve=llama", now=T0, outcome=outcome())
    assert st["observedGeneration"] == 3
    assert st["forecast"] == {"rate": 10.0, "rateLower": 8.0, "rateUpper": 12.5, "islTokens": 1000.0, "oslTokens": 150.0}
    assert st["plan"]["ratio"] == 4.58 and st["plan"]["decodeConcurrency"] == 235.0 and st["plan"]["feasible"] is True
    assert st["pools"] == {"prefill": {"ready": 4, "desired": 4, "tp": 1}, "decode": {"ready": 1, "desired": 2, "tp": 2},
                           "unified": {"ready": 0, "desired": 0, "tp": 1}}
    assert st["sloAttainment"] == 0.95 and st["replicas"] == 5 and st["selector"] == "fulcrum.dev/llmserve=llama"
    for col in PRINTER_COLUMNS:
        if col["jsonPath"].startswith(".status"):
            assert _path(st, col["jsonPath"]) is not None, col["jsonPath"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Ready"]["status"] == "False" and "decode 1/2" in conds["Ready"]["message"]
    assert conds["Progressing"]["status"] == "True" and conds["Progressing"]["reason"] == "ScalingPools"
    assert conds["Degraded"]["status"] == "False"
    assert conds["ForecastReady"]["status"] == "True"


def test_a_blind_interval_is_degraded_and_keeps_the_last_forecast_and_plan() -> None:
    first = build_status(previous=None, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s",
                         now=T0, outcome=outcome())
    later = T0 + timedelta(minutes=5)
    st = build_status(previous=first, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s",
                      now=later, outcome=outcome(observed=False), degraded="Prometheus down")
    d = get_condition(st["conditions"], "Degraded")
    assert d["status"] == "True" and d["reason"] == "ObservationUnavailable" and d["message"] == "Prometheus down"
    assert d["lastTransitionTime"] == "2026-05-01T12:05:00Z"
    assert get_condition(st["conditions"], "Ready")["lastTransitionTime"] == "2026-05-01T12:00:00Z"
    assert st["plan"] == first["plan"] and st["forecast"] == first["forecast"]
    assert get_condition(st["conditions"], "ForecastReady")["reason"] == "NoObservation"


def test_an_invalid_spec_sets_degraded_and_not_ready_only() -> None:
    st = build_status(previous=None, generation=2, target=ClusterTarget(), ready=ReadyCounts(), selector="",
                      now=T0, spec_error="spec.slo.ttftMs: must be > 0")
    assert get_condition(st["conditions"], "Degraded")["reason"] == "InvalidSpec"
    assert get_condition(st["conditions"], "Ready")["status"] == "False"
    assert "pools" not in st and st["observedGeneration"] == 2


def test_an_apply_the_api_server_rejected_sets_degraded_apply_rejected_and_keeps_the_pools() -> None:
    st = build_status(previous=None, generation=3, target=TARGET, ready=ReadyCounts(prefill=4, decode=2),
                      selector="s", now=T0, degraded="Prometheus down",
                      apply_rejected='HTTP 422: Deployment.apps "x-prefill" is invalid')
    d = get_condition(st["conditions"], "Degraded")
    assert d is not None and d["status"] == "True" and d["reason"] == "ApplyRejected"
    assert d["message"] == 'HTTP 422: Deployment.apps "x-prefill" is invalid; Prometheus down'
    assert st["pools"]["prefill"]["desired"] == 4 and st["observedGeneration"] == 3
    cleared = build_status(previous=st, generation=4, target=TARGET, ready=ReadyCounts(prefill=4, decode=2),
                           selector="s", now=T0 + timedelta(seconds=60))
    assert get_condition(cleared["conditions"], "Degraded")["reason"] == "AsExpected"  # type: ignore[index]


def test_the_target_reads_back_from_status_after_a_restart() -> None:
    st = build_status(previous=None, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s", now=T0,
                      draining=["llama-decode-x"])
    assert target_from_status(st) == TARGET
    assert st["draining"] == ["llama-decode-x"]
    assert get_condition(st["conditions"], "Progressing")["reason"] == "Draining"
    assert target_from_status({}) is None and target_from_status(None) is None
    assert target_from_status({"pools": {"prefill": {"desired": "x"}}}) is None


def test_nan_numbers_are_left_out_of_status() -> None:
    o = outcome(att=math.nan)
    st = build_status(previous=None, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s", now=T0,
                      outcome=o)
    assert "sloAttainment" not in st


def test_an_unreachable_slo_target_sets_slo_feasible_false_with_the_numbers() -> None:
    from dataclasses import replace

    from fulcrum.ratio.feasibility import SLOInfeasible

    tpot = SLOInfeasible("tpot", target_s=0.08, best_s=0.0902, at_isl=14000, at_osl=2000, tp=2, planned_for_s=0.0992)
    bad = replace(outcome(), numbers=replace(outcome().numbers, feasible=False, slo_infeasible=(tpot,)))
    st = build_status(previous=None, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s", now=T0,
                      outcome=bad)
    c = get_condition(st["conditions"], "SLOFeasible")
    assert c is not None and c["status"] == "False" and c["reason"] == "TPOTInfeasible"
    assert "TPOT target 80 ms" in c["message"] and "90.2 ms" in c["message"] and "ISL 14000" in c["message"]
    assert st["plan"]["sloInfeasible"] == [{"metric": "tpot", "targetSeconds": 0.08, "bestSeconds": 0.0902,
                                            "atIsl": 14000, "atOsl": 2000, "tp": 2, "plannedForSeconds": 0.0992}]
    ok = replace(outcome(), numbers=replace(outcome().numbers, slo_infeasible=()))
    st2 = build_status(previous=st, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s",
                       now=T0 + timedelta(minutes=1), outcome=ok)
    c2 = get_condition(st2["conditions"], "SLOFeasible")
    assert c2 is not None and (c2["status"], c2["reason"]) == ("True", "Feasible")
    assert c2["lastTransitionTime"] == "2026-05-01T12:01:00Z"
    assert st2["plan"]["sloInfeasible"] is None  # None: the merge patch deletes the stale list


def test_a_planner_that_does_not_judge_feasibility_leaves_no_slo_feasible_condition() -> None:
    st = build_status(previous=None, generation=1, target=TARGET, ready=ReadyCounts(4, 2, 0), selector="s", now=T0,
                      outcome=outcome())
    assert get_condition(st["conditions"], "SLOFeasible") is None
