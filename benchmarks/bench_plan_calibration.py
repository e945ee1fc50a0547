"""Does a plan meet the SLO it was made for? Plan at a steady load, run the plan's pools in the simulator.

Run: ``python benchmarks/bench_plan_calibration.py [--rates 1,2,3,4,5,6,8] [--seconds 1800]``

For each (example spec, bundled trace) pair below and each arrival rate λ, the planner is given the steady
workload λ with the ISL/OSL distribution of the trace's admitted prompts (those shorter than the spec's
``maxModelLen``; the router rejects the others, and the simulator does too since 2026-11-28 — scored as misses
they capped the Auto example × code trace, 14% of whose prompts exceed its 4,096 tokens, at 86%, and the bench
at 42 of 56 points) (its quantiles, :data:`fulcrum.observation.QUANTILE_LEVELS`)
and asked for a Disaggregated plan (:func:`fulcrum.ratio.planner.plan_disaggregated`) and, where the spec's
profile can plan one, a Unified plan (:func:`~fulcrum.ratio.planner.plan_unified`). The planned pools (with the
plan's own TPs and routing parameters) are then run as a static deployment in the simulator (``fulcrum.replay``,
the engine of ``fulcrum replay``) on a Poisson load of rate λ whose requests are drawn from the trace (seeded),
and scored as ``fulcrum replay`` scores them (after its warm-up). A plan is **calibrated** when its pools reach
the spec's SLO percentile (e.g. 90% of requests within both TTFT and TPOT): the plan claims exactly that.

The figure is the share of calibrated (spec, trace, rate, mode) points, with the GPUs they plan; the baseline,
measured in the same run, is the same planner with ``kv_occupancy_quantile = 0.5`` — KV caches sized for the
mean in-flight context, as DOPD's eq. (13) does — so the ratio shows what sizing for the KV demand's tail
(:func:`fulcrum.ratio.capacity.kv_instances_needed`) buys and costs. Rows that miss print the attainment reached.

No GPU and no cluster: the simulator is timed by the specs' performance profiles. Target: every point
calibrated (a miss is a planner model error, to be fixed in ``fulcrum.ratio``).

``--tightness`` asks the other question too: is a calibrated plan of the ``fulcrum`` variant the *smallest* that
holds the load? Each of its pools with two or more instances is run again with one instance fewer (the other
pools as planned); a plan is **tight** when every such deployment falls under the percentile, and **loose** when
one of them still reaches it (the plan holds at least one instance more than the load needs). About twice the
run time. A loose point is over-provisioning in the planner's model; how many there are, and by which pool, is
the figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np

from fulcrum.api.llmserve import LLMServeSpec, Mode, load_llmserve
from fulcrum.ratio.profiles import resolve_spec_profile
from fulcrum.errors import PlanningError
from fulcrum.observation import QUANTILE_LEVELS
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import Plan, PlannerSettings, WorkloadEstimate, plan_disaggregated, plan_unified
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.replay.driver import ReplayOptions, run_planner
from fulcrum.scaling.static import StaticPlanner
from fulcrum.simulator.records import exceeds_context, output_within_context
from fulcrum.target import ClusterTarget
from fulcrum.traces import load_trace
from fulcrum.workload import Request

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("llmserve-auto.yaml", "synthetic-burst-steady"),
    ("llmserve-auto.yaml", "azure-conv-2023"),
    ("llmserve-auto.yaml", "azure-code-2023"),
    ("llmserve-disaggregated-70b-h100.yaml", "azure-conv-2023"),
    ("llmserve-disaggregated-70b-h100.yaml", "synthetic-burst-steady"),
]


def length_distribution(values: np.ndarray) -> LengthDistribution:
    """The distribution of ``values`` (tokens, shape (n,)) at the observer's quantile levels, with their mean."""
    return LengthDistribution.from_quantiles(
        QUANTILE_LEVELS, [float(np.quantile(values, q)) for q in QUANTILE_LEVELS], float(values.mean()))


def load_case(path: Path, trace: str) -> tuple[LLMServeSpec, PerformanceProfile, list[Request]]:
    """The LLMServe example at ``path``: its spec, its performance profile, and the prompts of ``trace`` it admits
    (:func:`admitted_requests`)."""
    spec = load_llmserve(path).spec
    return spec, resolve_spec_profile(spec, path, None), admitted_requests(spec, trace)


def admitted_requests(spec: LLMServeSpec, trace: str) -> list[Request]:
    """The prompts of the bundled ``trace`` the router admits for ``spec`` (one of the model's context or more is
    rejected with a 400, and the simulator rejects it too), with the output the context leaves them: the load a
    plan for ``spec`` is asked to serve."""
    ctx = spec.engine.max_model_len
    return [Request(r.arrival_s, r.isl, output_within_context(r.isl, r.osl, ctx))
            for r in load_trace(trace, None).requests if not exceeds_context(r.isl, ctx)]


def lengths_of(requests: list[Request]) -> tuple[LengthDistribution, LengthDistribution]:
    """The prompt and output length distributions of ``requests`` (:func:`length_distribution`), computed once per
    case: a steady workload of λ req/s is ``WorkloadEstimate(λ, isl, osl, 1.0)`` (Poisson arrivals)."""
    isl = np.array([r.isl for r in requests], dtype=float)
    osl = np.array([r.osl for r in requests], dtype=float)
    return length_distribution(isl), length_distribution(osl)


