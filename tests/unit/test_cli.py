"""The ``fulcrum`` command line end to end: ``plan``, ``forecast``, ``replay`` and their errors.

Commands run in-process through ``fulcrum.cli.main([...])`` with stdout/stderr captured; one test runs the
installed console script. Bad input must end with exit code 2 and one ``fulcrum CMD: error: ...`` line on
stderr naming the problem — never a traceback.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.cli import main
from fulcrum.replay.routing import ROUTING_POLICIES
from fulcrum.replay.report import (
    FORECAST_PNG,
    GPUS_PNG,
    LATENCY_CDF_PNG,
    POOLS_PNG,
    SUMMARY_JSON,
)

REPO = Path(__file__).resolve().parents[2]
DISAGG_SPEC = REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml"
UNIFIED_SPEC = REPO / "examples" / "llmserve-unified-70b-a100.yaml"
SERVEGEN = REPO.parent / "shared" / "data" / "servegen" / "servegen_m-large_aggregate_10min.csv"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# DOPD §VI-A3: 4.58 P per TP=2 D-instance at ISL/OSL 1000/150, cc_d = 235; why 5 %: tests/unit/test_ratio_planner.py
DOPD_RATIO, DOPD_TOLERANCE = 4.58, 0.05
DOPD_PLAN = ["plan", "--profile", "dopd-llama70b-fp8-h100", "--isl", "1000", "--osl", "150",
             "--tp-prefill", "1", "--tp-decode", "2"]
FORECASTERS = {"arima", "last_value", "moving_average", "seasonal_naive", "select"}
POLICY_NUMBERS = ("slo_attainment", "goodput_tokens_per_s", "gpu_hours")


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    """Run the CLI with ``argv``, check it succeeded quietly on stderr's error channel, parse stdout as JSON."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "error" not in err
    data: dict[str, Any] = json.loads(out)
    return data


def run_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI with bad ``argv``; check exit code 2, no stdout, one ``error:`` line; return that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fulcrum {argv[0]}: error: ")
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------- plan
def test_plan_json_reproduces_dopd_validation_ratio_for_1000_150_at_capacity_235(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, [*DOPD_PLAN, "--decode-concurrency", "235", "--json"])
    assert {"ratio", "prefill_replicas", "decode_replicas", "decode_concurrency", "inputs"} <= data.keys()
    assert data["ratio"] == pytest.approx(DOPD_RATIO, rel=DOPD_TOLERANCE)
    assert data["decode_concurrency"] == 235
    assert (data["tp_prefill"], data["tp_decode"]) == (1, 2)
    assert data["decode_replicas"] == 1
    assert data["prefill_replicas"] == math.ceil(data["ratio"] * data["decode_replicas"])
    assert data["gpus"] == data["prefill_replicas"] * 1 + data["decode_replicas"] * 2
    assert data["inputs"]["profile"] == "dopd-llama70b-fp8-h100"
    assert (data["inputs"]["isl"], data["inputs"]["osl"]) == (1000.0, 150.0)


