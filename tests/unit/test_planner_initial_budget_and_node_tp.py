"""The reference planners and the operator's starting pools keep the limits the Fulcrum planner keeps: the initial
pools cut to ``spec.scaling.maxGPUs`` (as :meth:`FulcrumPlanner.initial` does since c450ccf), DOPD's plans within
maxGPUs, and Dynamo's TP within one node (``spec.gpu.gpusPerNode``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fulcrum.api import parse_llmserve
from fulcrum.controller.resources import initial_target
from fulcrum.errors import PlanningError
from fulcrum.observation import Observation
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.scaling.dopd import DopdPlanner
from fulcrum.scaling.dynamo_load import DynamoLoadPlanner
from fulcrum.scaling.dynamo_sla import DynamoSlaPlanner
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.static import StaticPlanner


def _serve(profile: dict[str, str] | None = None, mode: str = "Disaggregated", **scaling: Any):
    sc = {"minGPUs": 0, "maxGPUs": 8, "tpPrefill": 1, "tpDecode": 2, "tpUnified": 2, **scaling}
    return parse_llmserve({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "metadata": {"name": "x"},
                           "spec": {"model": {"name": "m"}, "mode": mode,
                                    "profile": profile or {"name": "dopd-llama70b-fp8-h100"}, "scaling": sc}})


@pytest.mark.parametrize("planner_cls", [StaticPlanner, DopdPlanner])
def test_static_and_dopd_cut_initial_pools_over_max_gpus_as_the_fulcrum_planner_does(planner_cls, table_i, caplog):
    spec = _serve(initialPrefill=6, initialDecode=6).spec  # 6 × TP1 + 6 × TP2 = 18 GPUs asked, maxGPUs 8
    fulcrum = FulcrumPlanner(spec, table_i)
    with caplog.at_level(logging.WARNING):
        planner = planner_cls(spec, table_i)
        t = planner.initial()
    want = fulcrum.initial()
    assert t.gpus <= 8
    assert (t.prefill, t.decode) == (want.prefill, want.decode)  # the same fit: 4 × TP1 + 2 × TP2
    assert planner.initial_note == fulcrum.initial_note
    assert "initial pools cut to maxGPUs" in planner.initial_note and "maxGPUs=8" in planner.initial_note
    assert any("initial pools cut to maxGPUs" in r.getMessage() for r in caplog.records)


def test_the_static_planner_keeps_its_cut_pools_and_says_so_each_interval(table_i):
    planner = StaticPlanner(_serve(initialPrefill=6, initialDecode=6).spec, table_i)
    cur = planner.initial()
    d = planner.step(Observation(time_s=60.0, interval_s=60.0, arrivals=0, mean_isl=0.0, mean_osl=0.0), cur)
    assert d.target == cur and d.target.gpus <= 8
    assert d.reason.startswith("static: counts from the spec") and "maxGPUs=8" in d.reason


def test_a_static_unified_pool_over_max_gpus_is_cut(splitwise):
    spec = _serve(mode="Unified", initialUnified=7, tpUnified=4, maxGPUs=16).spec
    planner = StaticPlanner(spec, splitwise)
    assert planner.initial().unified.replicas == 4 and planner.initial().gpus == 16
    assert "unified 7 → 4 (TP 4)" in planner.initial_note


@pytest.mark.parametrize("planner_cls", [StaticPlanner, DopdPlanner])
def test_initial_pools_within_max_gpus_are_the_specs_counts_without_a_note(planner_cls, table_i):
    planner = planner_cls(_serve(initialPrefill=2, initialDecode=3).spec, table_i)
    t = planner.initial()
    assert (t.prefill.replicas, t.decode.replicas) == (2, 3) and planner.initial_note is None


@pytest.mark.parametrize(("mode", "pools"), [("Disaggregated", {"initialPrefill": 6, "initialDecode": 6}),
                                             ("Unified", {"initialUnified": 9})])
def test_the_operators_start_without_a_profile_is_cut_to_max_gpus(mode, pools, caplog):
    serve = _serve(profile={"configMap": "cm"}, mode=mode, **pools)  # a ConfigMap the caller has not loaded
    with caplog.at_level(logging.WARNING):
        t = initial_target(serve)
    assert t.gpus <= 8
    assert any("initial pools cut to maxGPUs" in r.getMessage() for r in caplog.records)
    if mode == "Disaggregated":
        assert (t.prefill.replicas, t.prefill.tp, t.decode.replicas, t.decode.tp) == (4, 1, 2, 2)
    else:
        assert (t.unified.replicas, t.unified.tp) == (4, 2)


def test_the_operators_start_without_a_profile_within_max_gpus_is_unchanged():
    t = initial_target(_serve(profile={"configMap": "cm"}, initialPrefill=2, initialDecode=3))
    assert (t.prefill.replicas, t.decode.replicas, t.gpus) == (2, 3, 8)


def test_dopd_never_plans_more_than_max_gpus(splitwise):
    # long prompts, near-empty answers: R_opt ≈ 77, so n_p = 77·n_d; the proportional floor kept one TP8 decode
    # instance and five TP2 prefill instances, 18 GPUs against maxGPUs 12
    spec = parse_llmserve({"spec": {"model": {"name": "m"},
                                    "scaling": {"minGPUs": 0, "maxGPUs": 12, "tpPrefill": 2, "tpDecode": 8}}}).spec
    planner = DopdPlanner(spec, splitwise)
    cur = planner.initial()
    for k, (rate, isl, osl) in enumerate([(20, 6000, 5), (40, 8000, 2), (1, 1000, 200)]):
        n = rate * 60
        d = planner.step(Observation(time_s=60.0 * (k + 1), interval_s=60.0, arrivals=n, mean_isl=isl, mean_osl=osl,
                                     completed=n), cur)
        assert d.target.gpus <= 12, d.reason
        assert d.target.prefill.replicas >= 1 and d.target.decode.replicas >= 1
        cur = d.target


@pytest.mark.parametrize("planner_cls", [DynamoSlaPlanner, DynamoLoadPlanner])
def test_dynamo_planners_never_choose_a_tp_larger_than_one_node(planner_cls):
    # splitwise-llama2-70b-a100 measures TP 2, 4, 8; TP2 holds 76,931 tokens, TP4 575,004
    prof = builtin_profile("splitwise-llama2-70b-a100")

    def spec(gpus_per_node: int, max_model_len: int):
        return parse_llmserve({"spec": {"model": {"name": "m"}, "gpu": {"gpusPerNode": gpus_per_node},
                                        "engine": {"maxModelLen": max_model_len},
                                        "scaling": {"minGPUs": 0, "maxGPUs": 64}}}).spec

    with pytest.raises(PlanningError, match=r"TP ≤ 2 .*spec\.gpu\.gpusPerNode"):
        planner_cls(spec(2, 100_000), prof)  # only TP4 holds it: a TP4 pod cannot be scheduled on 2-GPU nodes
    with pytest.raises(PlanningError, match=r"no prefill TP ≤ 1 GPUs per node \(has \(2, 4, 8\)\)"):
        planner_cls(spec(1, 4096), prof)
    t = planner_cls(spec(4, 100_000), prof).initial()
    assert (t.prefill.tp, t.decode.tp) == (4, 4)  # within a node: unchanged
    t = planner_cls(spec(2, 8192), prof).initial()
    assert (t.prefill.tp, t.decode.tp) == (2, 2)


@pytest.mark.parametrize("planner", ["fulcrum", "static", "dopd", "dynamo-sla", "dynamo-load"])
def test_the_operator_starts_from_the_initial_pools_of_the_planner_the_spec_names(planner, splitwise):
    # the Planner contract: the operator and fulcrum replay both start from planner.initial(). The operator used the
    # fulcrum planner's start for every planner: TP4 decode here, where static, dopd and Dynamo's planners run TP2,
    # so the chosen planner's first interval replaced the whole decode pool
    from fulcrum.scaling.registry import make_planner

    serve = parse_llmserve({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "metadata": {"name": "x"},
                            "spec": {"model": {"name": "m"}, "mode": "Disaggregated", "slo": {"ttftMs": 2000, "tpotMs": 20},
                                     "profile": {"name": "splitwise-llama2-70b-h100"},
                                     "scaling": {"planner": planner, "initialPrefill": 2, "initialDecode": 2}}})
    assert initial_target(serve, splitwise) == make_planner(planner, serve.spec, splitwise).initial()
    assert initial_target(serve) == initial_target(serve, splitwise)  # the built-in profile the spec names


def test_a_static_unified_pool_never_takes_a_tp_larger_than_one_node(splitwise):
    # the profile measures TP 2, 4 and 8 only: on 1-GPU nodes no unified instance fits one pod (the fulcrum planner
    # refuses it too); the static planner fell back to TP2 though its docstring promised a PlanningError
    def spec(gpus_per_node: int):
        return parse_llmserve({"spec": {"model": {"name": "m"}, "mode": "Unified",
                                        "gpu": {"gpusPerNode": gpus_per_node}}}).spec

    with pytest.raises(PlanningError, match=r"no unified TP ≤ 1 GPUs per node \(has \(2, 4, 8\)\)"):
        StaticPlanner(spec(1), splitwise)
    assert StaticPlanner(spec(2), splitwise).initial().unified.tp == 2  # within a node: unchanged
