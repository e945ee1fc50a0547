"""The replay report: PNG plots, ``summary.json`` and ``comparison.txt`` for a set of policy runs.

Plots are drawn with matplotlib's object-oriented API (:class:`matplotlib.figure.Figure` saved through
the Agg canvas): importing this module, or writing a report, never touches ``pyplot`` or a GUI backend,
so it works on headless machines and in threads.

Figures (one colour per policy, the same in every figure):

- ``gpus_over_time.png`` — GPUs provisioned per policy over time, request rate on a twin axis
  (as DOPD §VI, Figure 10);
- ``forecast_vs_actual.png`` — rate, ISL and OSL per interval: actual, forecast mean and prediction band
  (DOPD §II-A / Alg. 2 l.5–9); written only when some policy produced forecasts;
- ``latency_cdf.png`` — TTFT and TPOT CDFs of the scored requests (after the warm-up, like the table) with the SLO
  targets;
- ``pools_over_time.png`` — prefill / decode / unified instances per policy;
- ``latency_ttft.png``, ``latency_tpot.png``, ``latency_e2e.png``, ``latency_queue.png`` — one per latency
  (:mod:`fulcrum.replay.distribution`): the CDF of every policy over the scored requests (arrivals after the
  warm-up) on a log axis, dotted lines at the 0.5/0.9/0.99 quantiles and the policy's p50/p90/p99 marked on its
  curve, so the percentiles of the ``--percentiles`` table can be read off the figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter, MaxNLocator

from fulcrum.api import SLOSpec
from fulcrum.replay.distribution import (
    METRIC_NAMES,
    METRIC_UNITS,
    METRICS,
    PERCENTILES,
    LatencyMetric,
    metric_values,
    scored_records,
)
from fulcrum.replay.result import ForecastPoint, PolicyRun
from fulcrum.replay.table import check_runs, comparison_table, percentile_label, percentiles_table, summary_json

__all__ = [
    "write_report",
    "empirical_cdf",
    "GPUS_PNG",
    "FORECAST_PNG",
    "LATENCY_CDF_PNG",
    "POOLS_PNG",
    "SUMMARY_JSON",
    "COMPARISON_TXT",
    "METRIC_PNGS",
]

GPUS_PNG = "gpus_over_time.png"
FORECAST_PNG = "forecast_vs_actual.png"
LATENCY_CDF_PNG = "latency_cdf.png"
POOLS_PNG = "pools_over_time.png"
SUMMARY_JSON = "summary.json"
COMPARISON_TXT = "comparison.txt"
#: One distribution plot per latency metric.
METRIC_PNGS: dict[LatencyMetric, str] = {m: f"latency_{m}.png" for m in METRICS}

_DPI = 110
# (ForecastPoint.series, panel name, y label)
_SERIES: tuple[tuple[str, str, str], ...] = (
    ("rate", "request rate", "request rate (req/s)"),
    ("isl", "ISL", "mean ISL (tokens)"),
    ("osl", "OSL", "mean OSL (tokens)"),
)
# (colour, line style, width): decode dashed and thinner, drawn over prefill, so equal counts stay visible.
_ROLE_STYLES: dict[str, tuple[str, str, float]] = {
    "prefill": ("tab:blue", "-", 2.6),
    "decode": ("tab:orange", "--", 1.6),
    "unified": ("tab:green", "-", 2.0),
}

FloatArray = npt.NDArray[np.float64]


def _finite(values: Sequence[float]) -> FloatArray:
    """``values`` as a float array with inf/-inf/NaN turned into NaN (drawn as gaps, ignored by autoscale)."""
    array = np.asarray(values, dtype=float)
    return np.where(np.isfinite(array), array, np.nan)


def _policy_colours(runs: Sequence[PolicyRun]) -> dict[str, str]:
    """A stable colour per policy: matplotlib's default cycle C0..C9 (repeats beyond ten policies)."""
    return {run.policy: f"C{index % 10}" for index, run in enumerate(runs)}


