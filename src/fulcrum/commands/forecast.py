"""``fulcrum forecast``: backtest every forecaster on a trace (DOPD §V-D: ARIMA against simple baselines).

Walk-forward one-step forecasts of the per-interval series — ``rate`` (requests/s, counted at arrival),
``isl`` and ``osl`` (mean tokens of the interval's arrivals) — by ARIMA, the baselines (last value, moving
average, seasonal naive) and the selector (``select``: per series, the candidate whose trailing one-step errors beat
the last value's; ``fulcrum.forecast.selector``). Prints the one-step MAPE per series and forecaster, and
fit/forecast times.

Accepts request traces (Azure CSV, Mooncake JSONL, bundled names) and ServeGen's aggregate rate series
(``window_start_s,total_rate_rps,...`` at 10-minute resolution; only ``rate`` exists there, and ``--interval``
must be a multiple of the file's resolution).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fulcrum.api.llmserve import ForecasterSpec
from fulcrum.errors import TraceError
from fulcrum.forecast.backtest import backtest, default_factories
from fulcrum.traces import interval_series, load_rate_series, load_trace

__all__ = ["add_parser", "run", "load_series"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("forecast", help="backtest the forecasters on a trace", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="request trace, bundled trace name, or ServeGen *_aggregate_10min.csv")
    p.add_argument("--interval", type=float, required=True, help="planner interval, seconds")
    p.add_argument("--seed", type=int, help="draw a synthetic trace with this seed (default: its own); an error for "
                   "any other trace")
    p.add_argument("--warmup", type=int, default=8, help="intervals before scoring starts (default 8)")
    p.add_argument("--order", type=int, nargs=3, metavar=("P", "D", "Q"), help="ARIMA order (default 0 1 1)")
    p.add_argument("--window", type=int, help="ARIMA fitting window, intervals (default 64)")
    p.add_argument("--season", type=int, help="season length for seasonal naive, intervals (default: 1 day)")
    p.add_argument("--json", action="store_true", help='print {"series": {SERIES: {FORECASTER: {"mape": ...}}}}')
    p.set_defaults(func=run)


def _is_rate_series(path: Path) -> bool:
    """Whether ``path`` is a ServeGen rate file (its first line names ``total_rate_rps``). A file that cannot be
    read or decompressed is not one: :func:`load_trace` then reports it, naming the file."""
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fb:
            magic = fb.read(2)
        opener: Any = gzip.open if magic == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            head = f.readline()
    except (OSError, EOFError, zlib.error):  # gzip.BadGzipFile is an OSError
        return False
    return "total_rate_rps" in head


#: The most intervals a season may have (ForecasterSpec.season_length's upper bound).
_SEASON_MAX = next(int(m.le) for m in ForecasterSpec.model_fields["season_length"].metadata
                   if getattr(m, "le", None) is not None)

#: The most intervals a backtest may cut a trace into (as many as a season may have): more is a --interval meant in
#: minutes or hours, and would allocate and walk millions of forecasts.
_MAX_INTERVALS = _SEASON_MAX


def load_series(trace: str, interval_s: float, seed: int | None = None) -> tuple[str, dict[str, list[float]], float]:
    """(name, series by name, interval in seconds) for a request trace or a ServeGen rate file; ``seed`` draws a
    synthetic trace at that seed (:func:`fulcrum.traces.load_trace`).

    Raises:
        TraceError: unreadable trace, or an interval that is not a multiple of a rate file's resolution; a seed
            for a trace that is not synthetic.
        ValueError: an interval that cuts a request trace into more than :data:`_MAX_INTERVALS` intervals.
    """
    path = Path(trace)
    if _is_rate_series(path):
        if seed is not None:
            raise TraceError(f"{path}: a seed applies only to a synthetic trace, not to a rate file")
        rs = load_rate_series(path)
        k = interval_s / rs.interval_s
        if k < 1 or abs(k - round(k)) > 1e-9:
            raise TraceError(f"{path}: --interval {interval_s:g} s must be a multiple of the file's {rs.interval_s:g} s")
        k = int(round(k))
        vals = list(rs.values)
        rate = []
        for i in range(0, len(vals) - k + 1, k):
            chunk = [v for v in vals[i : i + k] if not math.isnan(v)]
            rate.append(sum(chunk) / len(chunk) if chunk else math.nan)
        return rs.name, {"rate": rate}, interval_s
    tr = load_trace(trace, seed=seed)
    span = max((r.arrival_s for r in tr.requests), default=0.0)
    if span / interval_s + 1 > _MAX_INTERVALS:  # before interval_series allocates them
        raise ValueError(f"--interval {interval_s:g} s cuts {tr.name}'s {span:g} s of arrivals into "
                         f"{int(span // interval_s) + 1} intervals, more than {_MAX_INTERVALS}: pass a longer --interval")
    return tr.name, interval_series(tr.requests, interval_s), interval_s


#: ForecasterSpec field → the flag that sets it, for one-line errors.
_FLAGS = {"order": "--order", "window": "--window", "season_length": "--season"}


def _spec(args: argparse.Namespace, interval_s: float) -> ForecasterSpec:
    """The forecasters' settings from the flags (the ``LLMServe`` field's bounds apply).

    Raises:
        ValueError: a flag out of its field's bounds; the message names the flag, e.g. ``--window: Input should be
            greater than or equal to 4, got 1``.
    """
    kw: dict[str, Any] = {}
    if args.order is not None:
        kw["order"] = tuple(args.order)
    if args.window is not None:
        kw["window"] = args.window
    kw["season_length"] = args.season if args.season is not None else max(2, int(round(86_400 / interval_s)))
    most = _SEASON_MAX
    if args.season is None and kw["season_length"] > most:  # the default season: name the flag that made it
        raise ValueError(
            f"--interval {interval_s:g} s makes the default season (one day) {kw['season_length']} intervals, "
            f"more than {most}: pass --season or a longer --interval"
        )
    try:
        return ForecasterSpec(**kw)
    except ValidationError as err:
        raise ValueError("; ".join(
            f"{_FLAGS.get(str(e['loc'][0]), e['loc'][0]) if e['loc'] else 'forecaster'}: {e['msg']}, "
            f"got {e.get('input')!r}" for e in err.errors()
        )) from err


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise ValueError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0 intervals, got {args.warmup}")
    name, series, interval = load_series(args.trace, args.interval, args.seed)
    spec = _spec(args, interval)
    n = max((len(v) for v in series.values()), default=0)
    if n <= args.warmup:
        raise ValueError(f"{name}: {n} intervals of {interval:g} s, and the first {args.warmup} are the warm-up "
                         "(--warmup): no forecast is scored; pass a shorter --interval or a smaller --warmup")
    results: dict[str, dict[str, Any]] = {}
    for sname, values in series.items():
        scores = backtest(values, default_factories(spec), warmup=args.warmup)
        results[sname] = {
            f: {"mape": s.mape, "points": s.points, "fit_seconds": s.fit_seconds,
                "forecast_ms_p50": s.forecast_ms_p50, "forecast_ms_p99": s.forecast_ms_p99}
            for f, s in scores.items()
        }
    if args.json:
        clean = {s: {f: {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
                     for f, d in fs.items()} for s, fs in results.items()}
        print(json.dumps({"trace": name, "interval_s": interval, "series": clean}, indent=2, allow_nan=False))
        return 0
    print(f"trace {name}: {n} intervals of {interval:g} s; one-step MAPE (lower is better)")
    forecasters = list(next(iter(results.values())).keys()) if results else []
    print(f"{'series':<8}" + "".join(f"{f:>16}" for f in forecasters))
    for sname, fs in results.items():
        cells = "".join(f"{fs[f]['mape'] * 100:>15.1f}%" if math.isfinite(fs[f]["mape"]) else f"{'n/a':>16}" for f in forecasters)
        print(f"{sname:<8}{cells}")
    print()
    print(f"{'times':<8}" + "".join(f"{f:>16}" for f in forecasters))
    for sname, fs in results.items():
        cells = "".join(f"{fs[f]['fit_seconds']:>7.2f}s {fs[f]['forecast_ms_p99']:>5.1f}ms" for f in forecasters)
        print(f"{sname:<8}{cells}   (total fit time, p99 per step)")
    return 0
