"""Latency distributions of a replay: p50/p90/p99 per policy and metric, per-request records, plots, JSON, and the
warning for SLO targets the plans found out of reach."""

from __future__ import annotations

import csv
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fulcrum.api import SLOSpec
from fulcrum.api.llmserve import LLMServeSpec, load_llmserve
from fulcrum.cli import main
from fulcrum.ratio.feasibility import SLOInfeasible
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.replay.distribution import (
    METRICS,
    RECORD_COLUMNS,
    LatencyDistribution,
    check_records_path,
    metric_values,
    write_records,
)
from fulcrum.replay.driver import run_policy
from fulcrum.replay.report import METRIC_PNGS, write_report
from fulcrum.replay.result import InfeasibleSLO, PolicyRun, PolicySummary, RequestRecord
from fulcrum.replay.table import infeasible_lines, percentiles_table, summary_json
from fulcrum.workload import Request

REPO = Path(__file__).resolve().parents[2]
DISAGG_SPEC = REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml"
SLO = SLOSpec(ttft_ms=2000.0, tpot_ms=80.0, percentile=90.0)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _synthetic(n: int = 600, seed: int = 7) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(2.0)
        out.append(Request(arrival_s=t, isl=rng.randint(100, 3000), osl=rng.randint(1, 300)))
    return out


@pytest.fixture(scope="module")
def spec() -> LLMServeSpec:
    return load_llmserve(DISAGG_SPEC).spec


@pytest.fixture(scope="module")
def run(spec: LLMServeSpec) -> PolicyRun:
    """``fulcrum`` on five minutes of Poisson load at 2 req/s, scored after 60 s."""
    from fulcrum.replay.driver import ReplayOptions

    return run_policy("fulcrum", _synthetic(), spec, builtin_profile("dopd-llama70b-fp8-h100"),
                      ReplayOptions(warmup_s=60.0))


def test_the_percentiles_are_numpys_over_the_scored_records(run: PolicyRun) -> None:
    scored = [r for r in run.records if r.arrival_s >= 60.0]
    assert run.warmup_s == 60.0 and run.summary.latency.requests == len(scored) < len(run.records)
    columns = {
        "ttft": [r.ttft_s for r in scored], "tpot": [r.tpot_s for r in scored],
        "e2e": [r.finish_s - r.arrival_s for r in scored], "queue": [r.queue_s for r in scored],
    }
    for metric in METRICS:
        values = np.array(columns[metric])
        assert np.isfinite(values).all(), metric  # a light load: everything served
        p = run.summary.latency.metric(metric)
        assert (p.p50_s, p.p90_s, p.p99_s) == tuple(float(np.percentile(values, q)) for q in (50, 90, 99)), metric
    assert run.summary.latency.ttft.p90_s == pytest.approx(run.summary.ttft_p_s)  # the spec's P90, computed alike


def test_queueing_time_is_part_of_ttft_and_every_request_names_its_instances(run: PolicyRun) -> None:
    for r in run.records:
        assert 0.0 <= r.queue_s <= r.ttft_s <= r.e2e_s
        assert r.prefill_instance >= 0
        assert r.decode_instance >= 0 or (r.osl == 1 and r.path == "disaggregated")


def test_an_unserved_request_puts_a_percentile_at_infinity() -> None:
    records = [RequestRecord(float(i), 100, 10, 0.1 * (i + 1), 0.02, i + 1.0, "disaggregated", 0.01 * i, 0, 1)
               for i in range(9)]
    records.append(RequestRecord(9.0, 100, 10, math.inf, math.inf, math.inf, "disaggregated"))
    d = LatencyDistribution.of(records)
    assert d.requests == 10 and math.isinf(d.ttft.p99_s) and math.isinf(d.queue.p99_s)
    assert d.ttft.p50_s == pytest.approx(float(np.percentile([0.1 * (i + 1) for i in range(9)] + [math.inf], 50)))
    assert math.isnan(LatencyDistribution.empty().e2e.p50_s)
    assert list(metric_values(records[:2], "e2e")) == [1.0, 1.0]