def _time_unit(runs: Sequence[PolicyRun]) -> tuple[float, str]:
    """(divisor, label) that keeps the time axis readable: seconds, minutes or hours by the span."""
    span = 0.0
    for run in runs:
        for point in run.timeline:
            span = max(span, point.time_s)
        for fc in run.forecasts:
            span = max(span, fc.time_s)
    if span > 3 * 3600.0:
        return 3600.0, "h"
    if span > 20 * 60.0:
        return 60.0, "min"
    return 1.0, "s"


def _new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format="png", dpi=_DPI)
    return path


def _note(ax: Axes, text: str) -> None:
    """Write ``text`` in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _plot_gpus(runs: Sequence[PolicyRun], colours: dict[str, str], trace_name: str, path: Path) -> Path:
    """GPUs provisioned (left axis, solid steps) and request rate (right axis, dashed): DOPD Fig. 10."""
    divisor, unit = _time_unit(runs)
    figure = _new_figure(11.0, 5.0)
    ax = figure.add_subplot()
    handles: list[Line2D] = []
    for run in runs:
        if not run.timeline:
            continue
        t = np.array([p.time_s for p in run.timeline]) / divisor
        gpus = np.array([p.gpus for p in run.timeline], dtype=float)
        (line,) = ax.step(t, gpus, where="post", color=colours[run.policy], linewidth=1.8, label=f"{run.policy} GPUs")
        handles.append(line)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("GPUs provisioned")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    rate_run = next((run for run in runs if run.timeline), None)
    if rate_run is None:
        _note(ax, "no policy recorded a timeline")
    else:
        rate_ax = ax.twinx()
        t = np.array([p.time_s for p in rate_run.timeline]) / divisor
        rate = _finite([p.rate_rps for p in rate_run.timeline])
        (rate_line,) = rate_ax.plot(t, rate, linestyle="--", color="black", alpha=0.6, linewidth=1.2, label="request rate")
        rate_ax.set_ylabel("request rate (req/s)")
        rate_ax.set_ylim(bottom=0)
        handles.append(rate_line)
        figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize="small")
    ax.set_title(f"GPUs provisioned and request rate over time — trace {trace_name}")
    return _save(figure, path)


def _latest_per_interval(points: Sequence[ForecastPoint]) -> list[ForecastPoint]:
    """One forecast per target interval (the one made last), sorted by the interval's end."""
    chosen: dict[float, ForecastPoint] = {}
    for point in points:
        kept = chosen.get(point.time_s)
        if kept is None or point.made_at_s >= kept.made_at_s:
            chosen[point.time_s] = point
    return [chosen[t] for t in sorted(chosen)]