def plans_for(spec: LLMServeSpec, profile: PerformanceProfile, w: WorkloadEstimate, settings: PlannerSettings
              ) -> dict[str, Plan]:
    """``{"D": the Disaggregated plan, "U": the Unified plan}`` for ``w`` at the spec's TPs; no ``"U"`` for a
    Disaggregated spec or where the profile cannot plan Unified mode."""
    sc = spec.scaling
    out = {"D": plan_disaggregated(w, profile, spec.slo, tp_prefill=sc.tp_prefill, tp_decode=sc.tp_decode,
                                   settings=settings)}
    if spec.mode != Mode.DISAGGREGATED:
        try:
            out["U"] = plan_unified(w, profile, spec.slo, tp_unified=sc.tp_unified, settings=settings)
        except PlanningError:
            pass
    return out


def plan_label(p: Plan) -> str:
    """``4U×TP2`` or ``2P×TP2+2D×TP2``: a plan's pools."""
    if p.mode == Mode.UNIFIED.value:
        return f"{p.unified.replicas}U×TP{p.unified.tp}"
    return f"{p.prefill.replicas}P×TP{p.prefill.tp}+{p.decode.replicas}D×TP{p.decode.tp}"


def one_fewer(target: ClusterTarget) -> list[tuple[str, ClusterTarget]]:
    """``(pool name, target)`` for each pool of ``target`` with two or more instances, that pool one instance
    smaller and the others as they are (the ``--tightness`` probes)."""
    return [(name.value, target.with_replicas(name, size.replicas - 1))
            for name, size in target.pools() if size.replicas >= 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1,2,3,4,5,6,8", help="steady arrival rates, requests/s (comma-separated)")
    ap.add_argument("--seconds", type=float, default=1800.0, help="length of each Poisson load, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tightness", action="store_true",
                    help="also run each calibrated fulcrum plan with one instance fewer per pool (module doc)")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    warnings.simplefilter("ignore")
    variants = {"fulcrum": None, "mean KV (baseline)": 0.5}
    totals = {v: [0, 0, 0] for v in variants}  # calibrated points, points, planned GPUs
    runs: dict[tuple[str, ClusterTarget], float] = {}
    tight = [0, 0]  # tight plans, calibrated plans probed
    loose: list[str] = []

    def attainment(key: tuple[str, ClusterTarget], spec: LLMServeSpec, profile: PerformanceProfile,
                   load: list[Request]) -> float:
        """SLO attainment of ``key``'s target as a static deployment on ``load`` (cached per case and target)."""
        if key not in runs:
            # the plan's own pools, TPs and routing (the spec's counts would take the spec's TPs)
            static = StaticPlanner(spec, profile, target=key[1])
            runs[key] = run_planner(static, load, spec, profile, ReplayOptions(), name="static").summary.slo_attainment
        return runs[key]

    for example, trace in CASES:
        spec, profile, src = load_case(ROOT / "examples" / example, trace)
        i_dist, o_dist = lengths_of(src)
        target = spec.slo.percentile / 100.0
        print(f"\n{example} × {trace}  (SLO P{spec.slo.percentile:g}: TTFT {spec.slo.ttft_ms} ms, "
              f"TPOT {spec.slo.tpot_ms} ms; profile {profile.name})")
        rng = np.random.default_rng(args.seed)
        for lam in rates:
            n = int(rng.poisson(lam * args.seconds))
            t = np.sort(rng.uniform(0.0, args.seconds, n))
            pick = rng.integers(0, len(src), n)
            load = [Request(float(t[i]), src[pick[i]].isl, src[pick[i]].osl) for i in range(n)]
            w = WorkloadEstimate(lam, i_dist, o_dist, 1.0)
            cells = []
            for name, q in variants.items():
                settings = PlannerSettings.from_spec(spec)
                if q is not None:
                    settings = dataclasses.replace(settings, kv_occupancy_quantile=q)
                for mode, p in plans_for(spec, profile, w, settings).items():
                    case = f"{example}|{trace}|{lam}|{mode}"
                    a = attainment((case, p.target()), spec, profile, load)
                    ok = a >= target
                    if args.tightness and ok and q is None:
                        held = [(pool, attainment((case, t), spec, profile, load)) for pool, t in one_fewer(p.target())]
                        tight[1] += 1
                        tight[0] += not any(x >= target for _, x in held)
                        loose += [f"{example} × {trace} at {lam:g} req/s: {plan_label(p)} holds with one {pool} "
                                  f"instance fewer ({x:.1%})" for pool, x in held if x >= target]
                    tot = totals[name]
                    tot[0] += ok
                    tot[1] += 1
                    tot[2] += p.gpus
                    cells.append(f"{name[:7]} {mode} {plan_label(p):>16s} {a * 100:5.1f}%{'' if ok else ' MISS'}")
            print(f"  {lam:5.2f} req/s  " + "   ".join(cells), flush=True)
    print("\nvariant               calibrated        planned GPUs")
    base = totals["mean KV (baseline)"]
    for name, (ok, n, gpus) in totals.items():
        print(f"{name:20s}  {ok:3d} / {n:3d} ({ok / n:6.1%})   {gpus:5d}")
    ours = totals["fulcrum"]
    print(f"\nratio to the baseline: calibrated {ours[0] / max(base[0], 1):.2f}×, planned GPUs {ours[2] / max(base[2], 1):.2f}×")
    print(f"target (every point calibrated): {'met' if ours[0] == ours[1] else 'not met'}")
    if args.tightness:
        print(f"\ntightness: {tight[0]} of {tight[1]} calibrated fulcrum plans are the smallest that hold their load "
              f"(one instance fewer in any pool falls under the percentile); loose:")
        for line in loose:
            print(f"  {line}")
        if not loose:
            print("  none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
