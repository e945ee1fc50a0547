"""What ``fulcrum replay`` reports: the ``--records`` file written atomically, the same top-level ``--json`` keys
with several ``--routing`` names as with one, and the report's ``summary.json`` equal to ``--json``."""

from __future__ import annotations

import csv
import json
import math
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fulcrum.api import SLOSpec
from fulcrum.cli import main
from fulcrum.replay import distribution
from fulcrum.replay.distribution import RECORD_COLUMNS, write_records
from fulcrum.replay.result import PolicyRun, PolicySummary, RequestRecord

REPO = Path(__file__).resolve().parents[2]
AUTO_SPEC = REPO / "examples" / "llmserve-auto.yaml"  # engine.maxModelLen: 4096
SLO = SLOSpec(ttft_ms=2000.0, tpot_ms=80.0, percentile=90.0)


def _run(n: int = 5) -> PolicyRun:
    summary = PolicySummary(0.9, 100.0, 110.0, 1.0, 1.5, 0.07, 0.95, 0.92, n, 0)
    records = [RequestRecord(float(i), 100, 10, 0.1, 0.02, i + 1.0, "disaggregated", 0.0, 0, 1) for i in range(n)]
    return PolicyRun("x", summary, records=records)


def _failing_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every run's rows fail after the first one (a disk that fills up, an interrupted replay)."""
    rows = distribution.record_rows

    def broken(run: PolicyRun, slo: SLOSpec) -> Iterator[dict[str, Any]]:
        it = rows(run, slo)
        yield next(it)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(distribution, "record_rows", broken)


@pytest.mark.parametrize("name", ["records.csv", "records.parquet"])
def test_a_failed_records_write_leaves_the_existing_file_as_it_was(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'fulcrum[parquet]')")
    path = tmp_path / name
    write_records([_run()], path, SLO)
    before = path.read_bytes()
    _failing_rows(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write_records([_run(7)], path, SLO)
    assert path.read_bytes() == before  # not truncated, not half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no scratch file left beside it


def test_records_overwrite_an_existing_file_with_the_umasks_mode(tmp_path: Path) -> None:
    path = tmp_path / "records.csv"
    path.write_text("old\n")
    write_records([_run(3)], path, SLO)
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(RECORD_COLUMNS) and len(rows) == 3
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.csv"]


def test_records_through_a_symlink_are_written_to_its_target(tmp_path: Path) -> None:
    target = tmp_path / "data" / "records.csv"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "latest.csv"
    link.symlink_to(target)
    write_records([_run(2)], link, SLO)
    assert link.is_symlink() and target.read_text().startswith(",".join(RECORD_COLUMNS))


def _trace(tmp_path: Path) -> Path:
    """Two minutes of light load, one prompt (the 10th) longer than the auto spec's 4096-token context."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(40):
        lines.append(f"2023-11-16 18:{i * 3 // 60:02d}:{i * 3 % 60:02d},{5000 if i == 10 else 500},50")
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_json_with_several_routing_policies_has_the_rejected_requests_and_the_seed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", str(_trace(tmp_path)), "--llmserve", str(AUTO_SPEC), "--warmup", "0",
            "--no-progress", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--routing", "disaggregated,least_loaded"]) == 0
    several = json.loads(capsys.readouterr().out)
    assert one["rejected_requests"] == several["rejected_requests"] == 1
    assert "seed" in several and several["seed"] is None
    assert set(one) - {"routing"} <= set(several)


def test_the_reports_summary_json_is_what_json_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", str(_trace(tmp_path)), "--llmserve", str(AUTO_SPEC), "--warmup", "0",
            "--no-progress", "--json", "--report", str(tmp_path / "report")]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "report" / "summary.json").read_text())
    for entry in (printed, written):
        for p in entry["policies"].values():
            p.pop("wall_s")
    assert written == printed and written["rejected_requests"] == 1 and written["warmup_s"] == 0
    assert main([*argv, "--routing", "disaggregated,least_loaded"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert written.keys() == printed.keys() and "paths" in written
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in written["policies"]["least_loaded"].values())


def test_a_report_of_runs_with_no_scored_request_draws_every_plot_without_warnings(tmp_path: Path) -> None:
    from fulcrum.replay.report import METRIC_PNGS, write_report

    run = _run(4)
    run.warmup_s = 100.0  # every request arrived before scoring starts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report([run], tmp_path, trace_name="t", slo=SLO)
    assert {tmp_path / name for name in METRIC_PNGS.values()} <= set(paths)
    assert all(p.stat().st_size > 0 for p in paths)


def test_the_cdf_panel_of_one_token_outputs_does_not_claim_no_finite_latency() -> None:
    """Every TPOT is 0 (one-token outputs): finite, yet not drawable on the log axis; the note must not say
    there is no finite latency."""
    from fulcrum.replay import report

    summary = PolicySummary(1.0, 1.0, 1.0, 1.0, 0.1, 0.0, 1.0, 1.0, 3, 0)
    run = PolicyRun("x", summary, records=[RequestRecord(float(i), 100, 1, 0.1, 0.0, i + 0.1, "disaggregated", 0.0,
                                                         0, -1) for i in range(3)])
    figure = report._new_figure(4.0, 3.0)
    ax = figure.add_subplot()
    report._plot_cdf_panel(ax, [run], {"x": "C0"}, attribute="tpot_s", scale=1000.0, target=80.0, unit="ms",
                           name="TPOT")
    notes = [t.get_text() for t in ax.texts]
    assert notes and not any("no finite latencies" in n for n in notes)
    assert any("positive" in n for n in notes)


def test_the_routing_comparisons_header_names_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", "synthetic-burst-steady", "--seed", "3", "--duration", "120", "--warmup", "0",
            "--policy", "static", "--no-progress"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("trace synthetic-burst-steady (seed 3): ")
    assert main([*argv, "--routing", "disaggregated,least_loaded"]) == 0
    assert capsys.readouterr().out.startswith("trace synthetic-burst-steady (seed 3): ")


def test_percentiles_with_unserved_requests_are_numpys_to_the_last_bit() -> None:
    """Where a percentile falls between two served requests, it is ``numpy.percentile`` of the same values (what a
    user computes from ``--records``) exactly, not an interpolation of its own off by an ulp; where it touches an
    unserved (``inf``) request it is ``inf``."""
    import numpy as np

    from fulcrum.simulator.metrics import percentile

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 300))
        values = rng.lognormal(size=n)
        values[: int(rng.integers(1, max(2, n // 20)))] = math.inf
        for q in (50.0, 90.0, 99.0):
            with np.errstate(invalid="ignore"):
                expected = float(np.percentile(values, q))
            got = percentile(values, q)
            if math.isfinite(expected):
                assert got == expected, (n, q)
            else:  # numpy's NaN: inf − inf, or inf × 0 at a rank that falls exactly on a served request
                stand_in = float(np.percentile(np.where(np.isfinite(values), values, 1e300), q))
                served = float(values[np.isfinite(values)].max())
                assert got == (stand_in if stand_in <= served else math.inf), (n, q)
    assert percentile([1.0, math.inf], 0.0) == 1.0 and percentile([math.inf], 50.0) == math.inf
    assert math.isnan(percentile([], 50.0))