def _plot_forecasts(
    runs: Sequence[PolicyRun], colours: dict[str, str], trace_name: str, path: Path
) -> Path | None:
    """Three stacked panels (rate, ISL, OSL): actual, forecast mean and band per forecasting policy.

    Returns ``None`` (and writes nothing) when no run has forecasts.
    """
    with_forecasts = [run for run in runs if run.forecasts]
    if not with_forecasts:
        return None
    divisor, unit = _time_unit(runs)
    figure = _new_figure(11.0, 8.5)
    axes = figure.subplots(len(_SERIES), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (series, name, label) in zip(axes, _SERIES):
        actual: dict[float, float] = {}
        drawn = False
        for run in with_forecasts:
            points = _latest_per_interval([p for p in run.forecasts if p.series == series])
            if not points:
                continue
            drawn = True
            t = np.array([p.time_s for p in points]) / divisor
            colour = colours[run.policy]
            ax.fill_between(
                t,
                _finite([p.lower for p in points]),
                _finite([p.upper for p in points]),
                color=colour,
                alpha=0.18,
                linewidth=0,
                label=f"{run.policy} prediction band",
            )
            ax.plot(
                t,
                _finite([p.mean for p in points]),
                color=colour,
                linestyle="--",
                linewidth=1.4,
                marker="x" if len(points) <= 60 else None,
                markersize=4,
                label=f"{run.policy} forecast",
            )
            for p in points:
                actual.setdefault(p.time_s, p.actual)
        if drawn:
            times = sorted(actual)
            marker = "o" if len(times) <= 60 else None
            ax.plot(
                np.array(times) / divisor,
                _finite([actual[t] for t in times]),
                color="black",
                linewidth=1.2,
                marker=marker,
                markersize=3,
                label="actual",
            )
        else:
            _note(ax, f"no forecasts of {name}")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(f"end of interval ({unit})")
    labelled = next((ax for ax in axes if ax.get_legend_handles_labels()[0]), None)
    if labelled is not None:
        handles, labels = labelled.get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", ncols=len(with_forecasts) + 1, fontsize="small")
    figure.suptitle(f"Forecast vs actual per interval — trace {trace_name}")
    return _save(figure, path)


class _PlainLogFormatter(LogFormatter):
    """Log-axis labels as plain numbers (``0.1``, ``2``, ``80``); which ticks get a label is LogFormatter's choice."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def empirical_cdf(values: Sequence[float], scale: float = 1.0) -> tuple[FloatArray, FloatArray, int, int]:
    """The empirical CDF drawn in ``latency_cdf.png``, with never-served requests kept in the denominator.

    Args:
        values: latencies of all requests, seconds (``inf`` or NaN = never served / unfinished).
        scale: factor applied to x (1000 for milliseconds).

    Returns:
        ``(x, y, n_beyond, n)``: ``x`` the sorted finite **positive** values × ``scale`` (shape ``(k,)``),
        ``y`` their cumulative share of **all** ``n`` values (shape ``(k,)``, so the curve ends at
        ``1 − n_beyond / n`` when some requests have infinite times), ``n_beyond`` the count of
        non-finite values and ``n = len(values)``. Zeros (e.g. TPOT of one-token outputs) count in ``y``
        but are not in ``x``, since the plot's axis is logarithmic.
    """
    array = np.asarray(values, dtype=float)
    n = int(array.size)
    finite = np.sort(array[np.isfinite(array)])
    n_beyond = n - int(finite.size)
    y = np.arange(1, finite.size + 1, dtype=float) / max(n, 1)
    keep = finite > 0
    return finite[keep] * scale, y[keep], n_beyond, n


def _step_cdf(ax: Axes, x: FloatArray, y: FloatArray, n: int, colour: str, label: str) -> bool:
    """Draw one policy's empirical CDF (``x``, ``y`` from :func:`empirical_cdf`, ``n`` values) as a step curve that
    rises at the first drawn value from the share below it (zeros included); with nothing drawable (every value
    beyond the axis), only the legend entry. Whether a curve was drawn."""
    if not x.size:
        ax.plot([], [], color=colour, label=label)
        return False
    xs = np.concatenate([x[:1], x])
    ys = np.concatenate([y[:1] - 1.0 / n, y])
    ax.step(xs, ys, where="post", color=colour, linewidth=1.6, label=label)
    return True


def _plain_log_x(ax: Axes) -> None:
    """A log x axis labelled in plain numbers (0.5, 2, 80) rather than 10^x: latency targets are read off it."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
    ax.xaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.6)))


def _plot_cdf_panel(
    ax: Axes,
    runs: Sequence[PolicyRun],
    colours: dict[str, str],
    *,
    attribute: str,
    scale: float,
    target: float,
    unit: str,
    name: str,
) -> None:
    drawn = False
    for run in runs:
        values = [float(getattr(record, attribute)) for record in scored_records(run.records, run.warmup_s)]
        x, y, n_beyond, n = empirical_cdf(values, scale)
        if n == 0:
            continue
        label = f"{run.policy} ({n_beyond}/{n} beyond axis)" if n_beyond else run.policy
        drawn = _step_cdf(ax, x, y, n, colours[run.policy], label) or drawn
    ax.axvline(target, color="red", linestyle=":", linewidth=1.5, label=f"SLO {target:g} {unit}")
    if drawn:
        _plain_log_x(ax)
    else:
        _note(ax, "no finite positive values")  # zeros (one-token outputs' TPOT) are finite but off a log axis
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel(f"{name} ({unit}, log scale)" if drawn else f"{name} ({unit})")
    ax.set_ylabel("fraction of scored requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small", framealpha=0.85)