def test_the_records_csv_round_trips(run: PolicyRun, tmp_path: Path) -> None:
    path = write_records([run], tmp_path / "out" / "records.csv", SLO)
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(RECORD_COLUMNS) and len(rows) == len(run.records)
    for i, (row, r) in enumerate(zip(rows, run.records)):
        assert (row["policy"], int(row["request_id"]), row["path"]) == ("fulcrum", i, r.path)
        assert (float(row["arrival_s"]), int(row["isl"]), int(row["osl"])) == (r.arrival_s, r.isl, r.osl)
        assert (float(row["ttft_s"]), float(row["tpot_s"]), float(row["e2e_s"]), float(row["queue_s"])) == \
            (r.ttft_s, r.tpot_s, r.e2e_s, r.queue_s)
        assert (int(row["prefill_instance"]), int(row["decode_instance"])) == (r.prefill_instance, r.decode_instance)
        assert bool(int(row["slo_ok"])) == (r.ttft_s <= 2.0 and r.tpot_s <= 0.08)
        assert bool(int(row["scored"])) == (r.arrival_s >= 60.0)


def test_records_of_unserved_requests_read_inf(tmp_path: Path) -> None:
    run = PolicyRun("x", _summary(), records=[RequestRecord(0.0, 10, 5, math.inf, math.inf, math.inf, "unified")])
    path = write_records([run], tmp_path / "r.csv", SLO)
    with path.open(newline="") as fh:
        [row] = list(csv.DictReader(fh))
    assert row["ttft_s"] == row["e2e_s"] == row["queue_s"] == "inf" and row["slo_ok"] == "0"
    assert row["prefill_instance"] == row["decode_instance"] == "-1"


def test_parquet_without_pyarrow_fails_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow → ImportError
    with pytest.raises(ValueError, match=r"fulcrum\[parquet\]"):
        check_records_path(tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"\.csv or \.parquet"):
        check_records_path(tmp_path / "r.txt")
    assert check_records_path(tmp_path / "r.CSV") == "csv"


def test_a_records_path_that_cannot_be_written_fails_the_check(tmp_path: Path) -> None:
    folder = tmp_path / "taken.csv"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"^--records .*taken\.csv: is a folder, not a file$"):
        check_records_path(folder)
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"^--records .*plain/r\.csv: .*plain is not a folder$"):
        check_records_path(a_file / "r.csv")
    if Path("/proc/self").is_dir():  # Linux: nothing can be created under /proc, not even as root
        with pytest.raises(ValueError, match=r"^--records /proc/fulcrum-records\.csv: cannot write there \("):
            check_records_path(Path("/proc/fulcrum-records.csv"))
    # a good path: its missing folders are made, the scratch file is gone, an existing file is left as it was
    nested = tmp_path / "a" / "b" / "r.csv"
    assert check_records_path(nested) == "csv"
    assert nested.parent.is_dir() and list(nested.parent.iterdir()) == []
    kept = tmp_path / "kept.csv"
    kept.write_text("old\n")
    assert check_records_path(kept) == "csv" and kept.read_text() == "old\n"


def test_parquet_records_hold_the_same_rows(run: PolicyRun, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'fulcrum[parquet]')")
    table = pq.read_table(write_records([run], tmp_path / "r.parquet", SLO)).to_pydict()
    assert list(table) == list(RECORD_COLUMNS) and table["ttft_s"] == [r.ttft_s for r in run.records]


def _summary(**latency: Any) -> PolicySummary:
    return PolicySummary(0.9, 100.0, 110.0, 1.0, 1.5, 0.07, 0.95, 0.92, 10, 2, **latency)


