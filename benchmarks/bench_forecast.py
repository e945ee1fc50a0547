"""Cost and accuracy of the load forecasters (DOPD §V-D: refit O(N·(p+q)²), retained model O(p+q)).

Run: ``python benchmarks/bench_forecast.py [--steps 300] [--window 64]``

Measures, in one run and on the same series, per planner interval (``observe`` of the new value followed by a
one-step ``forecast``):

- ``LastValue`` — the baseline figure;
- ``ArimaForecaster`` on its cheap path (parameters kept, one Kalman-filter step), steps without a refit;
- ``ArimaForecaster`` forced to refit at every step (``refit_error`` ≈ 0, ``error_points=1``): a full
  maximum-likelihood fit on ``window`` points.

and prints p50/p99 milliseconds and the ratio to the baseline's p50, then the one-step walk-forward MAPE of
each method. The series is the ServeGen M-large 10-minute rate (``/work/shared/data/servegen``) when present,
else a synthetic AR(1) series (printed in the header).
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fulcrum.api import ForecasterSpec
from fulcrum.forecast import ArimaForecaster, LastValue, SeriesForecaster, backtest, default_factories

SERVEGEN = Path("/work/shared/data/servegen/servegen_m-large_aggregate_10min.csv")


def load_series(points: int) -> tuple[str, list[float]]:
    """The ServeGen rate series (requests/s) if available, else a seeded AR(1) series around 100."""
    if SERVEGEN.exists():
        with SERVEGEN.open(newline="") as fh:
            values = [float(r["total_rate_rps"]) for r in csv.DictReader(fh)]
        return f"ServeGen m-large 10-min rate ({SERVEGEN.name})", values[:points]
    rng = np.random.default_rng(0)
    x = np.zeros(points)
    for t in range(1, points):
        x[t] = 0.7 * x[t - 1] + rng.normal(0.0, 10.0)
    return "synthetic AR(1), phi=0.7, sigma=10, level=100", list(100.0 + x)


def time_steps(
    make: Callable[[], SeriesForecaster], values: list[float], warm: int
) -> tuple[np.ndarray, np.ndarray, SeriesForecaster]:
    """Per-step milliseconds of observe(v) + forecast(1) after ``warm`` untimed values, and whether each step
    refitted (the forecaster's ``refits`` counter moved; always False for baselines)."""
    f = make()
    for v in values[:warm]:
        f.observe(v)
    out, refitted = [], []
    for v in values[warm:]:
        before = getattr(f, "refits", 0)
        start = time.perf_counter()
        f.observe(v)
        f.forecast(1)
        out.append((time.perf_counter() - start) * 1e3)
        refitted.append(getattr(f, "refits", 0) != before)
    return np.asarray(out), np.asarray(refitted, dtype=bool), f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant (>= 200 recommended)")
    parser.add_argument("--window", type=int, default=64, help="ARIMA window N")
    args = parser.parse_args()
    warm = 2 * args.window
    label, values = load_series(warm + args.steps)
    spec = ForecasterSpec(window=args.window)
    print(f"series: {label}; {len(values)} points, {warm} untimed warm-up, {len(values) - warm} timed steps")
    print(f"ARIMA order {spec.order}, window {spec.window}, refit_error {spec.refit_error}\n")

    base, _, _ = time_steps(LastValue, values, warm)
    default_ms, refitted, arima = time_steps(
        lambda: ArimaForecaster(spec.order, spec.window, spec.refit_error), values, warm
    )
    cheap = default_ms[~refitted]  # the default forecaster's steps without a refit
    forced, _, forced_f = time_steps(
        lambda: ArimaForecaster(spec.order, spec.window, refit_error=1e-9, error_points=1), values, warm
    )
    assert isinstance(arima, ArimaForecaster) and isinstance(forced_f, ArimaForecaster)

    b50 = float(np.percentile(base, 50))
    rows = [
        ("last value: observe + forecast", base),
        ("arima cheap update + forecast", cheap),
        ("arima refit + forecast", forced),
    ]
    print(f"{'per interval':<34}{'steps':>7}{'p50 ms':>10}{'p99 ms':>10}{'p50 / last value':>19}")
    for name, ms in rows:
        p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
        print(f"{name:<34}{ms.size:>7}{p50:>10.3f}{p99:>10.3f}{p50 / b50:>18.0f}x")
    print(
        f"\ndefault ARIMA: {int(refitted.sum())} of {refitted.size} timed steps refitted; over the whole run "
        f"{arima.refits} refits, {arima.cheap_updates} cheap updates, {arima.fit_failures} fit failures; "
        f"forced variant: {forced_f.refits} refits"
    )

    print("\none-step walk-forward MAPE over the whole series (warm-up 8):")
    for name, score in backtest(values, default_factories(spec)).items():
        print(
            f"  {name:<16} MAPE {score.mape:.4f}  points {score.points}  observe total {score.fit_seconds:.2f} s  "
            f"forecast p50 {score.forecast_ms_p50:.3f} ms"
        )


if __name__ == "__main__":
    main()
