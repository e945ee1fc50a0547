"""Cost of one planner cycle (observe → forecast → plan → scale) per LLMServe, on real observations.

Run: ``python benchmarks/bench_planner_cycle.py [--cycles 300] [--trace azure-conv-2023] [--llmserve FILE ...]``

One cycle is one ``planner.step(observation, current)`` — what the operator runs every
``spec.scaling.intervalSeconds`` for each ``LLMServe`` (DESIGN: the loop; DOPD Alg. 2 lines 3–15). The
observations are real: the Azure LLM conversation trace of 2023 is replayed once through the simulator under
the ``fulcrum`` planner (the loop of ``fulcrum replay``), and the ``Observation`` of every 60-s tick is kept.
The timed run then feeds that sequence, repeated (times shifted so that the clock only moves forward) until
``--cycles`` steps, to a fresh planner — so the ARIMA refits (when its error grows past ``refitError``, and the
safety-net refits) fall inside the timed cycles, as they would in a cluster.

Rows per LLMServe (the example specs with a built-in profile, unless ``--llmserve`` names others):

- ``fulcrum / select``: Fulcrum's planner with ``forecaster.method = select`` (the per-series model selection of
  ``fulcrum.forecast.selector``: ARIMA, ETS and baselines side by side, refits staggered across series);
- ``fulcrum / arima``: the same planner with ``forecaster.method = arima``;
- ``fulcrum / last_value``: the same planner with ``forecaster.method = last_value`` — the baseline, measured
  in the same run: the ratios show what the model forecasters cost;
- ``dopd / arima``: the DOPD Alg. 2 reference planner (always ARIMA, point forecast).

Targets: DOPD says its planning step is "well under 1 s"; Fulcrum's aim is p99 ≤ 50 ms per cycle with the
ARIMA update included.

BLAS threads: the ARIMA fits multiply matrices of a few dozen elements, where OpenBLAS threads only add
hand-offs; on a shared or oversubscribed CPU their spin-waiting made single fits 10–100× slower in the
development runs. The operator runs with one BLAS thread, so this benchmark sets ``OPENBLAS_NUM_THREADS``
(and the OpenMP/MKL equivalents) to ``--blas-threads`` (default 1) before NumPy is imported; ``0`` leaves the
environment as it is.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily in main(), after the BLAS thread count is set
    from fulcrum.api.llmserve import LLMServeSpec
    from fulcrum.observation import Observation
    from fulcrum.ratio.profile import PerformanceProfile
    from fulcrum.scaling.planner import Planner

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = (
    REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml",
    REPO / "examples" / "llmserve-auto.yaml",
)
TARGET_P99_MS = 50.0
_BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class Timing:
    """Per-cycle wall times of one planner over the timed sequence."""

    spec: str
    planner: str
    forecaster: str
    ms: list[float]
    refitted: list[bool]  # per cycle: whether at least one ARIMA series refitted in it
    refits: int  # model refits (ARIMA, ETS) over the timed cycles, all series

    @property
    def refit_cycles(self) -> int:
        """Cycles in which at least one ARIMA series refitted."""
        return sum(self.refitted)

    def split(self) -> tuple[list[float], list[float]]:
        """(milliseconds of the cycles with a refit, of those without)."""
        return ([m for m, r in zip(self.ms, self.refitted) if r], [m for m, r in zip(self.ms, self.refitted) if not r])


def record_observations(
    spec: LLMServeSpec, profile: PerformanceProfile, trace: str
) -> list[Observation]:
    """The observation of every tick when ``trace`` is replayed under the ``fulcrum`` planner.

    The loop of :func:`fulcrum.replay.driver.run_policy`: ``run_until`` the tick, then
    :meth:`~fulcrum.scaling.loop.ControlLoop.run_interval` on the simulator (observe, step, apply). Returns one
    :class:`~fulcrum.observation.Observation` per tick (``ceil(span / tick) + 1``).
    """
    from fulcrum.scaling.fulcrum import FulcrumPlanner
    from fulcrum.scaling.loop import ControlLoop
    from fulcrum.simulator import SimConfig, Simulation
    from fulcrum.traces import load_trace

    requests = load_trace(trace).requests
    planner = FulcrumPlanner(spec, profile)
    current = planner.initial()
    sim = Simulation(requests, profile, spec.slo, current, SimConfig(pod_startup_s=spec.scaling.pod_startup_seconds))
    loop = ControlLoop(spec, profile, current, planner=planner)
    tick = planner.tick_s
    out: list[Observation] = []
    for k in range(1, int(math.ceil(requests[-1].arrival_s / tick)) + 2):
        sim.run_until(k * tick)
        obs = loop.run_interval(sim).observation
        assert obs is not None  # the simulator always observes
        out.append(obs)
    return out


def repeated(observations: Sequence[Observation], cycles: int) -> list[Observation]:
    """``cycles`` observations: the sequence repeated, each pass shifted by its span so time moves forward."""
    n, span = len(observations), observations[-1].time_s
    out = []
    for i in range(cycles):
        passes, obs = divmod(i, n)
        out.append(replace(observations[obs], time_s=observations[obs].time_s + passes * span))
    return out


def _arima_refits(planner: Any) -> int:
    """Sum of the ``refits`` counters of the planner's series forecasters (ARIMA; select: its ARIMA and ETS
    candidates; 0 for the baselines)."""
    fc = getattr(planner, "forecaster", None)
    if fc is None:
        return 0
    return sum(int(getattr(getattr(fc, s, None), "refits", 0)) for s in ("rate", "isl", "osl", "concurrency"))


def time_cycles(make: Callable[[], Planner], observations: Sequence[Observation]) -> tuple[list[float], list[bool], int]:
    """Milliseconds of each ``step`` of a fresh planner over ``observations``, whether each refitted, refits."""
    planner = make()
    current = planner.initial()
    ms: list[float] = []
    refitted: list[bool] = []
    refits = 0
    for obs in observations:
        before = _arima_refits(planner)
        t0 = time.perf_counter()
        decision = planner.step(obs, current)
        dt = (time.perf_counter() - t0) * 1e3
        ms.append(dt)
        moved = _arima_refits(planner) - before
        refitted.append(moved > 0)
        refits += moved
        current = decision.target
    return ms, refitted, refits


def bench_spec(path: Path, trace: str, cycles: int) -> list[Timing]:
    """The three rows of one LLMServe (module doc)."""
    from fulcrum.api.llmserve import ForecasterMethod, load_llmserve
    from fulcrum.ratio.profiles import builtin_profile, resolve_profile
    from fulcrum.scaling.dopd import DopdPlanner
    from fulcrum.scaling.fulcrum import FulcrumPlanner

    spec = load_llmserve(path).spec
    ref = spec.profile
    if ref.name:
        profile = builtin_profile(ref.name)
    elif ref.path:
        cand = Path(ref.path) if Path(ref.path).is_absolute() else path.parent / ref.path
        profile = resolve_profile(str(cand))
    else:
        raise SystemExit(f"{path}: the profile is a ConfigMap; name a spec with a built-in or file profile")
    sc = spec.scaling

    def with_method(method: ForecasterMethod) -> LLMServeSpec:
        return spec.model_copy(update={"scaling": sc.model_copy(update={
            "forecaster": sc.forecaster.model_copy(update={"method": method})})})

    select, arima, last = (with_method(m) for m in (ForecasterMethod.SELECT, ForecasterMethod.ARIMA,
                                                     ForecasterMethod.LAST_VALUE))

    observations = record_observations(spec, profile, trace)
    seq = repeated(observations, cycles)
    makers: list[tuple[str, str, Callable[[], Planner]]] = [
        ("fulcrum", "select", lambda: FulcrumPlanner(select, profile)),
        ("fulcrum", "arima", lambda: FulcrumPlanner(arima, profile)),
        ("fulcrum", "last_value", lambda: FulcrumPlanner(last, profile)),
        ("dopd", "arima", lambda: DopdPlanner(spec, profile)),
    ]
    rows = []
    for planner_name, method, make in makers:
        time_cycles(make, observations[: min(len(observations), 20)])  # untimed: lazy imports, caches
        ms, refitted, refits = time_cycles(make, seq)
        rows.append(Timing(path.name, planner_name, method, ms, refitted, refits))
    print(f"  {path.name}: {len(observations)} observations of {sc.interval_seconds:g} s from {trace} "
          f"(profile {profile.name}, mode {spec.mode.value}, ARIMA order {tuple(sc.forecaster.order)}, "
          f"window {sc.forecaster.window}), repeated to {len(seq)} cycles", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300, help="timed cycles per planner (>= 300 for a p99)")
    parser.add_argument("--trace", default="azure-conv-2023", help="trace replayed for the observations")
    parser.add_argument("--llmserve", type=Path, action="append",
                        help="LLMServe file (repeatable; default: the examples with a built-in profile)")
    parser.add_argument("--blas-threads", type=int, default=1, help="BLAS/OpenMP threads (0 = leave the environment)")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be >= 1")
    if args.blas_threads > 0:
        if "numpy" in sys.modules:
            print("note: NumPy was already imported; --blas-threads has no effect", file=sys.stderr)
        for var in _BLAS_VARS:
            os.environ[var] = str(args.blas_threads)
    blas = ", ".join(f"{v}={os.environ.get(v, 'unset')}" for v in _BLAS_VARS)

    import numpy as np

    # ArimaForecaster silences statsmodels locally; this catches any that escape it (e.g. at import).
    warnings.filterwarnings("ignore", module=r"statsmodels(\..*)?")
    print(f"planner cycle = planner.step(observation, current); {args.cycles} timed cycles per row; {blas}")
    rows: list[Timing] = []
    for path in args.llmserve or list(DEFAULT_SPECS):
        rows.extend(bench_spec(path, args.trace, args.cycles))

    print()
    w = max(len("LLMServe"), *(len(r.spec) for r in rows)) + 2
    head = (f"{'LLMServe':<{w}}{'planner':<9}{'forecaster':<12}{'cycles':>7}{'refit cyc':>10}{'p50 ms':>9}"
            f"{'p99 ms':>9}{'max ms':>9}{'p50 ×base':>10}{'p99 ×base':>10}")
    print(head)
    print("-" * len(head))
    verdicts = []
    for spec_name in dict.fromkeys(r.spec for r in rows):
        group = [r for r in rows if r.spec == spec_name]
        base = next(r for r in group if r.forecaster == "last_value")
        b50, b99 = float(np.percentile(base.ms, 50)), float(np.percentile(base.ms, 99))
        for r in group:
            p50, p99 = float(np.percentile(r.ms, 50)), float(np.percentile(r.ms, 99))
            print(f"{r.spec:<{w}}{r.planner:<9}{r.forecaster:<12}{len(r.ms):>7}{r.refit_cycles:>10}{p50:>9.2f}"
                  f"{p99:>9.2f}{max(r.ms):>9.2f}{p50 / b50:>9.1f}x{p99 / b99:>9.1f}x")
            if r.planner == "fulcrum" and r.forecaster != "last_value":
                verdicts.append((r.spec, p99))
    print()
    for r in rows:
        if r.refits:
            with_refit, plain = r.split()
            print(f"{r.spec} {r.planner}/{r.forecaster}: {r.refits} model refits in {r.refit_cycles} cycles "
                  f"(p50 {float(np.percentile(with_refit, 50)):.1f} ms, max {max(with_refit):.1f} ms); cycles without "
                  f"a refit p50 {float(np.percentile(plain, 50)):.1f} ms, p99 {float(np.percentile(plain, 99)):.1f} ms")
    for spec_name, p99 in verdicts:
        verdict = "met" if p99 <= TARGET_P99_MS else "NOT met"
        print(f"target p99 <= {TARGET_P99_MS:.0f} ms per fulcrum cycle (ARIMA included), {spec_name}: {verdict} "
              f"({p99:.1f} ms; DOPD: 'well under 1 s')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