def test_plan_prints_the_same_plan_as_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, [*DOPD_PLAN, "--decode-concurrency", "235", "--json"])
    assert main([*DOPD_PLAN, "--decode-concurrency", "235"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "profile dopd-llama70b-fp8-h100: ISL 1000 / OSL 150 tokens" in out
    assert f"P/D ratio          {data['ratio']:.3f}" in out
    assert f"prefill instances  {data['prefill_replicas']} × TP1" in out
    assert f"decode instances   {data['decode_replicas']} × TP2" in out


def test_plan_for_a_decode_concurrency_sizes_decode_by_capacity_and_prefill_by_the_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, [*DOPD_PLAN, "--concurrency", "500", "--json"])
    cc_d = data["decode_concurrency"]
    assert 0 < cc_d < 500
    assert data["decode_replicas"] == math.ceil(500 / cc_d)
    assert data["prefill_replicas"] == math.ceil(data["ratio"] * data["decode_replicas"] - 1e-9)
    assert data["ratio"] == pytest.approx(DOPD_RATIO, rel=0.10)  # cc_d from eqs. 11–14 instead of 235


def test_plan_for_a_request_rate_is_feasible_and_grows_with_the_rate(capsys: pytest.CaptureFixture[str]) -> None:
    low = run_json(capsys, [*DOPD_PLAN, "--rate", "5", "--json"])
    high = run_json(capsys, [*DOPD_PLAN, "--rate", "40", "--json"])
    for plan in (low, high):
        assert plan["feasible"] is True
        assert plan["prefill_replicas"] >= 1 and plan["decode_replicas"] >= 1
        assert plan["inputs"]["rate_rps"] in (5, 40)
    assert high["prefill_replicas"] > low["prefill_replicas"]
    assert high["decode_replicas"] >= low["decode_replicas"]
    # 40 req/s of 1,000-token prompts at t_p ≈ 0.17 s keep at least 40 · t_p prefill instances busy
    assert high["prefill_replicas"] >= 40 * high["t_p_s"]


def test_plan_for_a_request_rate_holds_the_gpu_budget_given(capsys: pytest.CaptureFixture[str]) -> None:
    free = run_json(capsys, [*DOPD_PLAN, "--rate", "20", "--json"])
    assert free["feasible"] is True and free["gpus"] > 4
    capped = run_json(capsys, [*DOPD_PLAN, "--rate", "20", "--max-gpus", "4", "--json"])
    assert capped["gpus"] <= 4 and capped["feasible"] is False
    assert f"GPU budget: {free['gpus']} GPUs needed, capped at maxGPUs=4" in capped["notes"]
    floor = run_json(capsys, [*DOPD_PLAN, "--rate", "1", "--min-gpus", "8", "--json"])
    assert floor["gpus"] >= 8 and floor["feasible"] is True
    assert main([*DOPD_PLAN, "--rate", "20", "--max-gpus", "4"]) == 0
    out = capsys.readouterr().out  # a prefill pool cut under its load: no "infs" in the note
    assert "TTFT unbounded, against the 2.000s SLO" in out and "infs" not in out


@pytest.mark.parametrize("extra, message", [
    (["--rate", "1", "--max-gpus", "0"], "--max-gpus must be >= 1"),
    (["--rate", "1", "--min-gpus", "-1"], "--min-gpus must be >= 0"),
    (["--rate", "1", "--min-gpus", "9", "--max-gpus", "4"], "minGPUs 9 exceeds maxGPUs 4"),
    (["--concurrency", "50", "--max-gpus", "8"], "bound the planner of --rate"),
    (["--concurrency", "50", "--mode", "Unified"], "--mode Unified plans for --rate"),
    (["--rate", "1", "--tp-unified", "2"], "--tp-unified pins the unified pool of --mode Unified or Auto"),
    (["--rate", "1", "--mode", "Unified"], "--tp-prefill and --tp-decode pin P and D pools"),
])
def test_plan_refuses_a_budget_mode_or_tp_it_cannot_apply(capsys: pytest.CaptureFixture[str], extra: list[str],
                                                    message: str) -> None:
    assert message in run_error(capsys, [*DOPD_PLAN, *extra])


SPLITWISE_PLAN = ["plan", "--profile", "splitwise-llama2-70b-h100", "--isl", "1028", "--osl", "229", "--tpot-ms", "100"]


def test_plan_in_unified_mode_plans_one_pool_of_kv_both_instances(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, [*SPLITWISE_PLAN, "--rate", "8", "--mode", "Unified", "--json"])
    assert data["mode"] == "Unified" and data["ratio"] is None
    assert (data["prefill_replicas"], data["decode_replicas"]) == (0, 0) and data["unified_replicas"] >= 1
    assert data["gpus"] == data["unified_replicas"] * data["tp_unified"]
    # the continuous need, rounded up: the count is the least that covers it
    assert data["unified_replicas"] - 1 < data["inputs"]["unified_need"] <= data["unified_replicas"]
    pinned = run_json(capsys, [*SPLITWISE_PLAN, "--rate", "8", "--mode", "Unified", "--tp-unified", "4", "--json"])
    assert pinned["tp_unified"] == 4
    assert main([*SPLITWISE_PLAN, "--rate", "8", "--mode", "Unified"]) == 0
    out = capsys.readouterr().out
    assert f"unified instances  {data['unified_replicas']} × TP{data['tp_unified']}" in out
    assert "P/D ratio" not in out


def test_plan_in_auto_mode_prints_both_plans_and_picks_as_an_llmserve_does(capsys: pytest.CaptureFixture[str]) -> None:
    for rate in ("2", "8"):
        data = run_json(capsys, [*SPLITWISE_PLAN, "--rate", rate, "--mode", "Auto", "--json"])
        plans = data["plans"]
        assert set(plans) == {"Disaggregated", "Unified"}
        for mode in plans:  # each is the plan of that mode alone
            alone = run_json(capsys, [*SPLITWISE_PLAN, "--rate", rate, "--mode", mode, "--json"])
            assert alone["gpus"] == plans[mode]["gpus"] and alone["mode"] == mode
        best = min(plans.values(), key=lambda x: (not x["feasible"], x["gpus"], x["mode"] != "Disaggregated"))
        assert data["mode"] == best["mode"] and data["gpus"] == best["gpus"]
    assert main([*SPLITWISE_PLAN, "--rate", "8", "--mode", "Auto"]) == 0
    out = capsys.readouterr().out
    d, u = plans["Disaggregated"]["gpus"], plans["Unified"]["gpus"]
    assert f"Auto: Disaggregated {d} GPUs, Unified {u} GPUs → {data['mode']}" in out


def test_plan_in_auto_mode_plans_disaggregated_alone_where_the_profile_has_no_unified_tp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DOPD's profile measures prefill at TP1 and decode at TP2 only: no TP can run both duties
    data = run_json(capsys, [*DOPD_PLAN[:7], "--rate", "5", "--mode", "Auto", "--json"])
    assert data["mode"] == "Disaggregated" and set(data["plans"]) == {"Disaggregated"}
    assert "Unified mode needs one" in data["unified_skipped"]
    assert "Unified mode needs one" in run_error(capsys, [*DOPD_PLAN[:7], "--rate", "5", "--mode", "Unified"])


def test_plan_for_an_llmserve_takes_its_profile_slos_mode_and_budget_and_flags_win(
    capsys: pytest.CaptureFixture[str],
) -> None:
    auto = str(REPO / "examples" / "llmserve-auto.yaml")  # Splitwise H100, TPOT 100 ms, Auto, 4–64 GPUs
    load = ["--isl", "1028", "--osl", "229", "--rate", "8.32"]
    data = run_json(capsys, ["plan", "--llmserve", auto, *load, "--json"])
    assert data["inputs"]["profile"] == "splitwise-llama2-70b-h100"
    assert set(data["plans"]) == {"Disaggregated", "Unified"}  # the spec's Auto mode
    assert data == run_json(capsys, [*SPLITWISE_PLAN, "--rate", "8.32", "--mode", "Auto", "--min-gpus", "4",
                                     "--max-gpus", "64", "--json"])  # the same plan from flags alone
    unified = run_json(capsys, ["plan", "--llmserve", auto, *load, "--mode", "Unified", "--max-gpus", "6", "--json"])
    assert unified["mode"] == "Unified" and unified["gpus"] <= 6 and "plans" not in unified
    strict = run_json(capsys, ["plan", "--llmserve", auto, *load, "--tpot-ms", "60", "--json"])
    assert strict["plans"]["Unified"]["gpus"] > data["plans"]["Unified"]["gpus"]  # a tighter TPOT than the file's
    assert main(["plan", "--llmserve", auto, *load]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LLMServe llama2-70b-auto: mode Auto, TTFT 2000 ms and TPOT 100 ms at P90, GPUs 4–64\n")


def test_plan_needs_a_profile_from_a_flag_or_an_llmserve(
    capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]
) -> None:
    load = ["--isl", "1000", "--osl", "150", "--rate", "1"]
    assert "--profile is required" in run_error(capsys, ["plan", *load])
    line = run_error(capsys, ["plan", "--llmserve", str(bad_files["config_map"]), *load])
    assert "ConfigMap 'llama-70b-profile'" in line and "--profile" in line
    data = run_json(capsys, ["plan", "--llmserve", str(bad_files["config_map"]), "--profile",
                             "dopd-llama70b-fp8-h100", *load, "--json"])
    assert data["inputs"]["profile"] == "dopd-llama70b-fp8-h100"
    assert "invalid LLMServe" in run_error(capsys, ["plan", "--llmserve", str(bad_files["negative_ttft"]), *load])


def test_plan_says_when_a_tpot_target_cannot_be_met_at_these_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "dopd-llama70b-fp8-h100", "--isl", "12000", "--osl", "1000", "--rate", "0.5"]
    data = run_json(capsys, [*argv, "--json"])
    assert data["feasible"] is False
    [f] = data["slo_infeasible"]
    assert f["metric"] == "tpot" and f["target_s"] == pytest.approx(0.08) and f["best_s"] > 0.08
    assert (f["at_isl"], f["at_osl"], f["tp"]) == (12000, 1000, 2) and f["planned_for_s"] > f["best_s"]
    assert data["decode_concurrency"] > 1 and data["gpus"] < 20
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: SLO infeasible: TPOT target 80 ms cannot be met: best 80.2 ms at batch 1" in out
    assert run_json(capsys, [*DOPD_PLAN, "--rate", "5", "--json"])["slo_infeasible"] == []


