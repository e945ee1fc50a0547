"""Render ``docs/images/dashboard-*.png``: the dashboard's panels drawn with matplotlib from a ``fulcrum replay`` run.

Grafana cannot be installed here, so these are not Grafana screenshots: they show what the panels whose series a
replay produces look like on real data, drawn in Grafana's dark style. The run is ``fulcrum.replay.driver.run_policy``
(the planner loop against the simulated cluster) with the ``fulcrum`` policy on a window of a bundled trace.

Panels and their replay source:
- request rate actual vs forecast with the prediction band: ``PolicyRun.forecasts`` (series ``rate``);
- instances per pool and GPUs over time, scale events marked: ``PolicyRun.timeline`` and ``decisions``;
- P/D ratio planned vs ready: the timeline's planned counts; "ready" is the plan with each scale-out delayed by the
  spec's pod start-up time (how the simulator brings pods up; the timeline does not carry per-pool ready counts);
- TTFT and TPOT p50/p90/p99 per interval against the SLOs, and SLO attainment per interval: ``PolicyRun.records``
  binned by arrival into planner intervals.

Usage: ``python dashboards/render_screenshots.py [--trace azure-conv-2023] [--llmserve FILE] [--start S]
[--duration S] [--out docs/images]`` (about a minute for the default 30-minute window on two cores).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fulcrum.api.llmserve import LLMServeSpec, load_llmserve  # noqa: E402
from fulcrum.ratio.profiles import builtin_profile  # noqa: E402
from fulcrum.replay.driver import ReplayOptions, run_policy  # noqa: E402
from fulcrum.replay.result import PolicyRun  # noqa: E402
from fulcrum.traces import load_trace  # noqa: E402

__all__ = ["render", "main"]

REPO = Path(__file__).resolve().parents[1]
BG, PANEL, GRID, TEXT = "#111217", "#181b1f", "#2c3235", "#ccccdc"
GREEN, YELLOW, BLUE, ORANGE, RED, PURPLE = "#73bf69", "#fade2a", "#5794f2", "#ff9830", "#f2495c", "#b877d9"


def _panel(title: str, width: float = 9.0, height: float = 3.4) -> tuple[plt.Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    fig.patch.set_facecolor(BG)
    ax.set_facecolor(PANEL)
    ax.set_title(title, color=TEXT, loc="left", fontsize=11, fontweight="bold")
    ax.tick_params(which="both", colors=TEXT, labelsize=8)
    for s in ax.spines.values():
        s.set_color(GRID)
    ax.grid(color=GRID, linewidth=0.6)
    ax.set_xlabel("time (min)", color=TEXT, fontsize=8)
    return fig, ax


def _finish(fig: plt.Figure, ax: plt.Axes, path: Path, note: str) -> Path:
    leg = ax.legend(loc="upper left", fontsize=8, facecolor=PANEL, edgecolor=GRID, ncol=4)
    for t in leg.get_texts():
        t.set_color(TEXT)
    fig.text(0.99, 0.01, note, color="#8e8e8e", fontsize=7, ha="right", va="bottom")
    fig.tight_layout()
    fig.savefig(path, facecolor=BG)
    plt.close(fig)
    return path


def _per_interval(run: PolicyRun, tick: float) -> dict[str, np.ndarray]:
    recs = list(run.records)
    end = max(r.arrival_s for r in recs)
    n = int(end // tick) + 1
    bins: list[list] = [[] for _ in range(n)]
    for r in recs:
        bins[int(r.arrival_s // tick)].append(r)
    out: dict[str, list[float]] = {k: [] for k in ("t", "ttft50", "ttft90", "ttft99", "tpot50", "tpot90", "tpot99", "att")}
    return_bins = []
    for i, b in enumerate(bins):
        if not b:
            continue
        return_bins.append(b)
        ttft = np.array([r.ttft_s for r in b])
        tpot = np.array([r.tpot_s for r in b if r.osl > 1])
        out["t"].append((i + 1) * tick)
        for q in (50, 90, 99):
            out[f"ttft{q}"].append(float(np.percentile(ttft[np.isfinite(ttft)], q)) if np.isfinite(ttft).any() else math.nan)
            fin = tpot[np.isfinite(tpot)] if tpot.size else tpot
            out[f"tpot{q}"].append(float(np.percentile(fin, q)) if fin.size else math.nan)
        out["att"].append(0.0)  # filled by the caller (needs the SLO)
    arrays = {k: np.array(v) for k, v in out.items()}
    arrays["_bins"] = np.array(return_bins, dtype=object)
    return arrays


def _ready_counts(times: Sequence[float], planned: Sequence[int], startup_s: float) -> list[int]:
    """Planned counts with each increase taking effect ``startup_s`` later, decreases at once (drain starts):
    ``ready(t) = min(planned(t), planned(t - startup_s))`` over the step function of the plan."""

    def at(t: float) -> int:
        idx = int(np.searchsorted(times, t, side="right")) - 1
        return planned[max(idx, 0)]

    return [min(p, at(t - startup_s)) for t, p in zip(times, planned)]


def render(run: PolicyRun, spec: LLMServeSpec, out: Path, trace_name: str) -> list[Path]:
    """Write the five panel images into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    note = f"fulcrum replay: policy fulcrum, trace {trace_name}, simulated cluster (matplotlib, not Grafana)"
    paths = []
    mins = 60.0

    # request rate, actual vs forecast band
    fc = sorted((f for f in run.forecasts if f.series == "rate"), key=lambda f: (f.time_s, f.made_at_s))
    latest: dict[float, object] = {}
    for f in fc:
        latest[f.time_s] = f  # the latest forecast made for each interval
    pts = [latest[t] for t in sorted(latest)]
    fig, ax = _panel("Request rate: actual vs forecast (req/s)")
    t = np.array([p.time_s for p in pts]) / mins
    ax.fill_between(t, [p.lower for p in pts], [p.upper for p in pts], color=BLUE, alpha=0.25, step="pre", label="forecast band")
    ax.step(t, [p.mean for p in pts], color=BLUE, linestyle="--", where="pre", label="forecast")
    tl = run.timeline
    ax.plot([p.time_s / mins for p in tl], [p.rate_rps for p in tl], color=GREEN, label="actual")
    paths.append(_finish(fig, ax, out / "dashboard-request-rate.png", note))

    # instances and GPUs, scale events
    fig, ax = _panel("Instances per pool and GPUs (scale events marked)")
    tt = [p.time_s / mins for p in tl]
    ax.step(tt, [p.prefill for p in tl], where="post", color=YELLOW, label="prefill")
    ax.step(tt, [p.decode for p in tl], where="post", color=BLUE, label="decode")
    ax.step(tt, [p.unified for p in tl], where="post", color=PURPLE, label="unified")
    ax.step(tt, [p.gpus for p in tl], where="post", color=ORANGE, label="GPUs planned")
    ax.step(tt, [p.ready_gpus for p in tl], where="post", color=ORANGE, linestyle=":", label="GPUs ready")
    for i, d in enumerate(run.decisions):
        ax.axvline(float(d["time_s"]) / mins, color=ORANGE, alpha=0.35, linewidth=1, label="scale event" if i == 0 else None)
    paths.append(_finish(fig, ax, out / "dashboard-instances.png", note))

    # P/D ratio planned vs ready
    fig, ax = _panel("P/D ratio: planned vs ready")
    times = [p.time_s for p in tl]
    startup = float(spec.scaling.pod_startup_seconds)
    rp = _ready_counts(times, [p.prefill for p in tl], startup)
    rd = _ready_counts(times, [p.decode for p in tl], startup)
    planned = [p.prefill / p.decode if p.decode else math.nan for p in tl]
    ready = [a / b if b else math.nan for a, b in zip(rp, rd)]
    ax.step(tt, planned, where="post", color=BLUE, label="planned")
    ax.step(tt, ready, where="post", color=GREEN, linestyle="--", label="ready (plan + pod start-up)")
    paths.append(_finish(fig, ax, out / "dashboard-pd-ratio.png", note))

    # latency quantiles vs SLO, attainment
    tick = float(spec.scaling.interval_seconds)
    per = _per_interval(run, tick)
    ttft_slo, tpot_slo = spec.slo.ttft_ms / 1000.0, spec.slo.tpot_ms / 1000.0
    att = [float(np.mean([(r.ttft_s <= ttft_slo) and (r.tpot_s <= tpot_slo) for r in b])) for b in per["_bins"]]
    ti = per["t"] / mins
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4), dpi=110)
    fig.patch.set_facecolor(BG)
    for ax, key, slo, title in ((axes[0], "ttft", ttft_slo, "TTFT p50 / p90 / p99 vs SLO (s)"),
                                (axes[1], "tpot", tpot_slo, "TPOT p50 / p90 / p99 vs SLO (s)")):
        ax.set_facecolor(PANEL)
        ax.set_title(title, color=TEXT, loc="left", fontsize=11, fontweight="bold")
        ax.tick_params(which="both", colors=TEXT, labelsize=8)
        ax.grid(color=GRID, linewidth=0.6)
        for s in ax.spines.values():
            s.set_color(GRID)
        for q, c in ((50, GREEN), (90, YELLOW), (99, ORANGE)):
            ax.plot(ti, per[f"{key}{q}"], color=c, label=f"p{q}")
        ax.axhline(slo, color=RED, linestyle="--", label="SLO")
        ax.set_xlabel("time (min)", color=TEXT, fontsize=8)
        ax.set_yscale("log")
        leg = ax.legend(loc="upper left", fontsize=8, facecolor=PANEL, edgecolor=GRID, ncol=4)
        for x in leg.get_texts():
            x.set_color(TEXT)
    fig.text(0.99, 0.01, note, color="#8e8e8e", fontsize=7, ha="right", va="bottom")
    fig.tight_layout()
    p = out / "dashboard-latency.png"
    fig.savefig(p, facecolor=BG)
    plt.close(fig)
    paths.append(p)

    fig, ax = _panel("SLO attainment per interval")
    ax.plot(ti, att, color=GREEN, label="attainment")
    ax.axhline(spec.slo.percentile / 100.0, color=RED, linestyle="--", label=f"target P{spec.slo.percentile:g}")
    ax.set_ylim(0, 1.05)
    paths.append(_finish(fig, ax, out / "dashboard-slo-attainment.png", note))
    return paths


def main(argv: list[str] | None = None) -> int:
    """Run the replay and write the images; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv-2023")
    ap.add_argument("--llmserve", default=str(REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml"))
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--out", default=str(REPO / "docs" / "images"))
    args = ap.parse_args(argv)
    spec = load_llmserve(Path(args.llmserve)).spec
    if spec.profile is None or spec.profile.name is None:
        raise SystemExit("the LLMServe must name a built-in profile")
    trace = load_trace(args.trace, None, start_s=args.start, duration_s=args.duration)
    run = run_policy("fulcrum", trace.requests, spec, builtin_profile(spec.profile.name), ReplayOptions())
    s = run.summary
    print(f"replay: {s.requests} requests, SLO attainment {s.slo_attainment:.3f}, {s.scale_events} scale events, "
          f"{s.gpu_hours:.2f} GPU-h")
    for path in render(run, spec, Path(args.out), trace.name):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
