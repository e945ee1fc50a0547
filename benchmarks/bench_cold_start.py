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
3. ``static-best`` at fulcrum's attainment;
4. with ``--schedule`` (repeatable), a deployment schedule written with hindsight, e.g.
   ``180:1P+1D+3U,300:3U,2040:2U`` (at 180 s start 3U beside the initial pools, at 300 s keep only the 3U, at
   2,040 s scale in to 2U), against the cheapest static deployment reaching its attainment: what the best dynamics
   a planner could have would buy.

It prints each run's SLO attainment / GPU-hours, the misses scored before the first jump's pods are ready, and the
verdict: the ceiling (the best jump) against static-best's attainment. When the ceiling is lower, no planner that
starts from the spec's pools and sees the load at its ticks reaches static-best's attainment, and ``fulcrum`` is
on the front only if it spends fewer GPU-hours than static-best.

    python benchmarks/bench_cold_start.py [--llmserve examples/llmserve-auto.yaml] [--trace synthetic-burst-steady]
                                          [--at SECONDS] [--factors 2,3,6] [--schedule S:DEPLOYMENT,...]

About a minute on the 2-core machine (each run is a full replay; the static sweep a dozen more).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fulcrum.api.llmserve import LLMServeSpec, load_llmserve
from fulcrum.ratio.profiles import resolve_spec_profile
from fulcrum.observation import Observation
from fulcrum.replay.driver import ReplayOptions, run_planner, run_policy
from fulcrum.replay.result import PolicyRun
from fulcrum.replay.static_best import static_best
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.planner import Decision
from fulcrum.target import ClusterTarget, Pool, PoolSize
from fulcrum.traces import load_trace

REPO = Path(__file__).resolve().parents[1]


class ScheduledPlanner:
    """Throw-away planner for this benchmark only: Fulcrum's initial pools, then each target of ``steps`` from its
    time on (``steps``: (seconds, target) pairs, sorted by time).

    Not a scaling policy anyone should run: it knows when to move and to what because the benchmark (or the user's
    ``--schedule``, written with hindsight) tells it. A target is taken as given: a schedule that empties the
    serving pools before their successors are ready drops capacity, as the real planner's make-before-break never
    does (keep both in one step: ``180:1P+1D+3U,300:3U``).
    """

    name = "scheduled"
    forecaster = None
    horizon_steps = 1

    def __init__(self, spec: LLMServeSpec, initial: ClusterTarget,
                 steps: Sequence[tuple[float, ClusterTarget]]) -> None:
        self.tick_s = float(spec.scaling.interval_seconds)
        self._initial, self._steps = initial, sorted(steps, key=lambda s: s[0])

    def initial(self) -> ClusterTarget:
        return self._initial

    def step(self, obs: Observation, current: ClusterTarget) -> Decision:
        due = [target for at_s, target in self._steps if obs.time_s + 1e-9 >= at_s]
        if not due:
            return Decision(time_s=obs.time_s, target=current, reason="scheduled: before the first step")
        return Decision(time_s=obs.time_s, target=due[-1], reason="scheduled: the benchmark's deployment")


_TERM = re.compile(r"^(\d+)([PDU])(?:x(\d+))?$")
_POOL_OF = {"P": Pool.PREFILL, "D": Pool.DECODE, "U": Pool.UNIFIED}