# ---------------------------------------------------------------------------------------------- forecast
def test_forecast_json_scores_every_forecaster_on_every_series_of_a_request_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, ["forecast", "--trace", "azure-code-2023", "--interval", "60", "--json"])
    assert data["trace"] == "azure-code-2023"
    assert set(data["series"]) == {"rate", "isl", "osl"}
    for series, scores in data["series"].items():
        assert set(scores) == FORECASTERS, series
        for name, score in scores.items():
            assert isinstance(score["mape"], float) and 0.0 <= score["mape"] < math.inf, (series, name)


def test_forecast_json_on_a_servegen_rate_file_scores_only_the_rate(capsys: pytest.CaptureFixture[str]) -> None:
    if not SERVEGEN.is_file():
        pytest.skip(f"ServeGen aggregate series not found at {SERVEGEN}")
    # hourly means of the 2,016 ten-minute windows (336 points: the 10-minute series takes ~10x longer to backtest)
    data = run_json(capsys, ["forecast", "--trace", str(SERVEGEN), "--interval", "3600", "--window", "32", "--json"])
    assert data["interval_s"] == 3600.0
    assert set(data["series"]) == {"rate"}
    rate = data["series"]["rate"]
    assert set(rate) == FORECASTERS
    assert all(isinstance(s["mape"], float) and 0.0 <= s["mape"] < 1.0 for s in rate.values())
    assert {s["points"] for s in rate.values()} == {2016 // 6 - 8}  # every point after the 8 warm-up intervals


def test_forecast_draws_a_synthetic_trace_at_the_seed_given_and_rejects_a_seed_elsewhere(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["forecast", "--trace", "synthetic-burst-steady", "--interval", "300", "--json"]
    default, seeded = run_json(capsys, argv), run_json(capsys, [*argv, "--seed", "1"])
    assert default["series"]["rate"]["last_value"]["mape"] != seeded["series"]["rate"]["last_value"]["mape"]
    line = run_error(capsys, ["forecast", "--trace", "azure-code-2023", "--interval", "60", "--seed", "1"])
    assert "seed applies only to a synthetic trace" in line


# ---------------------------------------------------------------------------------------------- replay
REPLAY = ["replay", "--trace", "azure-conv-2023", "--llmserve", str(DISAGG_SPEC), "--duration", "600"]


def check_policies(data: dict[str, Any], names: set[str]) -> None:
    assert set(data["policies"]) == names
    for name, entry in data["policies"].items():
        for key in POLICY_NUMBERS:
            value = entry[key]
            assert isinstance(value, float) and math.isfinite(value), (name, key)
        assert 0.0 <= entry["slo_attainment"] <= 1.0
        assert entry["gpu_hours"] > 0 and entry["requests"] > 0


def test_replay_json_for_one_policy_scores_it_on_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, [*REPLAY, "--policy", "fulcrum", "--json"])
    check_policies(data, {"fulcrum"})
    assert data["trace"] == "azure-conv-2023"
    assert data["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 80.0, "percentile": 90.0}
    assert (data["profile"], data["mode"], data["warmup_s"]) == ("dopd-llama70b-fp8-h100", "Disaggregated", 300.0)


def test_replay_says_how_many_prompts_the_models_context_cannot_hold(capsys: pytest.CaptureFixture[str]) -> None:
    # the unified example serves Llama-2-70B (maxModelLen 4,096): the router rejects longer prompts, and so does
    # the simulated one; the replay says how many, in text and in --json
    argv = ["replay", "--trace", "azure-conv-2023", "--duration", "300", "--llmserve",
            str(REPO / "examples" / "llmserve-unified-70b-a100.yaml"), "--policy", "static"]
    data = run_json(capsys, [*argv, "--json"])
    assert data["rejected_requests"] > 0
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{data['rejected_requests']} of " in out and "(maxModelLen 4096 tokens): rejected at admission" in out


def test_replay_compare_json_scores_every_policy_and_writes_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from fulcrum.replay.pareto import Score, dominates
    from fulcrum.scaling.registry import PLANNERS

    report = tmp_path / "report"
    data = run_json(capsys, [*REPLAY, "--compare", "--json", "--report", str(report)])
    check_policies(data, set(PLANNERS) | {"static-best"})
    best = data["static_best"]
    assert best["target_attainment"] == data["policies"]["fulcrum"]["slo_attainment"]
    assert best["reached"] == (data["policies"]["static-best"]["slo_attainment"] >= best["target_attainment"])
    assert best["deployment"].endswith("D") and best["probes"]
    pol = data["policies"]
    mine = Score(pol["fulcrum"]["slo_attainment"], pol["fulcrum"]["gpu_hours"])
    winners = [n for n, p in pol.items() if dominates(Score(p["slo_attainment"], p["gpu_hours"]), mine)]
    assert data["pareto"] == {"policy": "fulcrum", "dominated": bool(winners), "dominated_by": winners}
    for png in (GPUS_PNG, FORECAST_PNG, LATENCY_CDF_PNG, POOLS_PNG):
        assert (report / png).read_bytes()[:8] == PNG_SIGNATURE, png
    written = json.loads((report / SUMMARY_JSON).read_text())
    assert written["policies"].keys() == data["policies"].keys()
    assert written["policies"]["fulcrum"]["slo_attainment"] == data["policies"]["fulcrum"]["slo_attainment"]


def test_replay_compare_says_under_the_table_whether_fulcrum_is_dominated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*REPLAY, "--compare", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table_end = max(i for i, x in enumerate(lines) if x.startswith("static-best "))
    verdict = next(x for x in lines[table_end + 1:] if x)
    assert verdict.startswith("Pareto: fulcrum (") and ("is not dominated" in verdict or "is dominated by" in verdict)


def test_replay_prints_a_header_and_the_comparison_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*REPLAY, "--policy", "static", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "error" not in err
    assert out.startswith("trace azure-conv-2023: ")
    assert "Replay of trace 'azure-conv-2023': SLO TTFT 2000 ms and TPOT 80 ms at P90" in out
    assert any(line.startswith("static ") for line in out.splitlines())


def test_replay_runs_the_specs_decode_rescheduling(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = yaml.safe_load(DISAGG_SPEC.read_text())
    doc["spec"]["router"].update(rescheduling=True, roleReassignment=True)
    doc["spec"]["scaling"].update(initialPrefill=2, initialDecode=3)
    path = tmp_path / "llmserve.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = ["replay", "--trace", "azure-conv-2023", "--llmserve", str(path), "--duration", "600", "--policy", "static",
            "--json"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    run = json.loads(out)["policies"]["static"]
    assert run["migrations"] > 0  # ARES moved decodes between the 3 instances
    assert run["role_changes"] == 0  # no unified pool: the router's role reassignment has no `both` instance
    plain = run_json(capsys, [*REPLAY, "--policy", "static", "--json"])
    assert plain["policies"]["static"]["migrations"] == 0


def test_replay_runs_the_specs_role_reassignment_of_unified_instances(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    doc = yaml.safe_load(UNIFIED_SPEC.read_text())
    doc["spec"]["scaling"].update(initialUnified=4)
    plain_path, rr_path = tmp_path / "plain.yaml", tmp_path / "roles.yaml"
    plain_path.write_text(yaml.safe_dump(doc))
    doc["spec"]["router"]["roleReassignment"] = True
    rr_path.write_text(yaml.safe_dump(doc))
    argv = ["--trace", "azure-conv-2023", "--duration", "600", "--policy", "static", "--json"]
    roles = run_json(capsys, ["replay", "--llmserve", str(rr_path), *argv])["policies"]["static"]
    plain = run_json(capsys, ["replay", "--llmserve", str(plain_path), *argv])["policies"]["static"]
    assert roles["role_changes"] > 0 and roles["migrations"] == 0
    assert plain["role_changes"] == 0
    assert roles["slo_attainment"] != plain["slo_attainment"]  # the duties changed where requests ran
    assert main(["replay", "--llmserve", str(rr_path), *argv[:-1], "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  static "))
    assert line.endswith(f"; {roles['role_changes']} role changes)")  # the human summary says what moved


def test_replay_compares_routing_policies_under_one_planner(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, [*REPLAY, "--policy", "static", "--routing", "disaggregated,split,load_aware", "--json"])
    check_policies(data, {"disaggregated", "split", "load_aware"})
    assert data["planner"] == "static"
    assert set(data["paths"]["disaggregated"]) <= {"disaggregated", "local"}
    assert main([*REPLAY, "--policy", "static", "--routing", "round_robin,least_loaded", "--no-progress"]) == 0
    out, _ = capsys.readouterr()
    assert "planner static; routing policies compared: round_robin, least_loaded" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("round_robin ", "least_loaded "))]
    assert rows == ["round_robin", "least_loaded"]  # the table: a row per routing policy
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*REPLAY, "--routing", "libra"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # one line naming the known policies
    assert err.endswith("--routing: unknown routing policy 'libra'; choose from " + ", ".join(ROUTING_POLICIES))


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def bad_files(tmp_path: Path) -> dict[str, Path]:
    """Broken inputs: an empty trace, a trace with a malformed row, an invalid LLMServe, a non-monotone profile,
    an LLMServe whose profile is a ConfigMap and one naming an unknown built-in profile."""
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    files = {
        "empty": tmp_path / "empty.csv",
        "malformed": tmp_path / "malformed.csv",
        "negative_ttft": tmp_path / "negative-ttft.yaml",
        "non_monotone": tmp_path / "non-monotone.yaml",
        "config_map": tmp_path / "config-map.yaml",
        "unknown_builtin": tmp_path / "unknown-builtin.yaml",
    }
    files["empty"].write_text(header)
    files["malformed"].write_text(header + "2023-11-16 18:15:46.68,1020,129\n2023-11-16 18:15:47.01,many,129\n")
    spec = yaml.safe_load(DISAGG_SPEC.read_text())
    spec["spec"]["slo"]["ttftMs"] = -5
    files["negative_ttft"].write_text(yaml.safe_dump(spec))
    spec["spec"]["slo"]["ttftMs"] = 2000
    spec["spec"]["profile"] = {"configMap": "llama-70b-profile"}
    files["config_map"].write_text(yaml.safe_dump(spec))
    spec["spec"]["profile"] = {"name": "no-such-profile"}
    files["unknown_builtin"].write_text(yaml.safe_dump(spec))
    table_i = yaml.safe_load((resources.files("fulcrum.ratio.profiles") / "dopd-llama70b-fp8-h100.yaml").read_text())
    table_i["prefill"][0]["ttftMs"] = [36, 46, 25, 193, 269]  # 700 tokens faster than 200
    files["non_monotone"].write_text(yaml.safe_dump(table_i))
    return files


def test_a_missing_trace_file_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = run_error(capsys, ["replay", "--trace", str(tmp_path / "absent.csv")])
    assert "no such trace file" in line and "absent.csv" in line


def test_a_seed_for_a_trace_that_is_not_synthetic_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--seed", "3"])
    assert "azure-conv-2023" in line and "seed applies only to a synthetic trace" in line


def test_replay_draws_a_synthetic_trace_at_the_seed_given(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", "synthetic-burst-steady", "--duration", "300", "--policy", "static", "--json"]
    default, seeded, again = (run_json(capsys, argv + extra) for extra in ([], ["--seed", "1"], ["--seed", "1"]))
    assert default["seed"] is None and seeded["seed"] == 1

    def score(out: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(out["policies"]["static"][k] for k in ("requests", "slo_attainment", "gpu_hours"))

    assert score(seeded) == score(again)  # a seed is a draw, the same every time
    assert score(seeded)[0] != score(default)[0]


def test_an_empty_trace_is_a_one_line_error(capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]) -> None:
    line = run_error(capsys, ["replay", "--trace", str(bad_files["empty"])])
    assert "empty.csv" in line and "no requests" in line


def test_a_malformed_trace_row_is_named_by_file_line_and_column(
    capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]
) -> None:
    line = run_error(capsys, ["replay", "--trace", str(bad_files["malformed"])])
    assert "malformed.csv:3" in line and "ContextTokens" in line and "many" in line


def test_an_invalid_llmserve_names_the_offending_field(
    capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]
) -> None:
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--llmserve", str(bad_files["negative_ttft"])])
    assert "spec.slo.ttftMs" in line


def test_a_profile_with_non_monotone_latencies_is_rejected(
    capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]
) -> None:
    path = str(bad_files["non_monotone"])
    line = run_error(capsys, ["plan", "--profile", path, "--isl", "1000", "--osl", "150", "--rate", "5"])
    assert "non-monotone.yaml" in line and "prefill" in line and "decrease" in line
    line = run_error(capsys, [*REPLAY, "--profile", path])
    assert "non-monotone.yaml" in line and "decrease" in line