def _plot_cdfs(
    runs: Sequence[PolicyRun], colours: dict[str, str], trace_name: str, slo: SLOSpec, path: Path
) -> Path:
    """TTFT (s) and TPOT (ms) CDFs per policy over its scored requests (arrivals after its ``warmup_s``, as the
    table counts them), red dotted lines at the SLO targets."""
    figure = _new_figure(12.0, 5.0)
    ttft_ax, tpot_ax = figure.subplots(1, 2, squeeze=True)
    _plot_cdf_panel(ttft_ax, runs, colours, attribute="ttft_s", scale=1.0, target=slo.ttft_ms / 1000.0, unit="s", name="TTFT")
    _plot_cdf_panel(tpot_ax, runs, colours, attribute="tpot_s", scale=1000.0, target=slo.tpot_ms, unit="ms", name="TPOT")
    ttft_ax.set_title("Time to first token")
    tpot_ax.set_title("Time per output token")
    figure.suptitle(
        f"Latency CDFs — trace {trace_name}, SLO at {percentile_label(slo)}\n"
        "requests never served / unfinished (infinite time) lie beyond the axis: their curve ends below 1",
        fontsize="medium",
    )
    return _save(figure, path)


def _plot_metric(runs: Sequence[PolicyRun], colours: dict[str, str], trace_name: str, slo: SLOSpec,
                 metric: LatencyMetric, path: Path) -> Path:
    """The CDF of ``metric`` for every policy over its scored requests, p50/p90/p99 marked (module doc)."""
    label, unit, factor = METRIC_UNITS[metric]
    figure = _new_figure(9.0, 5.5)
    ax = figure.add_subplot()
    drawn = False
    for run in runs:
        values = metric_values(scored_records(run.records, run.warmup_s), metric)
        x, y, n_beyond, n = empirical_cdf(list(values), factor)
        if n == 0:
            continue
        p = run.summary.latency.metric(metric)
        marks = [(q / 100.0, v * factor) for q, v in zip(PERCENTILES, (p.p50_s, p.p90_s, p.p99_s))
                 if math.isfinite(v) and v > 0]
        name = f"{run.policy} (p50/p90/p99 " + "/".join(
            _num(v, factor) for v in (p.p50_s, p.p90_s, p.p99_s)) + f" {unit}"
        name += f"; {n_beyond}/{n} beyond axis)" if n_beyond else ")"
        if _step_cdf(ax, x, y, n, colours[run.policy], name):
            if marks:
                ax.plot([m[1] for m in marks], [m[0] for m in marks], linestyle="none", marker="o", markersize=5,
                        color=colours[run.policy])
            drawn = True
    for q in PERCENTILES:
        ax.axhline(q / 100.0, color="0.5", linestyle=":", linewidth=1.0)
    target = {"ttft": slo.ttft_ms / 1000.0, "tpot": slo.tpot_ms}.get(metric)
    if target is not None:
        ax.axvline(target, color="red", linestyle=":", linewidth=1.5, label=f"SLO {target:g} {unit}")
    if drawn:
        _plain_log_x(ax)
    else:
        _note(ax, "no finite positive values")
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel(f"{label} ({unit}{', log scale' if drawn else ''})")
    ax.set_ylabel("fraction of scored requests")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to name when no policy has a scored request and no SLO applies
        ax.legend(loc="lower right", fontsize="small", framealpha=0.85)
    ax.set_title(f"{label}: {METRIC_NAMES[metric]}, per policy — trace {trace_name}\n"
                 "dots: p50 / p90 / p99; requests never served lie beyond the axis", fontsize="medium")
    return _save(figure, path)


def _num(value_s: float, factor: float) -> str:
    v = float(value_s) * factor
    return f"{v:.3g}" if math.isfinite(v) else ("inf" if v > 0 else "nan")


