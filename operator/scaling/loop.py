"""The control loop, one interval at a time: observe → forecast → plan → apply, on any :class:`~fulcrum.cluster.Cluster`.

``fulcrum replay`` (the simulator as the cluster) and the operator (the Kubernetes adapter as the cluster) both run
:meth:`ControlLoop.run_interval`, so a replay runs the rules the operator runs. Pure itself: the I/O is the
cluster's. The planner is built by :func:`fulcrum.scaling.registry.make_planner` from ``spec.scaling.planner``
(``fulcrum`` = FulcrumPlanner, or a reference planner) and stepped as ``planner.step(observation, current)``.

Rules on top of the planner (DESIGN principle 3 and the card's faults):

- **never scale in blind**: no observation this interval (:class:`~fulcrum.cluster.ObservationError`:
  Prometheus down or empty) → keep the target in force, report Degraded with the reason; the planner is not
  stepped (its forecaster would learn a zero);
- **never scale on a failed plan**: the planner raising :class:`~fulcrum.errors.PlanningError` on the load it
  was given (e.g. a mean prompt longer than any TP's KV memory holds) → keep the target in force, report
  Degraded with the planner's message;
- **external replica owner** (``spec.scaling.replicaOwner: External``, e.g. KEDA or a person sets
  ``spec.scaling.replicas``): the planner still runs, for the P/D ratio and TPs; the total instance count is
  the external one, split by the planned ratio (:func:`distribute`) and cut to ``spec.scaling.maxGPUs`` when
  the split at the planned TPs needs more GPUs (:func:`cut_to_budget`; the reason says so);
- **drain, never cut**: scale-ins are reported per pool (:attr:`LoopOutcome.scale_in`) and the cluster drains
  them (the :class:`~fulcrum.cluster.Cluster` contract of ``apply``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fulcrum.api.llmserve import LLMServeSpec, ReplicaOwner
from fulcrum.cluster import Cluster, ObservationError
from fulcrum.errors import PlanningError
from fulcrum.forecast.workload import WorkloadForecaster, required_history
from fulcrum.observation import Observation
from fulcrum.ratio.planner import fit_budget
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.planner import PlanNumbers, Planner
from fulcrum.scaling.registry import make_planner
from fulcrum.target import ClusterTarget, Pool, PoolSize

__all__ = ["PLANNING_FAILED", "LoopOutcome", "ControlLoop", "cut_to_budget", "distribute", "external_replicas",
           "pool_changes"]


def external_replicas(spec: LLMServeSpec) -> int | None:
    """The total instance count an external owner set (``spec.scaling.replicaOwner: External``), else None
    (the planner owns the count; ``spec.scaling.replicas`` is ignored then)."""
    sc = spec.scaling
    return sc.replicas if sc.replica_owner is ReplicaOwner.EXTERNAL else None


def distribute(total: int, planned: ClusterTarget, ratio: float | None = None, *,
               max_gpus: int | None = None) -> ClusterTarget:
    """Split an externally owned instance count over the pools by the planned P/D ratio.

    Args:
        total: instances in all pools together (``spec.scaling.replicas``), ≥ 0.
        planned: the planner's target (its TPs and mode are kept).
        ratio: planned prefill instances per decode instance; default: ``planned``'s own counts.
        max_gpus: the GPU budget (``spec.scaling.maxGPUs``); None = no cut. A split that needs more GPUs at the
            planned TPs is cut to it (:func:`cut_to_budget`), so it then holds fewer than ``total`` instances.

    Returns:
        Unified plan → ``unified = total``. Disaggregated → ``prefill = round(total·r/(1+r))`` clamped so each
        pool has at least one instance when ``total ≥ 2``, ``decode`` the rest. Then cut to ``max_gpus``.
    """
    target = _split(total, planned, ratio)
    return target if max_gpus is None else cut_to_budget(target, max_gpus)[0]


def cut_to_budget(target: ClusterTarget, max_gpus: int) -> tuple[ClusterTarget, str | None]:
    """``target``'s counts cut to ``max_gpus`` GPUs at its TPs, as the planners cut theirs
    (:func:`fulcrum.ratio.planner.fit_budget`, the counts standing for the need: in proportion to count × TP, at
    least one instance of each pool that has any, what the floors leave over filled). Used for an externally
    owned total (``replicaOwner: External``), whose split over pools of different TPs can need more GPUs than
    instances: ``maxGPUs`` is the budget the user set, so it wins over the external count.

    Args:
        target: the pools (instances, TP = GPUs per instance).
        max_gpus: the budget, GPUs (``spec.scaling.maxGPUs``).

    Returns:
        ``(target, None)`` when it needs at most ``max_gpus`` GPUs; else the cut target (TPs and routing kept) and
        one line saying so, e.g. ``"cut to maxGPUs=8: prefill 4 → 4 (TP 1), decode 4 → 2 (TP 2); 12 GPUs
        asked"``. When one instance of each pool alone exceeds ``max_gpus`` one of each is kept (still over it)
        and the line says the budget cannot hold them.
    """
    gpus = target.gpus
    if gpus <= max_gpus:
        return target, None
    pools = {p: size for p, size in target.pools() if size.replicas > 0}
    counts = {p.value: size.replicas for p, size in pools.items()}
    tps = {p.value: size.tp for p, size in pools.items()}
    fitted, notes = fit_budget({k: float(n) for k, n in counts.items()}, tps, dict(counts), 0, max_gpus)
    cut = target
    for p in pools:
        cut = cut.with_replicas(p, fitted[p.value])
    note = (f"cut to maxGPUs={max_gpus}: "
            + ", ".join(f"{p.value} {counts[p.value]} → {fitted[p.value]} (TP {tps[p.value]})" for p in pools)
            + f"; {gpus} GPUs asked" + "".join(f"; {n}" for n in notes if "cannot hold" in n))
    return cut, note


def _split(total: int, planned: ClusterTarget, ratio: float | None) -> ClusterTarget:
    """:func:`distribute` before the budget."""
    total = max(int(total), 0)
    if planned.unified.replicas > 0 and planned.prefill.replicas == 0 and planned.decode.replicas == 0:
        return planned.with_replicas(Pool.UNIFIED, total)
    if ratio is None or not math.isfinite(ratio) or ratio < 0:
        p, d = planned.prefill.replicas, planned.decode.replicas
        ratio = p / d if d > 0 else (math.inf if p > 0 else 1.0)
    share = ratio / (1.0 + ratio) if math.isfinite(ratio) else 1.0
    n_p = int(round(total * share))
    if total >= 2:
        n_p = min(max(n_p, 1), total - 1)
    return replace(planned, prefill=PoolSize(n_p, planned.prefill.tp), decode=PoolSize(total - n_p, planned.decode.tp),
                   unified=PoolSize(0, planned.unified.tp))


def pool_changes(old: ClusterTarget, new: ClusterTarget) -> dict[Pool, tuple[int, int]]:
    """Pools whose replica count changes: pool → (old replicas, new replicas)."""
    return {p: (old.pool(p).replicas, new.pool(p).replicas) for p in Pool
            if old.pool(p).replicas != new.pool(p).replicas}


PLANNING_FAILED = "planning failed:"
"""How a :class:`LoopOutcome`'s ``degraded`` begins when the planner failed on the observed load (the status's
Degraded reason PlanningFailed)."""


@dataclass(frozen=True)
class LoopOutcome:
    """What one interval decided.

    Attributes:
        target: the pools to converge to (the previous target when nothing could be observed).
        reason: one line: why (shown in events, logs and ``status.plan.reason``).
        observed: whether an observation was available.
        degraded: why the loop is degraded (no observation, or the planner failed on it), else None.
        changes: pools whose replica count changes: pool → (old, new); scale-ins must be drained first.
        forecast: series → {"mean", "lower", "upper"} (requests/s or tokens) of the planner, if it forecasts.
        numbers: the numbers behind the plan (ratio, decode concurrency, expected TTFT, SLO feasibility, …).
        observation: what was observed, or None.
        forecast_ready: the planner's forecaster has the history its method needs (False in cold start, when
            the observed load is planned for, and for planners that do not forecast).
    """

    target: ClusterTarget
    reason: str
    observed: bool
    degraded: str | None = None
    changes: dict[Pool, tuple[int, int]] = field(default_factory=dict)
    forecast: dict[str, dict[str, float]] = field(default_factory=dict)
    numbers: PlanNumbers = field(default_factory=PlanNumbers)
    observation: Observation | None = None
    forecast_ready: bool = False

    @property
    def scale_in(self) -> dict[Pool, tuple[int, int]]:
        """The pools this outcome shrinks: pool → (old, new)."""
        return {k: v for k, v in self.changes.items() if v[1] < v[0]}

    @property
    def scale_out(self) -> dict[Pool, tuple[int, int]]:
        """The pools this outcome grows: pool → (old, new)."""
        return {k: v for k, v in self.changes.items() if v[1] > v[0]}


class ControlLoop:
    """The planner loop for one LLMServe, in the operator and in ``fulcrum replay`` (see module doc).

    Args:
        spec: the validated LLMServe spec.
        profile: its performance profile.
        current: the target in force (from ``status`` after a restart, else the initial target).
        planner: the planner to drive; default ``make_planner(spec.scaling.planner, spec, profile)``.
    """

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, current: ClusterTarget,
                 planner: Planner | None = None) -> None:
        self.spec = spec
        self.profile = profile
        self.current = current
        self.planner: Planner = planner or make_planner(spec.scaling.planner, spec, profile)

    @property
    def interval_s(self) -> float:
        """The planner interval, seconds."""
        return float(self.planner.tick_s)

    @property
    def forecaster(self) -> WorkloadForecaster | None:
        """The planner's load forecaster (FulcrumPlanner, DopdPlanner), or None for a planner without one."""
        return self.planner.forecaster

    @property
    def history_wanted(self) -> int:
        """Past intervals a warm start should read (:meth:`warm_start`): the forecaster's fitting window, or
        the history its method needs when that is longer (a seasonal-naive season); 0 for planners that do
        not forecast."""
        if self.forecaster is None:
            return 0
        fc = self.spec.scaling.forecaster
        return max(int(fc.window), required_history(fc.method, fc))

    def warm_start(self, history: Sequence[Observation]) -> int:
        """Feed past intervals (oldest first) to the planner's forecaster without planning on them, so that a
        loop built after an operator restart or a spec change forecasts from the load Prometheus kept instead
        of starting cold (DOPD Alg. 2 lines 5–7 run on the history; no decision is taken).

        Returns the observations fed: 0 for a planner without a forecaster. Never raises on odd values (the
        forecaster's contract).
        """
        forecaster = self.forecaster
        if forecaster is None:
            return 0
        for obs in history:
            forecaster.observe(obs)
        return len(history)

    def run_interval(self, cluster: Cluster) -> LoopOutcome:
        """One interval on ``cluster``: observe the last :attr:`interval_s` seconds, :meth:`step`, apply the
        outcome's target (the target in force when nothing could be observed: holding is applying it again;
        the cluster drains the pools it shrinks).

        Raises whatever the cluster's ``apply`` raises (the Kubernetes API failing after retries; a profile
        without the planned TP in the simulator); an :class:`~fulcrum.cluster.ObservationError` or a
        :class:`~fulcrum.errors.PlanningError` never escapes.
        """
        try:
            obs: Observation | None = cluster.observe(self.interval_s)
            error = None
        except ObservationError as err:
            obs, error = None, str(err) or type(err).__name__
        outcome = self.step(obs, error=error)
        cluster.apply(outcome.target, outcome.reason)
        return outcome

    def step(self, obs: Observation | None, *, error: str | None = None) -> LoopOutcome:
        """One interval. ``obs`` None (``error`` says why) keeps the target in force and reports degraded; so
        does a :class:`~fulcrum.errors.PlanningError` of the planner on ``obs`` (the reason names it).

        Never raises on odd observations (the planner contract); the returned target becomes ``current``.
        """
        if obs is None:
            why = error or "no observation"
            return LoopOutcome(target=self.current, reason=f"hold: no observation ({why}); not scaling blind",
                               observed=False, degraded=why)
        try:
            decision = self.planner.step(obs, self.current)
        except PlanningError as err:
            why = f"{PLANNING_FAILED} {str(err) or type(err).__name__}"
            return LoopOutcome(target=self.current, reason=f"hold: {why}; keeping the pools in force",
                               observed=True, degraded=why, observation=obs, forecast_ready=self._forecast_ready())
        target = decision.target
        reason = decision.reason
        total = external_replicas(self.spec)
        if total is not None:
            target, cut = cut_to_budget(distribute(total, target, decision.numbers.ratio),
                                        self.spec.scaling.max_gpus)
            reason = (f"external replica owner: {total} instances split by the planned ratio"
                      + (f", {cut}" if cut else "") + f" [{reason}]")
        changes = pool_changes(self.current, target)
        tp_changed = any(self.current.pool(p).tp != target.pool(p).tp for p in Pool)
        if not changes and not tp_changed:
            reason = f"hold: {reason}" if not reason.startswith("hold") else reason
        self.current = target
        return LoopOutcome(target=target, reason=reason, observed=True, changes=changes,
                           forecast=dict(decision.forecast), numbers=decision.numbers, observation=obs,
                           forecast_ready=self._forecast_ready())

    def _forecast_ready(self) -> bool:
        forecaster = self.forecaster
        return forecaster is not None and forecaster.ready
