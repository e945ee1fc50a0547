"""TP choice against ``spec.engine.maxModelLen``: every planned TP's KV cache must hold one maxModelLen-token
sequence (V_mem/M_token of DOPD eq. 11), or vLLM refuses to start ("The model's max seq len (X) is larger than
the maximum number of tokens that can be stored in KV cache (Y)") and the pods crash-loop.

The shipped profiles hold (Llama-70B, 327,680 B of KV per token on 80 GiB GPUs):
dopd-llama70b-fp8-h100 prefill TP1 29,310 tokens, decode TP2 278,347; splitwise-llama2-70b-* TP2 76,931,
TP4 575,005, TP8 1,571,152.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.api import parse_llmserve
from fulcrum.errors import PlanningError
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import PlannerSettings, WorkloadEstimate, plan, plan_ratio
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.ratio.tp import check_fixed_tp, choose_decode_tp, choose_prefill_tp, fits_max_model_len
from fulcrum.scaling.dopd import DopdPlanner
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.static import StaticPlanner

WORKLOAD = WorkloadEstimate.from_means(8.0, 1100, 230)

REPO = Path(__file__).resolve().parents[2]


def _spec(profile: str, mode: str, max_model_len: int, *, gpus_per_node: int = 8, **scaling):
    return parse_llmserve({
        "model": {"name": "m"},
        "engine": {"maxModelLen": max_model_len},
        "gpu": {"gpusPerNode": gpus_per_node},
        "slo": {"ttftMs": 2000, "tpotMs": 100, "percentile": 90},
        "mode": mode,
        "scaling": {"minGPUs": 0, "maxGPUs": 64, **scaling},
        "profile": {"name": profile},
    }).spec


@pytest.fixture
def a100():
    return builtin_profile("splitwise-llama2-70b-a100")


def test_bundled_profiles_hold_the_shipped_max_model_len_at_their_smallest_tps(table_i, splitwise):
    assert table_i.kv_capacity_tokens(1) == pytest.approx(29310, abs=1)
    assert table_i.kv_capacity_tokens(2) == pytest.approx(278347, abs=1)
    assert splitwise.kv_capacity_tokens(2) == pytest.approx(76931, abs=1)
    assert splitwise.kv_capacity_tokens(4) == pytest.approx(575005, abs=1)


# ------------------------------------------------------------------------- the cheapest TP is too small
@pytest.mark.parametrize("mode", ["Disaggregated", "Unified"])
def test_plan_leaves_a_tp_that_cannot_hold_max_model_len(splitwise, mode):
    short = plan(WORKLOAD, splitwise, _spec("splitwise-llama2-70b-h100", mode, 4096))
    tps = (short.unified.tp,) if mode == "Unified" else (short.prefill.tp, short.decode.tp)
    assert set(tps) == {2}  # at 4096 tokens TP2 is the cheapest
    long = plan(WORKLOAD, splitwise, _spec("splitwise-llama2-70b-h100", mode, 100_000))  # TP2 holds 76,931
    tps = (long.unified.tp,) if mode == "Unified" else (long.prefill.tp, long.decode.tp)
    assert all(tp >= 4 and splitwise.kv_capacity_tokens(tp) >= 100_000 for tp in tps), tps


def test_choose_tp_functions_skip_tps_below_max_model_len(splitwise):
    isl = LengthDistribution.point(1100)
    assert choose_prefill_tp(splitwise, isl, 2.0, 0.9, max_model_len=4096) == 2
    assert choose_prefill_tp(splitwise, isl, 2.0, 0.9, max_model_len=100_000) == 4
    assert choose_decode_tp(splitwise, 1100, 230, 0.1, max_model_len=4096).tp == 2
    assert choose_decode_tp(splitwise, 1100, 230, 0.1, max_model_len=100_000).tp >= 4
    assert fits_max_model_len(splitwise, [2, 4, 8], 100_000, phase="decode", max_tp=8) == [4, 8]


def test_reference_planners_and_the_initial_pools_pick_a_tp_that_holds_max_model_len(splitwise, a100):
    dis = _spec("splitwise-llama2-70b-h100", "Disaggregated", 100_000)
    static = StaticPlanner(dis, splitwise).initial()
    assert static.prefill.tp == 4 and static.decode.tp >= 4
    dopd = DopdPlanner(dis, splitwise).initial()
    assert dopd.prefill.tp == 4 and dopd.decode.tp >= 4
    init = FulcrumPlanner(dis, splitwise).initial()
    assert init.prefill.tp >= 4 and init.decode.tp >= 4
    uni = _spec("splitwise-llama2-70b-a100", "Unified", 100_000)
    assert StaticPlanner(uni, a100).initial().unified.tp == 4
    assert FulcrumPlanner(uni, a100).initial().unified.tp >= 4


def test_plan_ratio_skips_tps_below_max_model_len(splitwise):
    r = plan_ratio(splitwise, 1100, 230, tpot_slo_s=0.1, settings=PlannerSettings(max_model_len=100_000))
    assert r.tp_prefill == 4 and r.tp_decode >= 4


# ------------------------------------------------------------------------- no TP fits
def test_no_prefill_tp_holds_max_model_len_names_the_numbers_and_the_fix(table_i):
    # TP1 (the only prefill TP) holds 29,310 tokens; decode TP2 holds 278,347, enough
    spec = _spec("dopd-llama70b-fp8-h100", "Disaggregated", 100_000)
    with pytest.raises(PlanningError) as err:
        plan(WORKLOAD, table_i, spec)
    msg = str(err.value)
    for part in ("maxModelLen 100,000 tokens", "30.5 GiB of KV cache", "largest prefill TP ≤ 8", "(TP 1)", "29,310 tokens",
                 "spec.engine.maxModelLen", "gpusPerNode"):
        assert part in msg, (part, msg)
    for planner in (StaticPlanner, DopdPlanner, FulcrumPlanner):
        with pytest.raises(PlanningError, match="29,310 tokens"):
            planner(spec, table_i).initial()


def test_no_decode_tp_holds_max_model_len(table_i):
    with pytest.raises(PlanningError) as err:  # TP2 (the only decode TP) holds 278,347 tokens
        choose_decode_tp(table_i, 1024, 256, 0.08, max_model_len=300_000)
    assert "largest decode TP ≤ 8" in str(err.value) and "TP 2" in str(err.value) and "278,347 tokens" in str(err.value)


@pytest.mark.parametrize("mode", ["Disaggregated", "Unified"])
def test_max_tp_bounds_the_search(splitwise, mode):
    spec = _spec("splitwise-llama2-70b-h100", mode, 100_000, gpus_per_node=2)  # TP4 would hold it
    with pytest.raises(PlanningError) as err:
        plan(WORKLOAD, splitwise, spec)
    msg = str(err.value)
    assert "≤ 2" in msg and "TP 2" in msg and "76,931 tokens" in msg and "maxModelLen 100,000 tokens" in msg


def test_auto_mode_plans_only_tps_that_hold_max_model_len(splitwise):
    p = plan(WORKLOAD, splitwise, _spec("splitwise-llama2-70b-h100", "Auto", 100_000))
    tps = (p.unified.tp,) if p.mode == "Unified" else (p.prefill.tp, p.decode.tp)
    assert all(tp >= 4 for tp in tps), (p.mode, tps)


# ------------------------------------------------------------------------- a fixed TP that does not fit
def test_fixed_prefill_tp_that_cannot_hold_max_model_len_raises_naming_the_field(table_i):
    spec = _spec("dopd-llama70b-fp8-h100", "Disaggregated", 50_000, tpPrefill=1, tpDecode=2)
    with pytest.raises(PlanningError) as err:
        plan(WORKLOAD, table_i, spec)
    msg = str(err.value)
    for part in ("spec.scaling.tpPrefill=1", "maxModelLen 50,000 tokens", "29,310 tokens", "15.3 GiB",
                 "spec.engine.maxModelLen to at most 29,310"):
        assert part in msg, (part, msg)
    for planner in (StaticPlanner, DopdPlanner, FulcrumPlanner):
        with pytest.raises(PlanningError, match=r"spec\.scaling\.tpPrefill=1"):
            planner(spec, table_i).initial()
    # the same spec at the shipped 8192 tokens plans as before
    assert plan(WORKLOAD, table_i, _spec("dopd-llama70b-fp8-h100", "Disaggregated", 8192, tpPrefill=1, tpDecode=2)).prefill.tp == 1


def test_fixed_decode_and_unified_tps_that_cannot_hold_max_model_len_raise_naming_the_field(table_i, splitwise, a100):
    with pytest.raises(PlanningError, match=r"spec\.scaling\.tpDecode=2 .*278,347 tokens"):
        choose_decode_tp(table_i, 1024, 256, 0.08, fixed=2, max_model_len=300_000)
    spec = _spec("splitwise-llama2-70b-h100", "Disaggregated", 100_000, tpDecode=2)
    with pytest.raises(PlanningError, match=r"spec\.scaling\.tpDecode=2 .*76,931 tokens.*TP 4 does"):
        plan(WORKLOAD, splitwise, spec)
    uni = _spec("splitwise-llama2-70b-a100", "Unified", 100_000, tpUnified=2)
    with pytest.raises(PlanningError, match=r"spec\.scaling\.tpUnified=2 .*76,931 tokens"):
        plan(WORKLOAD, a100, uni)
    with pytest.raises(PlanningError, match=r"spec\.scaling\.tpUnified=2"):
        StaticPlanner(uni, a100)
    with pytest.raises(PlanningError, match=r"spec\.scaling\.tpDecode=2"):
        plan_ratio(splitwise, 1100, 230, tp_decode=2, settings=PlannerSettings(max_model_len=100_000))


def test_check_fixed_tp_passes_a_tp_that_holds_max_model_len(table_i):
    check_fixed_tp(table_i, 1, 29_310, "spec.scaling.tpPrefill")
    with pytest.raises(PlanningError, match="none it measures for this role, TP 1, holds it"):
        check_fixed_tp(table_i, 1, 29_311, "spec.scaling.tpPrefill", table_i.prefill_tps)


@pytest.mark.parametrize("load", [["--concurrency", "64"], ["--rate", "5"]])
def test_fulcrum_plan_checks_the_specs_max_model_len_in_both_of_its_ways(
        tmp_path, capsys: pytest.CaptureFixture[str], load: list[str]) -> None:
    # the ratio-only way (no --rate) planned with the default 8192 tokens, not the spec's maxModelLen
    from fulcrum.cli import main

    src = (REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml").read_text()
    assert "maxModelLen: 8192" in src
    spec = tmp_path / "long.yaml"
    spec.write_text(src.replace("maxModelLen: 8192", "maxModelLen: 100000"))
    code = main(["plan", "--llmserve", str(spec), "--isl", "1100", "--osl", "230", *load])
    err = capsys.readouterr().err
    assert code == 2
    assert "maxModelLen 100,000 tokens" in err and "holds only 29,310 tokens" in err


def _profile_measuring(prefill_tps: list[int], decode_tps: list[int], name: str):
    """The Splitwise H100 profile with its TP-2 tables copied to the TPs given (KV: TP2 76,931, TP4 575,004, TP8
    1,571,151 tokens), so that only some roles have a TP holding a long maxModelLen."""
    import copy

    from fulcrum.ratio.profile import profile_from_dict

    d = builtin_profile("splitwise-llama2-70b-h100").to_dict()
    pre = next(e for e in d["prefill"] if e["tp"] == 2)
    dec = next(e for e in d["decode"] if e["tp"] == 2)
    d["prefill"] = [dict(copy.deepcopy(pre), tp=t) for t in prefill_tps]
    d["decode"] = [dict(copy.deepcopy(dec), tp=t) for t in decode_tps]
    d["name"] = name
    return profile_from_dict(d)


def test_static_best_in_auto_mode_leaves_out_a_unified_no_tp_can_plan_as_the_fulcrum_planner_does() -> None:
    # unified instances need a TP both roles measure: only TP2 here, which cannot hold 100,000 tokens; the
    # Fulcrum planner plans Auto as Disaggregated alone, and static-best raised after every policy had run
    from fulcrum.api import Mode
    from fulcrum.ratio.planner import plan_modes
    from fulcrum.replay.driver import ReplayOptions
    from fulcrum.replay.static_best import static_best
    from fulcrum.workload import Request

    p = _profile_measuring([2, 8], [2, 4], "p2-8-d2-4")
    spec = parse_llmserve({"apiVersion": "fulcrum.dev/v1alpha1", "kind": "LLMServe", "metadata": {"name": "a"},
                           "spec": {"model": {"name": "m"}, "mode": "Auto", "engine": {"maxModelLen": 100_000},
                                    "gpu": {"type": "H100", "gpusPerNode": 8},
                                    "scaling": {"minGPUs": 1, "maxGPUs": 16}}}).spec
    assert list(plan_modes(WORKLOAD, p, spec)) == [Mode.DISAGGREGATED.value]
    window = [Request(float(i), 800, 100) for i in range(60)]
    best = static_best(window, spec, p, 0.5, ReplayOptions(warmup_s=0.0))
    assert "U" not in best.label and best.label.endswith("D")
    with pytest.raises(PlanningError, match="unified"):
        static_best(window, spec.model_copy(update={"mode": Mode.UNIFIED}), p, 0.5, ReplayOptions(warmup_s=0.0))


def test_fulcrum_plan_takes_max_model_len_as_a_flag_and_names_its_flags_in_the_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    from fulcrum.cli import main

    base = ["plan", "--profile", "dopd-llama70b-fp8-h100", "--isl", "1100", "--osl", "230", "--concurrency", "64"]
    assert main([*base, "--json"]) == 0  # the default 8192 tokens: TP1 holds 29,310
    capsys.readouterr()
    assert main([*base, "--max-model-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert "maxModelLen 100,000 tokens" in err and "Lower --max-model-len to at most 29,310" in err
    assert "spec.engine.maxModelLen" not in err
    assert main([*base, "--max-model-len", "30000", "--tp-decode", "2", "--tp-prefill", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tp-prefill=1 cannot serve maxModelLen 30,000 tokens" in err and "spec.scaling" not in err
    assert main([*base, "--max-model-len", "0"]) == 2
    assert "--max-model-len must be a positive number of tokens, got 0" in capsys.readouterr().err


def test_an_unmeasured_fixed_decode_tp_is_named_as_unmeasured_not_as_too_small() -> None:
    from fulcrum.errors import FulcrumError

    splitwise = builtin_profile("splitwise-llama2-70b-h100")
    with pytest.raises(FulcrumError, match="no decode table for TP=1"):
        plan_ratio(splitwise, 1100, 230, tp_decode=1)
