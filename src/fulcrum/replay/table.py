"""The comparison table and the JSON summary of a replay: one row / one entry per policy.

Both read only :class:`fulcrum.replay.result.PolicyRun` (its ``summary``, ``wall_s``, ``warmup_s`` and
``slo_infeasible``) and the SLO the run was judged against; neither touches the records, so they are cheap for any
trace length. :func:`percentiles_table` is the second, optional table (``fulcrum replay --percentiles``, and
``comparison.txt``): p50/p90/p99 of TTFT, TPOT, end-to-end latency and queueing time, one row per policy and
metric, so that the default table stays one line per policy.

The columns follow the metrics of DOPD §VI (SLO attainment, goodput, GPUs provisioned, TTFT and TPOT at
the SLO percentile; TTFT < 2 s and TPOT < 80 ms at P90 there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fulcrum.api import SLOSpec
from fulcrum.replay.distribution import METRIC_UNITS, METRICS, PERCENTILES
from fulcrum.replay.result import PolicyRun

__all__ = ["comparison_table", "percentiles_table", "infeasible_lines", "summary_json", "percentile_label",
           "slo_description", "check_runs"]

_RESERVED_KEYS = frozenset({"trace", "slo", "policies"})


def percentile_label(slo: SLOSpec) -> str:
    """``"P90"`` for ``percentile=90.0``, ``"P99.9"`` for ``99.9`` (no trailing zeros)."""
    return f"P{slo.percentile:g}"


def slo_description(slo: SLOSpec) -> str:
    """One line naming the SLO, e.g. ``"TTFT 2000 ms and TPOT 80 ms at P90"``."""
    return f"TTFT {slo.ttft_ms:g} ms and TPOT {slo.tpot_ms:g} ms at {percentile_label(slo)}"


def check_runs(runs: Sequence[PolicyRun]) -> None:
    """Raise ``ValueError`` on an empty run list or on two runs with the same policy name."""
    if len(runs) == 0:
        raise ValueError("no policy runs to report: the run list is empty")
    names = [run.policy for run in runs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"policy names must be unique in one report; repeated: {', '.join(duplicates)}")


def _finite_or_none(value: float) -> float | None:
    """``float(value)`` when finite, else ``None`` (JSON has no inf/NaN)."""
    number = float(value)
    return number if math.isfinite(number) else None


def _json_safe(value: Any) -> Any:
    """Copy of ``value`` with non-finite floats replaced by ``None`` and numpy scalars made plain.

    Recurses into mappings (keys made ``str``), lists and tuples; other values are returned unchanged.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return _finite_or_none(float(value))
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def summary_json(
    runs: Sequence[PolicyRun],
    *,
    trace_name: str,
    slo: SLOSpec,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The machine-readable summary of a replay, written as ``summary.json`` and printed by ``--json``.

    Args:
        runs: one :class:`PolicyRun` per policy, names unique.
        trace_name: the trace's name as the user gave it (file stem or built-in name).
        slo: the SLO the runs were judged against.
        extra: optional additional top-level entries (e.g. the profile name or the replay settings);
            they must not use the keys ``trace``, ``slo`` or ``policies``.

    Returns:
        ``{"trace": str, "slo": {"ttft_ms", "tpot_ms", "percentile"}, "policies": {NAME: {...}}}`` plus the
        keys of ``extra``. Each policy entry holds exactly ``slo_attainment``, ``ttft_attainment`` and
        ``tpot_attainment`` (fractions 0..1), ``goodput_tokens_per_s`` and ``throughput_tokens_per_s``
        (output tokens/s), ``gpu_hours``, ``ttft_p_s`` and ``tpot_p_s`` (seconds, at the SLO percentile),
        ``requests``, ``scale_events``, ``migrations`` (ints; decode requests the simulated router moved, 0
        unless the spec turns ``router.rescheduling`` on) and ``role_changes`` (duty flips of unified instances, 0
        unless the spec turns ``router.roleReassignment`` on), ``wall_s`` (seconds the replay of that policy took),
        ``latency`` — ``{"ttft_s"|"tpot_s"|"e2e_s"|"queue_s": {"p50", "p90", "p99"}, "requests": n}``, seconds,
        over the ``n`` scored requests (arrivals after the warm-up) — and ``slo_infeasible``, a list (empty when
        the plans found both targets in reach, and for planners that do not judge it) of ``{"metric", "target_s",
        "best_s", "at_isl", "at_osl", "tp", "planned_for_s", "intervals", "total_intervals", "first_time_s"}``
        (:class:`fulcrum.replay.result.InfeasibleSLO`). Policies keep the order of ``runs``.

        **Every non-finite float (inf, NaN) is replaced by ``None``** — e.g. ``ttft_p_s`` is ``inf`` when
        more than (100 − percentile) % of the requests were never served — here and inside ``extra``,
        so ``json.dumps(result, allow_nan=False)`` always succeeds (numpy scalars in ``extra`` are turned
        into plain ``int``/``float`` as well).

    Raises:
        ValueError: ``runs`` is empty, two runs share a policy name, or ``extra`` uses a reserved key.
    """
    check_runs(runs)
    policies: dict[str, dict[str, Any]] = {}
    for run in runs:
        s = run.summary
        policies[run.policy] = {
            "slo_attainment": _finite_or_none(s.slo_attainment),
            "ttft_attainment": _finite_or_none(s.ttft_attainment),
            "tpot_attainment": _finite_or_none(s.tpot_attainment),
            "goodput_tokens_per_s": _finite_or_none(s.goodput_tokens_per_s),
            "throughput_tokens_per_s": _finite_or_none(s.throughput_tokens_per_s),
            "gpu_hours": _finite_or_none(s.gpu_hours),
            "ttft_p_s": _finite_or_none(s.ttft_p_s),
            "tpot_p_s": _finite_or_none(s.tpot_p_s),
            "requests": int(s.requests),
            "scale_events": int(s.scale_events),
            "migrations": int(run.migrations),
            "role_changes": int(run.role_changes),
            "wall_s": _finite_or_none(run.wall_s),
            "latency": _json_safe(s.latency.as_dict()),
            "slo_infeasible": [_json_safe(f.as_dict()) for f in run.slo_infeasible],
            "held": ({"intervals": len(run.held), "total_intervals": run.ticks, "first_time_s": run.held[0][0],
                      "first_reason": run.held[0][1]} if run.held else None),
        }
    result: dict[str, Any] = {
        "trace": trace_name,
        "slo": {
            "ttft_ms": _finite_or_none(slo.ttft_ms),
            "tpot_ms": _finite_or_none(slo.tpot_ms),
            "percentile": _finite_or_none(slo.percentile),
        },
        "policies": policies,
    }
    if extra:
        clashes = sorted(_RESERVED_KEYS.intersection(extra))
        if clashes:
            raise ValueError(f"extra must not override the keys {', '.join(clashes)}")
        result.update(_json_safe(dict(extra)))
    return result


def _fmt(value: float, spec: str, scale: float = 1.0) -> str:
    """Format ``value * scale`` with ``spec``; ``inf`` and ``nan`` spelt out (``-inf`` likewise)."""
    number = float(value)
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return format(number * scale, spec)


def comparison_table(runs: Sequence[PolicyRun], slo: SLOSpec, *, trace_name: str) -> str:
    """A plain-text table comparing the policies of one replay, as printed by ``fulcrum replay``.

    The first line names the trace and the SLO; then a header, a rule and one row per policy (in the
    order of ``runs``) with: SLO attainment, TTFT attainment and TPOT attainment (% of requests),
    goodput and throughput (output tokens/s), GPU-hours, TTFT at the SLO percentile (s), TPOT at the
    SLO percentile (ms), scale events and the wall time of the replay (s). Numbers are right-aligned,
    policy names left-aligned; an infinite percentile (too many requests never served) reads ``inf``.
    The text ends with a newline. Metric definitions: DOPD §VI (goodput = tokens/s of requests meeting
    both SLOs).

    Raises:
        ValueError: ``runs`` is empty or two runs share a policy name.
    """
    check_runs(runs)
    pct = percentile_label(slo)
    headers = [
        "policy",
        "SLO %",
        "TTFT %",
        "TPOT %",
        "goodput tok/s",
        "throughput tok/s",
        "GPU-h",
        f"{pct} TTFT s",
        f"{pct} TPOT ms",
        "scale events",
        "wall s",
    ]
    rows: list[list[str]] = []
    for run in runs:
        s = run.summary
        rows.append(
            [
                run.policy,
                _fmt(s.slo_attainment, ".1f", 100.0),
                _fmt(s.ttft_attainment, ".1f", 100.0),
                _fmt(s.tpot_attainment, ".1f", 100.0),
                _fmt(s.goodput_tokens_per_s, ".1f"),
                _fmt(s.throughput_tokens_per_s, ".1f"),
                _fmt(s.gpu_hours, ".2f"),
                _fmt(s.ttft_p_s, ".3f"),
                _fmt(s.tpot_p_s, ".1f", 1000.0),
                str(int(s.scale_events)),
                _fmt(run.wall_s, ".1f"),
            ]
        )
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    title = f"Replay of trace {trace_name!r}: SLO {slo_description(slo)}"
    lines = [title, line(headers), "  ".join("-" * width for width in widths)]
    lines.extend(line(row) for row in rows)
    return "\n".join(lines) + "\n"


def percentiles_table(runs: Sequence[PolicyRun], *, trace_name: str) -> str:
    """A plain-text table of p50/p90/p99 per policy and latency, as ``fulcrum replay --percentiles`` prints it.

    One row per policy and metric — TTFT (s), TPOT (ms), E2E (s), queue (s) — over the scored requests (arrivals
    after each run's ``warmup_s``); the policy name is written on its first row only. Numbers are right-aligned with
    three significant decimals (``.3f`` for seconds, ``.1f`` for ms); a percentile that falls on never-served
    requests reads ``inf``, one with no requests ``nan``. The text ends with a newline.

    Raises:
        ValueError: ``runs`` is empty or two runs share a policy name.
    """
    check_runs(runs)
    headers = ["policy", "metric", "unit", *(f"p{q:g}" for q in PERCENTILES), "requests"]
    rows: list[list[str]] = []
    for run in runs:
        dist = run.summary.latency
        for i, metric in enumerate(METRICS):
            label, unit, factor = METRIC_UNITS[metric]
            p = dist.metric(metric)
            spec = ".1f" if unit == "ms" else ".3f"
            rows.append([run.policy if i == 0 else "", label, unit,
                         *(_fmt(v, spec, factor) for v in (p.p50_s, p.p90_s, p.p99_s)),
                         str(dist.requests) if i == 0 else ""])
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        left = [cell.ljust(width) for cell, width in zip(cells[:3], widths[:3])]
        rest = [cell.rjust(width) for cell, width in zip(cells[3:], widths[3:])]
        return "  ".join([*left, *rest]).rstrip()

    warmups = sorted({run.warmup_s for run in runs})
    since = f"arrivals from t = {warmups[0]:g} s" if len(warmups) == 1 else "arrivals after each run's warm-up"
    lines = [f"Latency percentiles of trace {trace_name!r} over the scored requests ({since})", line(headers),
             "  ".join("-" * width for width in widths)]
    lines.extend(line(row) for row in rows)
    return "\n".join(lines) + "\n"


def infeasible_lines(runs: Sequence[PolicyRun]) -> list[str]:
    """One warning line per policy and SLO target its plans found out of the profile's reach, e.g.
    ``warning: fulcrum: TPOT target 80 ms cannot be met: best 94.2 ms at batch 1 (…) — in 12 of 60 intervals, first
    at t = 420 s``, and one per policy whose control loop held its pools because the planner failed on the load
    (``PolicyRun.held``); empty when none did."""
    lines = [f"warning: {run.policy}: {f.message()}" for run in runs for f in run.slo_infeasible]
    lines += [f"warning: {run.policy}: the pools were held in {len(run.held)} of {run.ticks} intervals, first at "
              f"t = {run.held[0][0]:g} s: {run.held[0][1]}" for run in runs if run.held]
    return lines
