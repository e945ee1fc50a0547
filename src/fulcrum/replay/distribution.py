"""Latency distributions of a replay: p50/p90/p99 per policy, and the per-request records as CSV or Parquet.

Four latencies per request, all in seconds (:class:`fulcrum.simulator.records.RequestRecord`):

- ``ttft`` — arrival → first token, queueing included;
- ``tpot`` — mean time per output token after the first (0 for one-token outputs);
- ``e2e`` — arrival → last token;
- ``queue`` — arrival → start of the request's first prefill (the router, a prefill instance's DOPD Alg. 1 gate
  and queue, or an engine's waiting queue for colocated prompts).

A request never served (or unfinished when the run ended) has ``inf`` for the times it never reached, and counts:
a percentile that falls among such requests is ``inf`` (:func:`fulcrum.simulator.metrics.percentile`).
Percentiles are over the **scored** requests — those arriving at or after the warm-up, as the summary's SLO
attainment — so they describe the planner, not the cold start of the initial pools.
"""

from __future__ import annotations

import csv
import math
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from fulcrum.api import SLOSpec
from fulcrum.outputs import check_writable_file, check_writable_folder
from fulcrum.simulator.metrics import percentile
from fulcrum.simulator.records import RequestRecord

if TYPE_CHECKING:  # result.py holds a LatencyDistribution per policy
    from fulcrum.replay.result import PolicyRun

__all__ = [
    "LatencyMetric",
    "METRICS",
    "METRIC_UNITS",
    "METRIC_NAMES",
    "PERCENTILES",
    "Percentiles",
    "LatencyDistribution",
    "metric_values",
    "scored_records",
    "RECORD_COLUMNS",
    "RECORD_FORMATS",
    "record_rows",
    "check_records_path",
    "write_records",
]

#: The latencies reported per request and policy.
LatencyMetric = Literal["ttft", "tpot", "e2e", "queue"]
METRICS: tuple[LatencyMetric, ...] = ("ttft", "tpot", "e2e", "queue")
#: How each metric is shown in tables and plots: (label, unit, factor from seconds). TPOT in ms, the rest in s.
METRIC_UNITS: dict[LatencyMetric, tuple[str, str, float]] = {
    "ttft": ("TTFT", "s", 1.0),
    "tpot": ("TPOT", "ms", 1000.0),
    "e2e": ("E2E", "s", 1.0),
    "queue": ("queue", "s", 1.0),
}
#: What each metric is, for plot titles.
METRIC_NAMES: dict[LatencyMetric, str] = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "e2e": "end-to-end latency",
    "queue": "queueing time (arrival → prefill start)",
}
#: The percentiles reported (0..100).
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)

FloatArray = npt.NDArray[np.float64]


def metric_values(records: Sequence[RequestRecord], metric: LatencyMetric) -> FloatArray:
    """One latency of every record, seconds, shape ``(len(records),)``; ``inf`` where never reached."""
    n = len(records)
    if metric == "ttft":
        return np.fromiter((r.ttft_s for r in records), dtype=float, count=n)
    if metric == "tpot":
        return np.fromiter((r.tpot_s for r in records), dtype=float, count=n)
    if metric == "e2e":
        return np.fromiter((r.e2e_s for r in records), dtype=float, count=n)
    if metric == "queue":
        return np.fromiter((r.queue_s for r in records), dtype=float, count=n)
    raise ValueError(f"unknown latency metric {metric!r}; choose one of {', '.join(METRICS)}")


def scored_records(records: Sequence[RequestRecord], since_s: float) -> list[RequestRecord]:
    """The records of requests arriving at or after ``since_s`` seconds (the warm-up), in their order."""
    return [r for r in records if r.arrival_s >= since_s]


@dataclass(frozen=True)
class Percentiles:
    """p50, p90 and p99 of one latency, seconds (``inf``: the percentile falls on unserved requests; NaN: no
    requests)."""

    p50_s: float
    p90_s: float
    p99_s: float

    @classmethod
    def of(cls, values: Sequence[float] | FloatArray) -> "Percentiles":
        """Linear-interpolation percentiles of ``values`` (seconds), as ``numpy.percentile`` on finite data."""
        return cls(*(percentile(values, q) for q in PERCENTILES))

    def as_dict(self) -> dict[str, float]:
        """``{"p50": s, "p90": s, "p99": s}``."""
        return {"p50": self.p50_s, "p90": self.p90_s, "p99": self.p99_s}


@dataclass(frozen=True)
class LatencyDistribution:
    """p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time over a policy's scored requests.

    Attributes:
        ttft / tpot / e2e / queue: the percentiles of each metric, seconds (module doc).
        requests: the scored requests they are over.
    """

    ttft: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    queue: Percentiles
    requests: int

    @classmethod
    def of(cls, records: Sequence[RequestRecord], since_s: float = 0.0) -> "LatencyDistribution":
        """The distribution of the records arriving at or after ``since_s`` seconds."""
        scored = scored_records(records, since_s)
        p = {m: Percentiles.of(metric_values(scored, m)) for m in METRICS}
        return cls(ttft=p["ttft"], tpot=p["tpot"], e2e=p["e2e"], queue=p["queue"], requests=len(scored))

    @classmethod
    def empty(cls) -> "LatencyDistribution":
        """No requests: every percentile NaN."""
        return cls.of([])

    def metric(self, metric: LatencyMetric) -> Percentiles:
        """The percentiles of ``metric``."""
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e, "queue": self.queue}[metric]

    def as_dict(self) -> dict[str, Any]:
        """``{"ttft_s": {"p50", "p90", "p99"}, "tpot_s": …, "e2e_s": …, "queue_s": …, "requests": n}`` (seconds)."""
        out: dict[str, Any] = {f"{m}_s": self.metric(m).as_dict() for m in METRICS}
        out["requests"] = self.requests
        return out


