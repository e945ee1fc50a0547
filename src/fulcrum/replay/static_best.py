"""``static-best``: the best static deployment for a trace, found in hindsight by a sweep of replays.

A static deployment (fixed counts, the ``static`` policy) sized knowing the whole trace is the strongest
baseline a one-hour replay has: any autoscaler that needs more GPU-hours for the same SLO attainment loses to
it. The sweep answers "what would the cheapest static deployment achieving the same attainment have cost?".

**Definition.** Given a target attainment A (fulcrum's attainment in the same ``--compare``; the SLO percentile
when fulcrum is not run), static-best is the deployment with the fewest GPUs whose SLO attainment is ≥ A; when
no deployment within ``maxGPUs`` reaches A, the one with the highest attainment (ties → fewer GPUs). So a
planner is *not dominated* by static-best exactly when static-best either needs at least its GPU-hours or falls
short of its attainment. ("Highest attainment" alone would pick the largest deployment and dominate nothing;
"cheapest meeting the SLO percentile" would ignore the attainment the planner actually reached.)

**Grid.** Disaggregated: n_p prefill × n_d decode instances at the TPs the ``static`` policy picks, with
n_p·TP_p + n_d·TP_d within [minGPUs, maxGPUs]; Unified: n_u instances; Auto: both grids. GPU-hours of a static
deployment are its GPUs × the scored time, so the grid is walked cheapest-first where it can be: for each n_d
(1, 2, …) a binary search finds the fewest n_p reaching A (attainment grows with n_p at a fixed n_d), and the
walk stops once n_d alone costs as much as the best found. Each probe is a full replay (about a second for a
static deployment on a one-hour trace).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fulcrum.api.llmserve import LLMServeSpec, Mode
from fulcrum.errors import PlanningError
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.replay.driver import ReplayOptions, run_planner
from fulcrum.replay.result import PolicyRun
from fulcrum.scaling.static import StaticPlanner
from fulcrum.target import ClusterTarget
from fulcrum.workload import Request

__all__ = ["StaticBest", "static_best"]


@dataclass(frozen=True)
class StaticBest:
    """The sweep's answer.

    Attributes:
        run: the chosen deployment's replay, its policy named ``static-best``.
        label: the deployment, e.g. ``"3P+1D"`` or ``"5U"``.
        gpus: its GPUs.
        target: the attainment it was asked to reach, 0..1.
        reached: whether it reaches ``target``.
        probes: (label, GPUs, attainment) of every deployment replayed, in order.
    """

    run: PolicyRun
    label: str
    gpus: int
    target: float
    reached: bool
    probes: tuple[tuple[str, int, float], ...]


def _disaggregated_counts(n_d: int, n_p: int) -> tuple[int, int, int]:
    """(prefill, decode, unified) instance counts of a static disaggregated deployment with ``n_d`` decode."""
    return n_p, n_d, 0


def _static_spec(spec: LLMServeSpec, mode: Mode, p: int, d: int, u: int) -> LLMServeSpec:
    sc = spec.scaling.model_copy(update={"initial_prefill": p, "initial_decode": d, "initial_unified": u})
    return spec.model_copy(update={"scaling": sc, "mode": mode})


def static_best(
    requests: Sequence[Request],
    spec: LLMServeSpec,
    profile: PerformanceProfile,
    target: float,
    options: ReplayOptions = ReplayOptions(),
    progress: Callable[[str], None] | None = None,
) -> StaticBest:
    """Sweep static deployments of ``spec`` on ``requests`` (see the module doc for the definition and grid).

    Args:
        target: the SLO attainment to reach, 0..1.
        progress: called with one line per probe (None: silent).

    Raises:
        ValueError: an empty trace, or no deployment fits the GPU limits.
        PlanningError: the static planner cannot choose the TPs of the spec's mode (e.g. none holds
            ``engine.maxModelLen``); in Auto mode a Unified that cannot be planned is left out instead.
    """
    sc = spec.scaling
    cache: dict[tuple[str, int, int, int], tuple[PolicyRun, int]] = {}
    probes: list[tuple[str, int, float]] = []

    def probe(mode: Mode, p: int, d: int, u: int) -> tuple[PolicyRun, int]:
        key = (mode.value, p, d, u)
        if key not in cache:
            planner = StaticPlanner(_static_spec(spec, mode, p, d, u), profile)
            gpus = planner.initial().gpus
            run = run_planner(planner, requests, spec, profile, options, name="static-best")
            cache[key] = (run, gpus)
            label = f"{u}U" if mode == Mode.UNIFIED else f"{p}P+{d}D"
            probes.append((label, gpus, run.summary.slo_attainment))
            if progress is not None:
                progress(f"static {label}: {gpus} GPUs, SLO attainment {run.summary.slo_attainment:.1%}")
        return cache[key]

    candidates: list[tuple[str, int, PolicyRun]] = []  # (label, gpus, run) reaching the target, per row

    def search(mode: Mode, lo: int, hi: int, make: Callable[[int], tuple[int, int, int]]) -> None:
        """Fewest n in [lo, hi] whose deployment reaches the target (attainment grows with n)."""
        if hi < lo:
            return
        run, gpus = probe(mode, *make(hi))
        if run.summary.slo_attainment < target:
            return
        while lo < hi:
            mid = (lo + hi) // 2
            if probe(mode, *make(mid))[0].summary.slo_attainment >= target:
                hi = mid
            else:
                lo = mid + 1
        run, gpus = probe(mode, *make(hi))
        p, d, u = make(hi)
        candidates.append((f"{u}U" if mode == Mode.UNIFIED else f"{p}P+{d}D", gpus, run))

    def best_gpus() -> int:
        return min((g for _, g, _ in candidates), default=sc.max_gpus + 1)

    def tps_of(mode: Mode, p: int, d: int, u: int) -> ClusterTarget | None:
        """The static planner's TPs for ``mode``; None for Unified in Auto mode when it cannot be planned (e.g. no
        unified TP holds maxModelLen), which Auto then leaves out as the Fulcrum planner does
        (:func:`fulcrum.ratio.planner.plan_modes`)."""
        try:
            return StaticPlanner(_static_spec(spec, mode, p, d, u), profile).initial()
        except PlanningError:
            if spec.mode != Mode.AUTO or mode != Mode.UNIFIED:
                raise
            return None

    tps = tps_of(Mode.DISAGGREGATED, 1, 1, 0) if spec.mode in (Mode.DISAGGREGATED, Mode.AUTO) else None
    if tps is not None:
        tp_p, tp_d = tps.prefill.tp, tps.decode.tp
        n_d = 1
        while n_d * tp_d + tp_p <= min(sc.max_gpus, best_gpus() - 1):
            room = min(sc.max_gpus, best_gpus() - 1) - n_d * tp_d
            lo = max(1, -(-(sc.min_gpus - n_d * tp_d) // tp_p))
            search(Mode.DISAGGREGATED, lo, room // tp_p, functools.partial(_disaggregated_counts, n_d))
            n_d += 1
    uni = tps_of(Mode.UNIFIED, 0, 0, 1) if spec.mode in (Mode.UNIFIED, Mode.AUTO) else None
    if uni is not None:
        tp_u = uni.unified.tp
        hi = min(sc.max_gpus, best_gpus() - 1) // tp_u
        search(Mode.UNIFIED, max(1, -(-sc.min_gpus // tp_u)), hi, lambda n: (0, 0, n))
    if candidates:
        label, gpus, run = min(candidates, key=lambda c: (c[1], -c[2].summary.slo_attainment))
        return StaticBest(run, label, gpus, target, True, tuple(probes))
    if not cache:
        raise ValueError(f"no static deployment fits minGPUs={sc.min_gpus}..maxGPUs={sc.max_gpus}")
    key = max(cache, key=lambda k: (cache[k][0].summary.slo_attainment, -cache[k][1]))
    run, gpus = cache[key]
    mode, p, d, u = key
    label = f"{u}U" if mode == Mode.UNIFIED.value else f"{p}P+{d}D"
    return StaticBest(run, label, gpus, target, False, tuple(probes))