def test_an_unknown_builtin_profile_is_named(capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]) -> None:
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--llmserve", str(bad_files["unknown_builtin"])])
    assert "unknown built-in profile 'no-such-profile'" in line and "dopd-llama70b-fp8-h100" in line
    line = run_error(capsys, ["plan", "--profile", "no-such-profile", "--isl", "1000", "--osl", "150", "--rate", "5"])
    assert "no-such-profile" in line


def test_a_zero_forecast_interval_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, ["forecast", "--trace", "azure-code-2023", "--interval", "0"])
    assert "--interval" in line


@pytest.mark.parametrize(("flags", "expected"), [
    (["--window", "1"], "--window: Input should be greater than or equal to 4, got 1"),
    (["--season", "0"], "--season: Input should be greater than or equal to 2, got 0"),  # not the default
    (["--interval", "1200"], "3 intervals of 1200 s, and the first 8 are the warm-up (--warmup): no forecast is scored"),
    (["--warmup", "100"], "59 intervals of 60 s, and the first 100 are the warm-up"),
])
def test_forecast_flags_out_of_range_are_one_line_errors_naming_the_flag(
        capsys: pytest.CaptureFixture[str], flags: list[str], expected: str) -> None:
    line = run_error(capsys, ["forecast", "--trace", "azure-conv-2023", "--interval", "60", *flags])
    assert expected in line