def test_json_has_the_percentiles_of_every_metric_and_the_infeasible_targets(run: PolicyRun) -> None:
    tpot = SLOInfeasible("tpot", 0.08, 0.0902, 14000.0, 2000.0, 2, 0.0992)
    other = PolicyRun("static", _summary(), records=[], slo_infeasible=(InfeasibleSLO(tpot, 3, 10, 180.0),))
    data = json.loads(json.dumps(summary_json([run, other], trace_name="t", slo=SLO), allow_nan=False))
    latency = data["policies"]["fulcrum"]["latency"]
    assert set(latency) == {"ttft_s", "tpot_s", "e2e_s", "queue_s", "requests"}
    for metric in METRICS:
        assert latency[f"{metric}_s"] == run.summary.latency.metric(metric).as_dict()
        assert set(latency[f"{metric}_s"]) == {"p50", "p90", "p99"}
    assert data["policies"]["fulcrum"]["slo_infeasible"] == []
    assert data["policies"]["static"]["latency"]["ttft_s"] == {"p50": None, "p90": None, "p99": None}  # NaN → null
    assert data["policies"]["static"]["slo_infeasible"] == [{
        "metric": "tpot", "target_s": 0.08, "best_s": 0.0902, "at_isl": 14000.0, "at_osl": 2000.0, "tp": 2,
        "planned_for_s": 0.0992, "intervals": 3, "total_intervals": 10, "first_time_s": 180.0}]
    [line] = infeasible_lines([run, other])
    assert line.startswith("warning: static: TPOT target 80 ms cannot be met: best 90.2 ms at batch 1")
    assert line.endswith("in 3 of 10 intervals, first at t = 180 s")


def test_the_percentiles_table_has_a_row_per_policy_and_metric(run: PolicyRun) -> None:
    table = percentiles_table([run], trace_name="poisson")
    lines = table.splitlines()
    assert "poisson" in lines[0] and "from t = 60 s" in lines[0]
    assert lines[1].split() == ["policy", "metric", "unit", "p50", "p90", "p99", "requests"]
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["fulcrum", "TPOT", "E2E", "queue"]
    assert rows[0][1:3] == ["TTFT", "s"] and rows[1][:2] == ["TPOT", "ms"]
    assert rows[0][3] == f"{run.summary.latency.ttft.p50_s:.3f}"
    assert rows[1][3] == f"{run.summary.latency.tpot.p90_s * 1e3:.1f}"  # no policy name on this row: p90 is 4th
    assert len({len(line) for line in lines[1:3]}) == 1 and table.endswith("\n")


def test_the_report_draws_one_distribution_plot_per_metric(run: PolicyRun, tmp_path: Path) -> None:
    unserved = PolicyRun("starved", _summary(latency=LatencyDistribution.of([])), records=[
        RequestRecord(100.0, 10, 5, math.inf, math.inf, math.inf, "disaggregated")], warmup_s=60.0)
    paths = write_report([run, unserved], tmp_path, trace_name="poisson", slo=SLO)
    for metric, name in METRIC_PNGS.items():
        data = (tmp_path / name).read_bytes()
        assert tmp_path / name in paths and data[:8] == PNG_SIGNATURE and len(data) > 10_000, metric
    assert "p99" in (tmp_path / "comparison.txt").read_text()


def test_a_replay_with_an_unreachable_tpot_target_warns_and_says_so_in_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = DISAGG_SPEC.read_text().replace("tpotMs: 80", "tpotMs: 30")  # one request's step at TP2 is ~34 ms
    spec_path = tmp_path / "tight.yaml"
    spec_path.write_text(text)
    argv = ["replay", "--trace", "azure-conv-2023", "--llmserve", str(spec_path), "--duration", "300",
            "--warmup", "0", "--policy", "fulcrum", "--no-progress"]
    assert main([*argv, "--percentiles", "--records", str(tmp_path / "r.csv")]) == 0
    out = capsys.readouterr().out
    assert "warning: fulcrum: TPOT target 30 ms cannot be met: best" in out
    assert "Latency percentiles of trace 'azure-conv-2023'" in out and (tmp_path / "r.csv").stat().st_size > 0
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [f] = data["policies"]["fulcrum"]["slo_infeasible"]
    assert f["metric"] == "tpot" and f["target_s"] == pytest.approx(0.03) and f["best_s"] > 0.03
    # every interval with arrivals (the last one, after the last arrival, plans for an empty load)
    assert f["total_intervals"] - 1 <= f["intervals"] <= f["total_intervals"]
    assert data["policies"]["fulcrum"]["gpu_hours"] < 32 * 300 / 3600  # not the GPU cap all along
