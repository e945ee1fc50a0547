"""The replay report: comparison table, JSON summary and PNG plots from hand-built policy runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from fulcrum.api import SLOSpec
from fulcrum.replay.report import (
    COMPARISON_TXT,
    FORECAST_PNG,
    GPUS_PNG,
    LATENCY_CDF_PNG,
    METRIC_PNGS,
    POOLS_PNG,
    SUMMARY_JSON,
    empirical_cdf,
    write_report,
)
from fulcrum.replay.result import ForecastPoint, PolicyRun, PolicySummary, RequestRecord, TimelinePoint
from fulcrum.replay.table import comparison_table, percentiles_table, summary_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SLO = SLOSpec(ttft_ms=2000.0, tpot_ms=80.0, percentile=90.0)
POLICY_KEYS = {
    "slo_attainment",
    "goodput_tokens_per_s",
    "gpu_hours",
    "throughput_tokens_per_s",
    "ttft_attainment",
    "tpot_attainment",
    "ttft_p_s",
    "tpot_p_s",
    "requests",
    "scale_events",
    "migrations",
    "role_changes",
    "wall_s",
    "latency",
    "slo_infeasible",
    "held",
}


def _records() -> list[RequestRecord]:
    """Five requests: three fast, one slow, one never served (inf TTFT and TPOT)."""
    return [
        RequestRecord(0.0, 1000, 150, 0.4, 0.050, 8.0, "disaggregated"),
        RequestRecord(1.0, 200, 1, 0.1, 0.0, 1.1, "local"),
        RequestRecord(2.0, 3000, 300, 1.5, 0.070, 25.0, "disaggregated"),
        RequestRecord(3.0, 8000, 100, 6.0, 0.120, 21.0, "unified"),
        RequestRecord(4.0, 500, 50, math.inf, math.inf, math.inf, "disaggregated"),
    ]


def _timeline(step_gpus: int) -> list[TimelinePoint]:
    points = []
    for i in range(12):
        rate = 2.0 + (6.0 if 4 <= i < 8 else 0.0)
        prefill = 1 + (step_gpus if 4 <= i < 8 else 0)
        decode = 1 + (1 if 5 <= i < 9 else 0)
        points.append(TimelinePoint(60.0 * i, rate, prefill, decode, 0, 2 * prefill + 2 * decode, prefill + decode))
    return points


def _forecasts() -> list[ForecastPoint]:
    points = []
    for i in range(1, 12):
        for series, actual in (("rate", 2.0 + (6.0 if 4 <= i < 8 else 0.0)), ("isl", 1000.0 + 10 * i), ("osl", 150.0)):
            mean = actual * 1.1
            points.append(ForecastPoint(60.0 * i, 60.0 * (i - 1), series, mean, mean * 0.8, mean * 1.2, actual))
    return points


def _run(
    policy: str,
    *,
    slo_attainment: float = 0.8,
    ttft_p_s: float = 1.5,
    forecasts: bool = True,
    wall_s: float = 2.5,
) -> PolicyRun:
    summary = PolicySummary(
        slo_attainment=slo_attainment,
        goodput_tokens_per_s=123.45,
        throughput_tokens_per_s=150.0,
        gpu_hours=0.75,
        ttft_p_s=ttft_p_s,
        tpot_p_s=0.07,
        ttft_attainment=0.9,
        tpot_attainment=0.625,
        requests=5,
        scale_events=4,
    )
    return PolicyRun(
        policy=policy,
        summary=summary,
        records=_records(),
        timeline=_timeline(2 if policy == "fulcrum" else 1),
        forecasts=_forecasts() if forecasts else [],
        wall_s=wall_s,
    )


def _row(table: str, policy: str) -> list[str]:
    rows = [line.split() for line in table.splitlines() if line.split()[:1] == [policy]]
    assert len(rows) == 1, table
    return rows[0]


def _assert_valid_png(path: Path, *, min_width: int = 600, min_height: int = 300) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000  # a drawn figure, not an empty canvas
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_height
    assert width <= 4000 and height <= 4000
    assert float(np.std(image[..., :3])) > 0.01  # not a single flat colour


def test_table_has_one_row_per_policy_with_attainments_in_percent() -> None:
    runs = [_run("fulcrum", slo_attainment=0.875), _run("static", slo_attainment=0.5, forecasts=False)]
    table = comparison_table(runs, SLO, trace_name="burstgpt")

    first = table.splitlines()[0]
    assert "burstgpt" in first and "2000 ms" in first and "80 ms" in first and "P90" in first
    fulcrum = _row(table, "fulcrum")
    static = _row(table, "static")
    # policy, SLO %, TTFT %, TPOT %, goodput, throughput, GPU-h, P90 TTFT s, P90 TPOT ms, scale events, wall s
    assert fulcrum[1:4] == ["87.5", "90.0", "62.5"]
    assert static[1] == "50.0"
    assert fulcrum[4:7] == ["123.5", "150.0", "0.75"]
    assert fulcrum[7:] == ["1.500", "70.0", "4", "2.5"]
    assert "P90 TTFT s" in table and "P90 TPOT ms" in table


def test_table_columns_are_aligned_and_an_infinite_percentile_reads_inf() -> None:
    runs = [_run("a-rather-long-policy-name"), _run("dopd", ttft_p_s=math.inf)]
    table = comparison_table(runs, SLO, trace_name="t")
    lines = table.splitlines()
    header, rule, *rows = lines[1:]
    assert len({len(line) for line in (header, rule, *rows)}) == 1  # numbers right-aligned to one width
    assert _row(table, "dopd")[7] == "inf"
    assert table.endswith("\n")


def test_summary_json_has_exactly_the_documented_keys_and_survives_strict_json() -> None:
    runs = [_run("fulcrum"), _run("static", ttft_p_s=math.inf, wall_s=math.nan, forecasts=False)]
    summary = summary_json(runs, trace_name="azure-code", slo=SLO)

    assert set(summary) == {"trace", "slo", "policies"}
    assert summary["trace"] == "azure-code"
    assert summary["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 80.0, "percentile": 90.0}
    assert list(summary["policies"]) == ["fulcrum", "static"]
    for entry in summary["policies"].values():
        assert set(entry) == POLICY_KEYS
        assert isinstance(entry["requests"], int) and isinstance(entry["scale_events"], int)
        assert entry["migrations"] == 0  # rescheduling off
    assert summary["policies"]["fulcrum"]["slo_attainment"] == pytest.approx(0.8)
    assert summary["policies"]["fulcrum"]["ttft_p_s"] == pytest.approx(1.5)
    assert summary["policies"]["static"]["ttft_p_s"] is None  # inf → None
    assert summary["policies"]["static"]["wall_s"] is None  # NaN → None

    text = json.dumps(summary, allow_nan=False)
    assert json.loads(text) == summary


def test_summary_json_adds_extra_entries_made_json_safe_and_refuses_reserved_keys() -> None:
    extra = {"profile": "dopd-llama70b-fp8-h100", "mean_gpus": np.float64(math.inf), "intervals": np.int64(12)}
    summary = summary_json([_run("fulcrum")], trace_name="t", slo=SLO, extra=extra)
    assert summary["profile"] == "dopd-llama70b-fp8-h100"
    assert summary["mean_gpus"] is None
    assert summary["intervals"] == 12 and type(summary["intervals"]) is int
    json.dumps(summary, allow_nan=False)

    with pytest.raises(ValueError, match="policies"):
        summary_json([_run("fulcrum")], trace_name="t", slo=SLO, extra={"policies": {}})


def test_empty_or_duplicated_run_lists_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        write_report([], tmp_path, trace_name="t", slo=SLO)
    with pytest.raises(ValueError, match="empty"):
        comparison_table([], SLO, trace_name="t")
    with pytest.raises(ValueError, match="empty"):
        summary_json([], trace_name="t", slo=SLO)
    with pytest.raises(ValueError, match="fulcrum"):
        summary_json([_run("fulcrum"), _run("fulcrum")], trace_name="t", slo=SLO)
    assert list(tmp_path.iterdir()) == []


def test_empirical_cdf_keeps_never_served_requests_in_the_denominator() -> None:
    ttft = [record.ttft_s for record in _records()]
    x, y, n_beyond, n = empirical_cdf(ttft)
    assert (n_beyond, n) == (1, 5)
    assert x.tolist() == [0.1, 0.4, 1.5, 6.0]
    assert y.tolist() == pytest.approx([0.2, 0.4, 0.6, 0.8])  # ends at 4/5, not 1

    tpot = [record.tpot_s for record in _records()]
    x_ms, y_ms, _, _ = empirical_cdf(tpot, scale=1000.0)
    assert x_ms.tolist() == pytest.approx([50.0, 70.0, 120.0])  # the zero TPOT is counted, not drawn
    assert y_ms.tolist() == pytest.approx([0.4, 0.6, 0.8])


def test_the_latency_cdf_panel_draws_only_the_scored_requests_like_the_table() -> None:
    from dataclasses import replace

    from matplotlib.figure import Figure

    from fulcrum.replay.report import _plot_cdf_panel

    run = replace(_run("fulcrum"), warmup_s=2.0)  # the requests arriving at 0 s and 1 s are the warm-up's
    ax = Figure().add_subplot()
    _plot_cdf_panel(ax, [run], {"fulcrum": "C0"}, attribute="ttft_s", scale=1.0, target=2.0, unit="s", name="TTFT")
    [curve] = [line for line in ax.get_lines() if line.get_label() == "fulcrum (1/3 beyond axis)"]
    # scored: 1.5 s, 6.0 s and the never-served one; 0.4 s and 0.1 s (warm-up) are not drawn
    assert list(curve.get_xdata()) == [1.5, 1.5, 6.0]
    assert list(curve.get_ydata()) == pytest.approx([0.0, 1 / 3, 2 / 3])


def test_write_report_writes_every_file_and_each_png_is_readable(tmp_path: Path) -> None:
    runs = [_run("fulcrum"), _run("dopd", slo_attainment=0.6), _run("static", forecasts=False)]
    out_dir = tmp_path / "report" / "nested"  # created on demand
    paths = write_report(runs, out_dir, trace_name="burstgpt", slo=SLO)

    names = [path.name for path in paths]
    assert names == [GPUS_PNG, FORECAST_PNG, LATENCY_CDF_PNG, POOLS_PNG, *METRIC_PNGS.values(), SUMMARY_JSON, COMPARISON_TXT]
    assert all(path.parent == out_dir and path.is_file() for path in paths)
    for path in paths:
        if path.suffix == ".png":
            _assert_valid_png(path)
    forecast_height = matplotlib.image.imread(out_dir / FORECAST_PNG).shape[0]
    assert forecast_height > matplotlib.image.imread(out_dir / GPUS_PNG).shape[0]  # three stacked panels

    summary = json.loads((out_dir / SUMMARY_JSON).read_text(encoding="utf-8"))
    assert summary == summary_json(runs, trace_name="burstgpt", slo=SLO)
    assert (out_dir / COMPARISON_TXT).read_text(encoding="utf-8") == \
        comparison_table(runs, SLO, trace_name="burstgpt") + "\n" + percentiles_table(runs, trace_name="burstgpt")


def test_runs_without_forecasts_skip_the_forecast_figure(tmp_path: Path) -> None:
    runs = [_run("static", forecasts=False), _run("unified", forecasts=False, ttft_p_s=math.inf)]
    paths = write_report(runs, tmp_path, trace_name="t", slo=SLO)

    assert [path.name for path in paths] == [GPUS_PNG, LATENCY_CDF_PNG, POOLS_PNG, *METRIC_PNGS.values(), SUMMARY_JSON, COMPARISON_TXT]
    assert not (tmp_path / FORECAST_PNG).exists()
    summary = json.loads((tmp_path / SUMMARY_JSON).read_text(encoding="utf-8"))
    assert summary["policies"]["unified"]["ttft_p_s"] is None


def test_a_run_with_no_records_timeline_or_finite_values_still_gets_a_report(tmp_path: Path) -> None:
    bare = PolicyRun(policy="bare", summary=_run("x").summary)
    broken_forecasts = [
        ForecastPoint(60.0, 0.0, "rate", math.nan, math.nan, math.inf, 3.0),
        ForecastPoint(120.0, 60.0, "rate", 3.0, 2.0, 4.0, math.nan),
    ]
    unserved = PolicyRun(
        policy="unserved",
        summary=_run("x").summary,
        records=[RequestRecord(0.0, 10, 10, math.inf, math.inf, math.inf, "disaggregated")],
        forecasts=broken_forecasts,
    )
    paths = write_report([bare, unserved], tmp_path, trace_name="t", slo=SLO)

    assert [path.name for path in paths] == [GPUS_PNG, FORECAST_PNG, LATENCY_CDF_PNG, POOLS_PNG, *METRIC_PNGS.values(), SUMMARY_JSON, COMPARISON_TXT]
    for path in paths:
        if path.suffix == ".png":
            _assert_valid_png(path)
