"""What the cold start allows: the highest SLO attainment a planner that starts from the spec's pools can reach.

A replay starts every tick-driven planner from the pools of the ``LLMServe`` (``initialPrefill``/``initialDecode``,
or ``initialUnified``), while ``static-best`` (``fulcrum.replay.static_best``) holds its deployment from t = 0.
A load that jumps in the first minutes is then met by the static deployment and by no planner: capacity asked
for at the first tick that sees the jump is ready a pod start-up later. This script measures that ceiling for
one spec and trace (default: ``examples/llmserve-auto.yaml`` × ``synthetic-burst-steady``, the cell of issue 13's
matrix where ``fulcrum`` is dominated):

1. ``fulcrum`` itself (the baseline of the run), and the time of its first scale-out: the first tick whose
   observation showed it the load;
2. throw-away planners that start from the same pools and, at that tick (``--at`` to choose another), jump to k×
   the initial counts of every pool (k = 2, 3, 6 by default, ``--factors``; within ``maxGPUs``), then hold them:
   more capacity, as early as any planner that reacts to the load could ask for it;
3. ``static-best`` at fulcrum's attainment.

It prints each run's SLO attainment / GPU-hours, the misses scored before the first jump's pods are ready, and the
verdict: the ceiling (the best jump) against static-best's attainment. When the ceiling is lower, no planner that
starts from the spec's pools and sees the load at its ticks reaches static-best's attainment, and ``fulcrum`` is
on the front only if it spends fewer GPU-hours than static-best.

    python benchmarks/bench_cold_start.py [--llmserve examples/llmserve-auto.yaml] [--trace synthetic-burst-steady]
                                          [--at SECONDS] [--factors 2,3,6]

About a minute on the 2-core machine (each run is a full replay; the static sweep a dozen more).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fulcrum.api.llmserve import LLMServeSpec, load_llmserve
from fulcrum.commands.replay import resolve_spec_profile
from fulcrum.observation import Observation
from fulcrum.replay.driver import ReplayOptions, run_planner, run_policy
from fulcrum.replay.result import PolicyRun
from fulcrum.replay.static_best import static_best
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.planner import Decision
from fulcrum.target import ClusterTarget, Pool, PoolSize
from fulcrum.traces import load_trace

REPO = Path(__file__).resolve().parents[1]


class JumpPlanner:
    """Throw-away planner for this benchmark only: Fulcrum's initial pools, then ``target`` from ``at_s`` on.

    Not a scaling policy anyone should run: it knows when to jump and to what because the benchmark tells it.
    """

    name = "jump"
    forecaster = None
    horizon_steps = 1

    def __init__(self, spec: LLMServeSpec, initial: ClusterTarget, target: ClusterTarget, at_s: float) -> None:
        self.tick_s = float(spec.scaling.interval_seconds)
        self._initial, self._target, self._at_s = initial, target, at_s

    def initial(self) -> ClusterTarget:
        return self._initial

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        if obs.time_s + 1e-9 < self._at_s:
            return Decision(time_s=obs.time_s, target=current, reason="jump: before the jump")
        return Decision(time_s=obs.time_s, target=self._target, reason="jump: the benchmark's deployment")


def scaled(initial: ClusterTarget, k: int) -> ClusterTarget:
    """``initial`` with every non-empty pool's instance count multiplied by ``k`` (TPs and routing kept)."""
    return ClusterTarget.of({p: PoolSize(size.replicas * k, size.tp) for p, size in initial.pools()}, initial.routing)


def label(t: ClusterTarget) -> str:
    """``3P+3D`` or ``4U``."""
    if t.unified.replicas:
        return f"{t.unified.replicas}U"
    return f"{t.pool(Pool.PREFILL).replicas}P+{t.pool(Pool.DECODE).replicas}D"


def misses_before(run: PolicyRun, spec: LLMServeSpec, until_s: float) -> tuple[int, int]:
    """(scored requests arriving before ``until_s`` that miss the SLO, scored requests arriving before it)."""
    scored = [r for r in run.records if run.warmup_s <= r.arrival_s < until_s]
    missed = sum(not (r.ttft_s * 1e3 <= spec.slo.ttft_ms and r.tpot_s * 1e3 <= spec.slo.tpot_ms) for r in scored)
    return missed, len(scored)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--llmserve", type=Path, default=REPO / "examples" / "llmserve-auto.yaml")
    ap.add_argument("--trace", default="synthetic-burst-steady")
    ap.add_argument("--at", type=float, default=None,
                    help="seconds of the jump (default: the tick of fulcrum's first scale-out)")
    ap.add_argument("--factors", default="2,3,6", help="multiples of the initial counts to jump to")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    spec = load_llmserve(args.llmserve).spec
    profile = resolve_spec_profile(spec, args.llmserve, None)
    requests = load_trace(args.trace).requests
    options = ReplayOptions(progress=False)

    fulcrum = run_policy("fulcrum", requests, spec, profile, options)
    grew = [d["time_s"] for d in fulcrum.decisions]
    at = args.at if args.at is not None else (grew[0] if grew else spec.scaling.interval_seconds)
    ready = at + spec.scaling.pod_startup_seconds
    initial = FulcrumPlanner(spec, profile).initial()
    print(f"{args.llmserve.name} × {args.trace}: {len(requests)} requests; the planners start from "
          f"{label(initial)}; the jump at {at:g} s is ready at {ready:g} s (start-up "
          f"{spec.scaling.pod_startup_seconds:g} s); scoring from {fulcrum.warmup_s:g} s")

    def show(name: str, run: PolicyRun) -> None:
        s = run.summary
        missed, scored = misses_before(run, spec, ready)
        print(f"  {name:<22} SLO attainment {s.slo_attainment:6.1%}  GPU-hours {s.gpu_hours:6.2f}  "
              f"scored misses arriving before {ready:g} s: {missed} of {scored}", flush=True)

    show("fulcrum", fulcrum)
    ceiling: tuple[float, str] | None = None
    for k in (int(x) for x in args.factors.split(",") if x.strip()):
        target = scaled(initial, k)
        if target.gpus > spec.scaling.max_gpus:
            print(f"  jump to {label(target)}: {target.gpus} GPUs > maxGPUs {spec.scaling.max_gpus}, skipped")
            continue
        run = run_planner(JumpPlanner(spec, initial, target, at), requests, spec, profile, options,
                          name=f"jump to {label(target)}")
        show(f"jump to {label(target)}", run)
        if ceiling is None or run.summary.slo_attainment > ceiling[0]:
            ceiling = (run.summary.slo_attainment, label(target))
    best = static_best(requests, spec, profile, fulcrum.summary.slo_attainment, options)
    show(f"static-best {best.label}", best.run)
    if ceiling is None:
        print("no jump fits maxGPUs")
        return 1
    sb = best.run.summary
    if ceiling[0] < sb.slo_attainment:
        f = fulcrum.summary
        verdict = "on the front" if f.gpu_hours < sb.gpu_hours else "dominated by static-best"
        print(f"ceiling {ceiling[0]:.1%} ({ceiling[1]}) < static-best's {sb.slo_attainment:.1%}: no planner starting "
              f"from {label(initial)} reaches it, so fulcrum is on the front only below static-best's "
              f"{sb.gpu_hours:.2f} GPU-hours; fulcrum {f.slo_attainment:.1%} / {f.gpu_hours:.2f}: {verdict}; "
              f"{time.perf_counter() - t0:.0f} s")
    else:
        print(f"ceiling {ceiling[0]:.1%} ({ceiling[1]}) ≥ static-best's {sb.slo_attainment:.1%}: the cold start does "
              f"not bound this cell; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