def parse_deployment(text: str, initial: ClusterTarget) -> ClusterTarget:
    """A deployment from its label: ``2P+2D``, ``3U``, ``1P+1D+3U`` (both modes' pools, as during a switch), a term
    with ``xTP`` to set its TP (``3Ux4``). Without one a pool runs the TP of the initial pool of its role, else of the
    first non-empty initial pool. Routing parameters: the initial target's.

    Raises:
        ValueError: a term that is not ``<count><P|D|U>[x<tp>]``, or a role given twice.
    """
    default_tp = next((size.tp for _, size in initial.pools()), 1)
    pools: dict[Pool, PoolSize] = {}
    for term in text.replace(" ", "").split("+"):
        m = _TERM.match(term)
        if m is None:
            raise ValueError(f"bad deployment term {term!r} in {text!r}: want <count><P|D|U>[x<tp>], e.g. 2P, 3Ux4")
        pool = _POOL_OF[m.group(2)]
        if pool in pools:
            raise ValueError(f"deployment {text!r} names the {pool.value} pool twice")
        own = initial.pool(pool)
        tp = int(m.group(3)) if m.group(3) else (own.tp if own.replicas else default_tp)
        pools[pool] = PoolSize(int(m.group(1)), tp)
    return ClusterTarget.of(pools, initial.routing)


def parse_schedule(text: str, initial: ClusterTarget) -> list[tuple[float, ClusterTarget]]:
    """``SECONDS:DEPLOYMENT,...`` (e.g. ``180:1P+1D+3U,300:3U,2040:2U``) as (seconds, target) pairs.

    Raises:
        ValueError: a step without ``:``, a time that is not a number ≥ 0, or a bad deployment
            (:func:`parse_deployment`).
    """
    steps = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        at, sep, what = item.partition(":")
        if not sep:
            raise ValueError(f"bad schedule step {item!r}: want SECONDS:DEPLOYMENT, e.g. 300:3U")
        try:
            t = float(at)
        except ValueError:
            raise ValueError(f"bad time {at!r} in schedule step {item!r}: want seconds") from None
        if not (t >= 0 and t < float("inf")):
            raise ValueError(f"bad time {at!r} in schedule step {item!r}: want seconds ≥ 0")
        steps.append((t, parse_deployment(what, initial)))
    if not steps:
        raise ValueError(f"empty schedule {text!r}")
    return steps


def scaled(initial: ClusterTarget, k: int) -> ClusterTarget:
    """``initial`` with every non-empty pool's instance count multiplied by ``k`` (TPs and routing kept)."""
    return ClusterTarget.of({p: PoolSize(size.replicas * k, size.tp) for p, size in initial.pools()}, initial.routing)


def label(t: ClusterTarget) -> str:
    """``3P+3D`` or ``4U``."""
    if t.unified.replicas:
        disaggregated = t.pool(Pool.PREFILL).replicas or t.pool(Pool.DECODE).replicas
        pre = f"{t.pool(Pool.PREFILL).replicas}P+{t.pool(Pool.DECODE).replicas}D+" if disaggregated else ""
        return f"{pre}{t.unified.replicas}U"
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
    ap.add_argument("--schedule", action="append", default=[], metavar="S:DEPLOYMENT,...",
                    help="also replay a deployment schedule written with hindsight, e.g. 180:1P+1D+3U,300:3U,2040:2U "
                         "(repeatable), each against the cheapest static deployment reaching its attainment")
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
    try:
        schedules = [(text, parse_schedule(text, initial)) for text in args.schedule]
    except ValueError as e:
        ap.error(str(e))
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
        run = run_planner(ScheduledPlanner(spec, initial, [(at, target)]), requests, spec, profile, options,
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
    for text, steps in schedules:
        run = run_planner(ScheduledPlanner(spec, initial, steps), requests, spec, profile, options, name=text)
        show(f"schedule {text}", run)
        s = run.summary
        cheapest = static_best(requests, spec, profile, s.slo_attainment, options)
        rival, rival_label = cheapest.run.summary, cheapest.label
        dominated = (rival.slo_attainment >= s.slo_attainment and rival.gpu_hours <= s.gpu_hours
                     and (rival.slo_attainment > s.slo_attainment or rival.gpu_hours < s.gpu_hours))
        print(f"    against the cheapest static deployment reaching {s.slo_attainment:.1%}, {rival_label} "
              f"{rival.slo_attainment:.1%} / {rival.gpu_hours:.2f}: {'dominated' if dominated else 'on the front'}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