def test_a_negative_time_scale_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, [*REPLAY, "--time-scale", "-1"])
    assert line.endswith("error: --time-scale must be a finite positive number, got -1")


def test_a_window_that_ends_inside_the_warm_up_is_rejected_before_the_replay(
        capsys: pytest.CaptureFixture[str]) -> None:
    # the 70B spec's warm-up is 300 s (a 180-s start-up + 2 intervals): a 120-s window would score nothing
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--llmserve", str(DISAGG_SPEC),
                              "--duration", "120"])
    assert "no request is scored" in line and "t = 300 s" in line and "--warmup 0" in line
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--llmserve", str(DISAGG_SPEC),
                              "--duration", "600", "--warmup", "900"])
    assert "no request is scored" in line and "t = 900 s" in line


def test_a_report_path_that_is_a_file_is_rejected_before_the_replay(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    line = run_error(capsys, [*REPLAY, "--report", str(taken)])
    assert f"--report {taken}: exists and is not a folder" in line
    assert taken.read_text() == "not a folder"


def test_a_configmap_profile_needs_a_profile_flag_to_replay(
    capsys: pytest.CaptureFixture[str], bad_files: dict[str, Path]
) -> None:
    argv = ["replay", "--trace", "azure-conv-2023", "--llmserve", str(bad_files["config_map"]), "--duration", "300",
            "--warmup", "0"]
    line = run_error(capsys, argv)
    assert "ConfigMap 'llama-70b-profile'" in line and "--profile" in line
    data = run_json(capsys, [*argv, "--profile", "dopd-llama70b-fp8-h100", "--policy", "static", "--json"])
    assert data["profile"] == "dopd-llama70b-fp8-h100"


@pytest.mark.parametrize(("flags", "expected"), [
    (["--warmup", "nan"], "--warmup must be a finite number of seconds >= 0, got nan"),  # was: exit 0, "nan%"
    (["--warmup", "-5"], "--warmup must be a finite number of seconds >= 0, got -5"),  # was: silently 0
    (["--warmup", "inf"], "--warmup must be a finite number of seconds >= 0, got inf"),
    (["--start", "-1"], "--start must be a finite number of seconds >= 0, got -1"),  # was: "start_s must ..."
    (["--start", "nan"], "--start must be a finite number of seconds >= 0, got nan"),
    (["--duration", "0"], "--duration must be a positive number of seconds, got 0"),  # was: "duration_s must ..."
    (["--duration", "nan"], "--duration must be a positive number of seconds, got nan"),
    (["--time-scale", "nan"], "--time-scale must be a finite positive number, got nan"),  # was: "time scale"
])
def test_replay_window_and_warmup_flags_out_of_range_are_one_line_errors_naming_the_flag(
        capsys: pytest.CaptureFixture[str], flags: list[str], expected: str) -> None:
    line = run_error(capsys, [*REPLAY, *flags])
    assert line == f"fulcrum replay: error: {expected}"


def test_a_window_past_the_end_of_a_bundled_trace_names_the_trace_not_its_file(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--start", "100000"])
    assert line.startswith("fulcrum replay: error: azure-conv-2023: no request in the window [100000, inf) s")
    assert ".csv" not in line


def test_compare_with_several_routing_names_is_an_error_not_a_dropped_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, [*REPLAY, "--compare", "--routing", "split,load_aware"])
    assert line.startswith("fulcrum replay: error: --compare and several --routing names do not combine: ")
    assert "--routing split,load_aware" in line
    # one routing name still goes with --compare: every planner under that routing policy
    data = run_json(capsys, ["replay", "--trace", "azure-conv-2023", "--duration", "300", "--warmup", "0",
                             "--compare", "--routing", "split", "--json"])
    assert data["routing"] == "split" and "static-best" in data["policies"]


ON_LINUX_PROC = Path("/proc/self").is_dir()  # nothing can be created in /proc, not even by root


def _unwritable_outputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    folder = tmp_path / "existing_dir.csv"
    folder.mkdir()
    a_file = tmp_path / "plain-file"
    a_file.write_text("x")
    cases = [
        (["--records", str(folder)], f"--records {folder}: is a folder, not a file"),
        (["--records", str(a_file / "r.csv")], f"--records {a_file / 'r.csv'}: {a_file} is not a folder"),
        (["--report", str(a_file / "rep")], f"--report {a_file / 'rep'}: {a_file} is not a folder"),
    ]
    if ON_LINUX_PROC:
        cases += [(["--records", "/proc/fulcrum-x.csv"], "--records /proc/fulcrum-x.csv: cannot write there ("),
                  (["--report", "/proc/fulcrum-rep"], "--report /proc/fulcrum-rep: cannot create the folder (")]
    return cases


def test_records_and_report_targets_that_cannot_be_written_fail_before_the_replay(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # run_error checks stdout is empty: the replay's header (printed before the first policy runs) never came
    for flags, expected in _unwritable_outputs(tmp_path):
        line = run_error(capsys, [*REPLAY, "--policy", "static", *flags])
        assert line.startswith(f"fulcrum replay: error: {expected}"), (flags, line)


def test_profile_out_that_cannot_be_written_fails_before_measuring(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the endpoint does not exist: an error about it would mean measuring had started
    base = ["profile", "--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1", "--gpu", "H100",
            "--weight-gib", "10"]
    (tmp_path / "taken.yaml").mkdir()
    cases = [
        (tmp_path / "taken.yaml", "is a folder, not a file"),
        (tmp_path / "no-such-dir" / "p.yaml", f"no such folder {tmp_path / 'no-such-dir'}"),
    ]
    if ON_LINUX_PROC:
        cases.append((Path("/proc/fulcrum-p.yaml"), "cannot write there ("))
    for out, expected in cases:
        line = run_error(capsys, [*base, "--out", str(out)])
        assert line.startswith(f"fulcrum profile: error: --out {out}: {expected}"), line
    line = run_error(capsys, [*base, "--out", "-", "--configmap", "cm", "--configmap-out", str(tmp_path / "taken.yaml")])
    assert line.startswith(f"fulcrum profile: error: --configmap-out {tmp_path / 'taken.yaml'}: is a folder")


@pytest.mark.parametrize(("argv", "expected"), [
    (["router", "--config", "router.yaml", "--port", "99999"], "--port must be in 0..65535, got 99999"),
    (["router", "--config", "router.yaml", "--port", "-1"], "--port must be in 0..65535, got -1"),
    (["operator", "--metrics-port", "70000"], "--metrics-port must be in 0..65535, got 70000"),
    (["operator", "--liveness-port", "-1"], "--liveness-port must be in 0..65535, got -1"),
    (["operator", "--drain-poll-seconds", "nan"], "--drain-poll-seconds must be a finite number of seconds > 0, got nan"),
    (["sim-worker", "--profile", "dopd-llama70b-fp8-h100", "--port", "99999"], "--port must be in 0..65535, got 99999"),
    (["sim-worker", "--profile", "dopd-llama70b-fp8-h100", "--drain-timeout-s", "nan"],
     "--drain-timeout-s must be a finite number of seconds >= 0, got nan"),
    (["worker", "--model", "m", "--health-port", "70000"], "--health-port must be in 0..65535, got 70000"),
    (["worker", "--model", "m", "--drain-timeout-s", "nan"],
     "--drain-timeout-s must be a finite number of seconds >= 0, got nan"),
    (["worker", "--model", "m", "--kill-grace-s", "nan"], "--kill-grace-s must be a finite number of seconds >= 0, got nan"),
    (["worker", "--model", "m", "--startup-timeout-s", "0"], "--startup-timeout-s must be a finite number of seconds > 0, got 0"),
    (["worker", "--model", "m", "--port", "99999"], "worker config: --port must be in 1..65535, not 99999"),
    (["profile", "--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1", "--request-timeout-s", "inf"],
     "--request-timeout-s must be a finite number of seconds, got inf"),
])
def test_server_ports_and_timeouts_out_of_range_are_one_line_errors_naming_the_flag(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        argv: list[str], expected: str) -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("kopf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "router.yaml").write_text("policy: round_robin\n")
    line = run_error(capsys, argv)
    assert line.startswith(f"fulcrum {argv[0]}: error: {expected}"), line


BAD_YAML = "a: [1, 2\nb: : x\n"  # line 2, column 2: the ':' a flow sequence cannot hold
YAML_PROBLEM = "2:2: not valid YAML: while parsing a flow sequence, expected ',' or ']', but got ':'"


def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    load = ["--isl", "1000", "--osl", "150", "--rate", "5"]
    for argv in (["plan", "--llmserve", str(bad), *load], ["replay", "--trace", "azure-conv-2023", "--llmserve", str(bad)],
                 ["plan", "--profile", str(bad), *load], ["replay", "--trace", "azure-conv-2023", "--profile", str(bad)]):
        assert run_error(capsys, argv) == f"fulcrum {argv[0]}: error: {bad}:{YAML_PROBLEM}"
    pytest.importorskip("aiohttp")
    line = run_error(capsys, ["router", "--config", str(bad)])
    assert line == f"fulcrum router: error: router config {bad}:2:2 is not valid YAML: while parsing a flow sequence, expected ',' or ']', but got ':'"
    pytest.importorskip("kopf")
    monkeypatch.setenv("KUBECONFIG", "unset")  # the operator exports --kubeconfig; the test's environment comes back
    line = run_error(capsys, ["operator", "--kubeconfig", str(bad)])
    assert line == f"fulcrum operator: error: no Kubernetes credentials: {bad}:{YAML_PROBLEM}"
    dated = tmp_path / "dated.yaml"  # a timestamp PyYAML cannot build: a bare ValueError, no mark
    dated.write_text("apiVersion: v1\nkind: Config\ncreated: 2024-13-45\n")
    line = run_error(capsys, ["operator", "--kubeconfig", str(dated)])
    assert line == f"fulcrum operator: error: no Kubernetes credentials: {dated}: not valid YAML: month must be in 1..12"
    # a ValueError that is no YAML problem (certificate data that is not base64) is not called one
    b64 = tmp_path / "b64.yaml"
    b64.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
                   "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443', "
                   "certificate-authority-data: 'not*base64'}}]\nusers: [{name: u, user: {token: t}}]\n")
    line = run_error(capsys, ["operator", "--kubeconfig", str(b64)])
    assert line.startswith("fulcrum operator: error: no Kubernetes credentials: ") and "YAML" not in line, line


def test_a_folder_given_as_a_trace_or_a_profile_is_named_as_a_folder(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "somedir"
    folder.mkdir()
    line = run_error(capsys, ["replay", "--trace", str(folder)])
    assert line == f"fulcrum replay: error: {folder} is a directory, not a trace file"
    line = run_error(capsys, ["replay", "--trace", "azure-conv-2023", "--profile", str(folder)])
    assert line == f"fulcrum replay: error: {folder} is a directory, not a profile file"
    line = run_error(capsys, ["plan", "--profile", str(folder), "--isl", "1000", "--osl", "150", "--rate", "5"])
    assert line == f"fulcrum plan: error: {folder} is a directory, not a profile file"


@pytest.mark.parametrize("data", [
    pytest.param(b"\x1f\x8bnot gzip after the magic bytes", id="not-gzip"),
    pytest.param(gzip.compress(b"window_start_s,total_rate_rps\n0,1\n" * 100)[:12], id="truncated-in-the-header"),
])
def test_forecast_on_a_broken_gzip_names_the_file_not_a_traceback(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "rates.csv.gz"
    path.write_bytes(data)
    line = run_error(capsys, ["forecast", "--trace", str(path), "--interval", "600"])
    assert line.startswith(f"fulcrum forecast: error: {path}: corrupt or truncated gzip data: ")


def test_an_interval_too_short_for_the_default_season_names_the_interval(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, ["forecast", "--trace", "azure-conv-2023", "--interval", "0.5"])
    assert line == ("fulcrum forecast: error: --interval 0.5 s makes the default season (one day) 172800 "
                    "intervals, more than 100000: pass --season or a longer --interval")
    # a season given, the trace itself cut into millions of intervals: refused before they are allocated
    line = run_error(capsys, ["forecast", "--trace", "azure-conv-2023", "--interval", "0.001", "--season", "24"])
    assert line == ("fulcrum forecast: error: --interval 0.001 s cuts azure-conv-2023's 3501.72 s of arrivals into "
                    "3501722 intervals, more than 100000: pass a longer --interval")
    line = run_error(capsys, ["forecast", "--trace", "azure-conv-2023", "--interval", "60", "--warmup", "-3"])
    assert line == "fulcrum forecast: error: --warmup must be >= 0 intervals, got -3"


def test_several_llmserve_errors_are_joined_without_a_stray_dot(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc = yaml.safe_load(DISAGG_SPEC.read_text())
    doc["spec"]["slo"].update(ttftMs=-5, percentile=500)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(doc))
    line = run_error(capsys, ["plan", "--llmserve", str(path), "--isl", "1000", "--osl", "150", "--rate", "5"])
    assert line == (f"fulcrum plan: error: {path}: invalid LLMServe: spec.slo.ttftMs: Input should be greater than 0; "
                    "spec.slo.percentile: Input should be less than or equal to 100")


@pytest.mark.parametrize(("content", "message"), [
    (b"\xff\xfe spec", "not UTF-8 text (invalid start byte at byte 0)"),
    (b"a: " + b"[" * 5000, "not valid YAML: nested too deeply"),
    (b"", "empty file: no LLMServe in it"),
    (b"# only a comment\n", "empty file: no LLMServe in it"),
    (b"- 1\n", "invalid LLMServe: expected a mapping, got list"),
    (b"spec: {model: {name: m}}\n---\nspec: {model: {name: m}}\n", "2 YAML documents: give one LLMServe per file"),
    (b"spec: {model: {name: m}}\nbad: [1, 2\n", "not valid YAML: while parsing a flow sequence, expected ',' or ']'"),
    (b"kind: Foo\nspec: {model: {name: m}}\n", "invalid LLMServe: kind: Input should be 'LLMServe'"),
    # a timestamp PyYAML matches but cannot build raised a bare ValueError: "fulcrum plan: error: month must be..."
    (b"metadata: {name: x, created: 2024-13-45}\nspec: {model: {name: m}}\n",
     "not valid YAML: month must be in 1..12"),
])
def test_a_malformed_llmserve_file_is_one_line_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         content: bytes, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    line = run_error(capsys, ["plan", "--llmserve", str(path), "--isl", "1000", "--osl", "150", "--rate", "5"])
    assert line.startswith(f"fulcrum plan: error: {path}") and message in line, line


def test_one_llmserve_between_document_markers_is_read(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "marked.yaml"
    path.write_text("---\n" + DISAGG_SPEC.read_text() + "\n---\n")
    assert main(["plan", "--llmserve", str(path), "--isl", "1000", "--osl", "150", "--rate", "5"]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--trace", "azure-conv-2023", "--no-such-flag"],
        ["plan", "--profile", "dopd-llama70b-fp8-h100", "--isl", "1000", "--osl", "150"],  # no load given
        ["replay", "--trace", "azure-conv-2023", "--policy", "nope"],
        [],
    ],
)
def test_argparse_errors_exit_with_code_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    assert "error:" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- console script
def test_the_installed_console_script_runs_plan_and_reports_bad_input() -> None:
    exe = shutil.which("fulcrum")
    if exe is None:
        pytest.skip("the `fulcrum` console script is not on PATH (pip install -e .)")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    ok = subprocess.run([exe, *DOPD_PLAN, "--decode-concurrency", "235", "--json"],
                        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ratio"] == pytest.approx(DOPD_RATIO, rel=DOPD_TOLERANCE)
    bad = subprocess.run([exe, "forecast", "--trace", "azure-code-2023", "--interval", "-60"],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "fulcrum forecast: error: --interval must be a positive number of seconds, got -60.0"
    ]


def test_the_cli_runs_with_only_the_base_dependencies() -> None:
    """`pip install -e .` (no extras) must be enough for `fulcrum replay`, as the README's first command promises:
    no subcommand may import an extra's library (aiohttp, kopf, aetcd, nats, kubernetes, prometheus_*) at parse
    time. The extras' modules are blocked in a fresh interpreter."""
    import subprocess
    import sys

    blocked = ["aiohttp", "kopf", "aetcd", "nats", "kubernetes", "prometheus_client", "prometheus_api_client",
               "uvloop", "grafana_foundation_sdk"]
    code = (
        "import sys\n"
        f"for m in {blocked!r}: sys.modules[m] = None\n"
        "from fulcrum.cli import main\n"
        "sys.exit(main(['plan', '--profile', 'dopd-llama70b-fp8-h100', '--isl', '1000', '--osl', '150', '--rate', '5']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ratio" in proc.stdout.lower()


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")), ids=lambda n: n.removesuffix(".yaml"))
def test_every_shipped_example_replays_as_shipped(capsys: pytest.CaptureFixture[str], example: str) -> None:
    # a user copies an example and runs it: its profile must resolve and the planner must run on its mode
    spec = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    data = run_json(capsys, ["replay", "--trace", "azure-conv-2023", "--llmserve", str(EXAMPLES / example),
                             "--duration", "240", "--warmup", "0", "--policy", "fulcrum", "--json", "--no-progress"])
    check_policies(data, {"fulcrum"})
    assert data["mode"] == spec["mode"]
    assert data["profile"] == spec["profile"]["name"]


# A command's first step on a base install (`pip install -e .`, no extras): what each needs at least to start.
BASE_INSTALL_FIRST_STEPS = {
    "router": ["--config", "router.yaml"],
    "operator": ["--namespace", "default", "--prometheus-url", "http://127.0.0.1:9", "--image", "fulcrum:dev"],
    "worker": ["--model", "m", "--tp", "1", "--role", "prefill"],
    "sim-worker": ["--profile", "dopd-llama70b-fp8-h100", "--tp", "1"],
    "profile": ["--url", "http://127.0.0.1:9", "--model", "m", "--tp", "1", "--out", "p.yaml", "--gpu", "H100",
                "--weight-gib", "10"],
}
EXTRAS_MODULES = ["aiohttp", "kopf", "aetcd", "nats", "kubernetes", "prometheus_client", "prometheus_api_client",
                  "uvloop", "grafana_foundation_sdk"]


def _run_on_base_install(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``fulcrum ARGV`` in a fresh interpreter where every extra's library is blocked (as on a base install)."""
    import sys

    code = (
        "import sys\n"
        f"for m in {EXTRAS_MODULES!r}: sys.modules[m] = None\n"
        "from fulcrum.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("command", ["replay", "plan", "forecast", "crd", *BASE_INSTALL_FIRST_STEPS])
def test_every_command_shows_its_help_on_a_base_install(command: str, tmp_path: Path) -> None:
    proc = _run_on_base_install([command, "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: fulcrum {command}")


@pytest.mark.parametrize("command", sorted(BASE_INSTALL_FIRST_STEPS))
def test_a_command_whose_extra_is_missing_names_the_extra_to_install(command: str, tmp_path: Path) -> None:
    from fulcrum.cli import EXTRA_OF_COMMAND

    (tmp_path / "router.yaml").write_text("policy: round_robin\n")
    proc = _run_on_base_install([command, *BASE_INSTALL_FIRST_STEPS[command]], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    extra = EXTRA_OF_COMMAND[command]
    assert line.startswith(f"fulcrum {command}: error: ")
    assert f"pip install 'fulcrum[{extra}]'" in line


def test_a_missing_module_of_no_extra_is_not_disguised_as_a_missing_extra() -> None:
    from fulcrum.cli import missing_extra_message

    assert missing_extra_message("router", ModuleNotFoundError("no", name="numpy")) is None
    assert missing_extra_message("operator", ModuleNotFoundError("no", name="kubernetes.client")) == (
        "`fulcrum operator` needs the 'operator' extra (no module 'kubernetes'): pip install 'fulcrum[operator]'")


def test_sim_worker_on_a_port_in_use_says_so_in_one_line_and_leaves_nothing_open(capsys: Any) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = main(["sim-worker", "--profile", "dopd-llama70b-fp8-h100", "--tp", "1", "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "error"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"fulcrum sim-worker: error: cannot listen on 127.0.0.1:{port}: "
                   f"error while attempting to bind on address ('127.0.0.1', {port}): address already in use"]


def test_sim_worker_serves_what_its_kv_cache_holds_when_max_model_len_is_larger(
        capsys: Any, caplog: pytest.LogCaptureFixture) -> None:
    # the operator passes spec.engine.maxModelLen, and its TP choice does not check it against the KV cache: the
    # emulator warns and serves the whole blocks it holds, instead of 400-ing every request (or refusing to start)
    import socket

    with socket.socket() as taken, caplog.at_level("WARNING", logger="fulcrum.sim_worker"):
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = main(["sim-worker", "--profile", "dopd-llama70b-fp8-h100", "--tp", "1", "--host", "127.0.0.1",
                   "--port", str(port), "--kv-capacity-tokens", "100", "--block-size", "16", "--max-model-len", "8192"])
    assert rc == 2  # the port in use ends the run after the start-up checks
    assert "--max-model-len 8192 is larger than the 96 tokens the KV cache holds" in caplog.text
    assert "serving with a context of 96 tokens" in caplog.text