def _plot_pools(runs: Sequence[PolicyRun], trace_name: str, path: Path) -> Path:
    """One panel per policy: prefill, decode and unified instances (provisioned) over time, as steps."""
    divisor, unit = _time_unit(runs)
    figure = _new_figure(11.0, 1.0 + 2.2 * len(runs))
    axes = figure.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        ax.set_title(run.policy, fontsize="medium", loc="left")
        ax.set_ylabel("instances")
        ax.grid(True, alpha=0.3)
        if not run.timeline:
            _note(ax, "no timeline recorded")
            continue
        t = np.array([p.time_s for p in run.timeline]) / divisor
        drawn = False
        for role, (colour, style, width) in _ROLE_STYLES.items():
            counts = np.array([getattr(p, role) for p in run.timeline], dtype=float)
            if not np.any(counts):
                continue
            ax.step(t, counts, where="post", color=colour, linestyle=style, linewidth=width, label=role)
            drawn = True
        if drawn:
            ax.set_ylim(bottom=0)
            ax.set_ylim(0, math.ceil(ax.get_ylim()[1]) + 0.5)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(loc="upper left", fontsize="small", ncols=3, framealpha=0.85)
        else:
            _note(ax, "no instances at any time")
    axes[-1].set_xlabel(f"time ({unit})")
    figure.suptitle(f"Instances per pool over time — trace {trace_name}")
    return _save(figure, path)


def write_report(runs: Sequence[PolicyRun], out_dir: Path, *, trace_name: str, slo: SLOSpec,
                 extra: dict[str, Any] | None = None) -> list[Path]:
    """Write the replay report of ``runs`` into ``out_dir`` (created if missing) and return the paths.

    Files, in this order: ``gpus_over_time.png``, ``forecast_vs_actual.png`` (only when at least one run
    has forecasts; runs without forecasts are left out of it), ``latency_cdf.png``,
    ``pools_over_time.png``, ``latency_ttft.png``, ``latency_tpot.png``, ``latency_e2e.png``,
    ``latency_queue.png`` (:data:`METRIC_PNGS`), ``summary.json`` (:func:`fulcrum.replay.table.summary_json` with
    ``extra``'s top-level entries — ``fulcrum replay`` passes those it prints with ``--json``, so the file is
    that output; non-finite numbers as ``null``) and ``comparison.txt`` (:func:`fulcrum.replay.table.comparison_table`, a
    blank line, then :func:`fulcrum.replay.table.percentiles_table`).
    Existing files of those names are overwritten; nothing else in ``out_dir`` is touched.

    Conventions: times on the x axes in s, min or h by the trace span; the request rate drawn on the GPU
    plot is the ``rate_rps`` of the first run with a timeline; the actual values in the forecast plot are
    those the forecasting runs recorded for each interval; when several forecasts target the same
    interval the one made last is drawn. Latency CDFs count requests with infinite TTFT/TPOT in the
    denominator (their curves end below 1 and the legend says how many are beyond the axis).

    Raises:
        ValueError: ``runs`` is empty, two runs share a policy name, or ``extra`` uses a key of
            :func:`fulcrum.replay.table.summary_json`'s own (``trace``, ``slo``, ``policies``).
        OSError: ``out_dir`` cannot be created or written.
    """
    check_runs(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = _policy_colours(runs)
    written: list[Path] = [_plot_gpus(runs, colours, trace_name, out_dir / GPUS_PNG)]
    forecast = _plot_forecasts(runs, colours, trace_name, out_dir / FORECAST_PNG)
    if forecast is not None:
        written.append(forecast)
    written.append(_plot_cdfs(runs, colours, trace_name, slo, out_dir / LATENCY_CDF_PNG))
    written.append(_plot_pools(runs, trace_name, out_dir / POOLS_PNG))
    for metric, name in METRIC_PNGS.items():
        written.append(_plot_metric(runs, colours, trace_name, slo, metric, out_dir / name))
    summary_path = out_dir / SUMMARY_JSON
    summary = summary_json(runs, trace_name=trace_name, slo=slo, extra=extra)
    summary_path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    written.append(summary_path)
    table_path = out_dir / COMPARISON_TXT
    table_path.write_text(comparison_table(runs, slo, trace_name=trace_name) + "\n"
                          + percentiles_table(runs, trace_name=trace_name), encoding="utf-8")
    written.append(table_path)
    return written