#: Columns of ``--records``, in order. Times in seconds since the start of the trace (arrival) or durations in
#: seconds; ``*_instance`` are simulator instance ids (-1: none); ``*_ok`` judge the request against the SLO
#: targets; ``scored`` says whether it arrived after the warm-up (it counts in the summary and percentiles).
RECORD_COLUMNS: tuple[str, ...] = (
    "policy", "request_id", "arrival_s", "isl", "osl", "ttft_s", "tpot_s", "e2e_s", "queue_s", "path",
    "prefill_instance", "decode_instance", "ttft_ok", "tpot_ok", "slo_ok", "scored",
)
#: File suffix → format of ``--records``.
RECORD_FORMATS: dict[str, str] = {".csv": "csv", ".parquet": "parquet"}


def record_rows(run: "PolicyRun", slo: SLOSpec) -> Iterator[dict[str, Any]]:
    """One mapping per request of ``run`` (keys :data:`RECORD_COLUMNS`), in arrival order; ``request_id`` is the
    request's position in the (windowed, time-scaled) trace."""
    ttft_slo, tpot_slo = slo.ttft_ms / 1e3, slo.tpot_ms / 1e3
    for i, r in enumerate(run.records):
        ttft_ok, tpot_ok = r.ttft_s <= ttft_slo, r.tpot_s <= tpot_slo
        yield {
            "policy": run.policy, "request_id": i, "arrival_s": r.arrival_s, "isl": r.isl, "osl": r.osl,
            "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "queue_s": r.queue_s, "path": r.path,
            "prefill_instance": r.prefill_instance, "decode_instance": r.decode_instance,
            "ttft_ok": ttft_ok, "tpot_ok": tpot_ok, "slo_ok": ttft_ok and tpot_ok,
            "scored": r.arrival_s >= run.warmup_s,
        }


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def check_records_path(path: Path) -> str:
    """The format ``path`` will be written in (``"csv"`` or ``"parquet"``), checked before a long replay: the
    name, pyarrow for Parquet, and that the file can be written there. The probe creates the missing parent
    folders (as :func:`write_records` would), writes and removes a scratch file beside ``path`` (or beside the
    target of a link: :func:`write_records` writes its scratch file there) and opens an existing ``path`` for
    appending (its content is left as it is).

    Raises:
        ValueError: an unknown suffix, ``.parquet`` without pyarrow installed (the message names the extra),
            ``path`` is a folder, or its folder cannot be created or written into.
    """
    path = Path(path)
    fmt = RECORD_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"--records {path}: the file must end in .csv or .parquet")
    if fmt == "parquet" and not _has_pyarrow():
        raise ValueError(f"--records {path}: writing Parquet needs pyarrow, which is not installed: "
                         "pip install 'fulcrum[parquet]' (or pyarrow), or write a .csv file")
    check_writable_file(path, "--records", create_parent=True)
    # write_records replaces the file by a scratch file written beside it: the folder must take new files too
    check_writable_folder(Path(os.path.realpath(path)).parent, "--records")
    return fmt


def _csv_cell(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    return value


def write_records(runs: Sequence["PolicyRun"], path: Path, slo: SLOSpec) -> Path:
    """Write every request of every run to ``path``: CSV (``.csv``; header :data:`RECORD_COLUMNS`, booleans as
    0/1, infinite times as ``inf``) or Parquet (``.parquet``, needs pyarrow; booleans and ``inf`` native).

    Rows: the runs in order, each run's requests in arrival order (:func:`record_rows`).

    The file is written whole or not at all: into a scratch file beside ``path`` (``.NAME.*.tmp``), then renamed
    over it (:func:`os.replace`), so a write that fails half-way (a full disk, an interrupted replay) leaves an
    existing ``path`` as it was and no scratch file behind. A new file gets the mode the umask allows, an
    existing one keeps its mode; a symbolic link is followed (its target is replaced, the link stays).

    Raises:
        ValueError: unknown suffix, or Parquet without pyarrow (:func:`check_records_path`).
        OSError: the file cannot be written.
    """
    path = Path(path)
    fmt = check_records_path(path)
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # O_EXCL: never write through a file or link of that name; mode 0o666 less the umask, as open() gives
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", newline="", encoding="utf-8") as fh:
            if fmt == "csv":
                writer = csv.writer(fh)
                writer.writerow(RECORD_COLUMNS)
                for run in runs:
                    for row in record_rows(run, slo):
                        writer.writerow([_csv_cell(row[c]) for c in RECORD_COLUMNS])
        if fmt == "parquet":
            _write_parquet(runs, slo, scratch)
        if target.exists():
            os.chmod(scratch, stat.S_IMODE(target.stat().st_mode))
        os.replace(scratch, target)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    return path


def _write_parquet(runs: Sequence["PolicyRun"], slo: SLOSpec, path: Path) -> None:
    """The rows of :func:`record_rows` as one Parquet table at ``path`` (pyarrow; overwrites ``path``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list[Any]] = {c: [] for c in RECORD_COLUMNS}
    for run in runs:
        for row in record_rows(run, slo):
            for c in RECORD_COLUMNS:
                columns[c].append(row[c])
    pq.write_table(pa.table(columns), path)
