"""One interval of the operator's control loop: observation → forecast → plan → the next ClusterTarget.

Pure: no I/O, no clock. The handlers (``fulcrum.controller.handlers``) observe (Prometheus), call
:meth:`ControlLoop.step` and apply what it returns. The planner is the very object ``fulcrum replay`` drives
(:func:`fulcrum.replay.driver.make_planner`: ``fulcrum`` = FulcrumPlanner, or a reference policy), stepped the
same way (``planner.step(observation, current)``), so a replay predicts what the operator does.

Rules on top of the planner (DESIGN principle 3 and the card's faults):

- **never scale in blind**: no observation this interval (Prometheus down or empty) → keep the target in
  force, report Degraded with the reason; the planner is not stepped (its forecaster would learn a zero);
- **External replica owner** (``spec.scaling.replicaOwner: External``, e.g. KEDA or a person sets
  ``spec.scaling.replicas``): the planner still runs, for the P/D ratio and TPs; the total instance count is
  the external one, split by the planned ratio (:func:`distribute`);
- scale-ins are reported per pool so that the caller drains before it lowers replicas (``drain.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fulcrum.api.llmserve import LLMServeSpec
from fulcrum.forecast.workload import required_history
from fulcrum.observation import Observation
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.replay.driver import make_planner
from fulcrum.scaling.planner import Planner
from fulcrum.target import ClusterTarget, PoolSize

__all__ = ["POOLS", "LoopOutcome", "ControlLoop", "distribute", "policy_name", "replica_owner", "pool_changes"]

POOLS: tuple[str, ...] = ("prefill", "decode", "unified")


def policy_name(spec: LLMServeSpec) -> str:
    """The planner the spec names (``spec.scaling.planner``; ``fulcrum`` by default)."""
    return spec.scaling.planner.value


def replica_owner(spec: LLMServeSpec) -> tuple[str, int | None]:
    """(``Operator`` | ``External``, the external total instance count or None) from ``spec.scaling``."""
    owner = getattr(spec.scaling, "replica_owner", None)
    owner_s = str(getattr(owner, "value", owner) or "Operator")
    replicas = getattr(spec.scaling, "replicas", None)
    return owner_s, (int(replicas) if replicas is not None else None)


def distribute(total: int, planned: ClusterTarget, ratio: float | None = None) -> ClusterTarget:
    """Split an externally owned instance count over the pools by the planned P/D ratio.

    Args:
        total: instances in all pools together (``spec.scaling.replicas``), ≥ 0.
        planned: the planner's target (its TPs and mode are kept).
        ratio: planned prefill instances per decode instance; default: ``planned``'s own counts.

    Returns:
        Unified plan → ``unified = total``. Disaggregated → ``prefill = round(total·r/(1+r))`` clamped so each
        pool has at least one instance when ``total ≥ 2``, ``decode`` the rest.
    """
    total = max(int(total), 0)
    if planned.unified.replicas > 0 and planned.prefill.replicas == 0 and planned.decode.replicas == 0:
        return replace(planned, unified=PoolSize(total, planned.unified.tp))
    if ratio is None or not math.isfinite(ratio) or ratio < 0:
        p, d = planned.prefill.replicas, planned.decode.replicas
        ratio = p / d if d > 0 else (math.inf if p > 0 else 1.0)
    share = ratio / (1.0 + ratio) if math.isfinite(ratio) else 1.0
    n_p = int(round(total * share))
    if total >= 2:
        n_p = min(max(n_p, 1), total - 1)
    return replace(planned, prefill=PoolSize(n_p, planned.prefill.tp), decode=PoolSize(total - n_p, planned.decode.tp),
                   unified=PoolSize(0, planned.unified.tp))


def pool_changes(old: ClusterTarget, new: ClusterTarget) -> dict[str, tuple[int, int]]:
    """Pools whose replica count changes: pool → (old replicas, new replicas)."""
    out: dict[str, tuple[int, int]] = {}
    for name in POOLS:
        a, b = getattr(old, name).replicas, getattr(new, name).replicas
        if a != b:
            out[name] = (a, b)
    return out


@dataclass(frozen=True)
class LoopOutcome:
    """What one interval decided.

    Attributes:
        target: the pools to converge to (the previous target when nothing could be observed).
        reason: one line: why (shown in events, logs and ``status.plan.reason``).
        observed: whether an observation was available.
        degraded: why the loop is degraded (no observation), else None.
        changes: pools whose replica count changes: pool → (old, new); scale-ins must be drained first.
        forecast: series → {"mean", "lower", "upper"} (requests/s or tokens) of the planner, if it forecasts.
        inputs: the numbers behind the plan (ratio, decode_concurrency, expected_ttft_s, …).
        observation: what was observed, or None.
        forecast_ready: the planner's forecaster has the history its method needs (False in cold start, when
            the observed load is planned for, and for planners that do not forecast).
    """

    target: ClusterTarget
    reason: str
    observed: bool
    degraded: str | None = None
    changes: dict[str, tuple[int, int]] = field(default_factory=dict)
    forecast: dict[str, dict[str, float]] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    observation: Observation | None = None
    forecast_ready: bool = False

    @property
    def scale_in(self) -> dict[str, tuple[int, int]]:
        """The pools this outcome shrinks: pool → (old, new)."""
        return {k: v for k, v in self.changes.items() if v[1] < v[0]}

    @property
    def scale_out(self) -> dict[str, tuple[int, int]]:
        """The pools this outcome grows: pool → (old, new)."""
        return {k: v for k, v in self.changes.items() if v[1] > v[0]}


class ControlLoop:
    """The operator's planner loop for one LLMServe (see module doc).

    Args:
        spec: the validated LLMServe spec.
        profile: its performance profile.
        current: the target in force (from ``status`` after a restart, else the initial target).
        planner: the planner to drive; default ``make_planner(policy_name(spec), spec, profile)``.

    Raises:
        ValueError: the spec names an unknown scaling policy.
    """

    def __init__(self, spec: LLMServeSpec, profile: PerformanceProfile, current: ClusterTarget,
                 planner: Planner | None = None) -> None:
        self.spec = spec
        self.profile = profile
        self.current = current
        self.planner: Planner = planner or make_planner(policy_name(spec), spec, profile)

    @property
    def interval_s(self) -> float:
        """The planner interval, seconds."""
        return float(self.planner.tick_s)

    @property
    def forecaster(self) -> Any | None:
        """The planner's load forecaster (``observe`` and ``forecast``), or None for a planner without one."""
        fc = getattr(self.planner, "forecaster", None)
        return fc if hasattr(fc, "observe") and hasattr(fc, "forecast") else None

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

    def step(self, obs: Observation | None, *, error: str | None = None) -> LoopOutcome:
        """One interval. ``obs`` None (``error`` says why) keeps the target in force and reports degraded.

        Never raises on odd observations (the planner contract); the returned target becomes ``current``.
        """
        if obs is None:
            why = error or "no observation"
            return LoopOutcome(target=self.current, reason=f"hold: no observation ({why}); not scaling blind",
                               observed=False, degraded=why)
        decision = self.planner.step(obs, self.current)
        target = decision.target
        reason = decision.reason
        owner, total = replica_owner(self.spec)
        if owner == "External" and total is not None:
            ratio = decision.inputs.get("ratio")
            target = distribute(total, target, float(ratio) if isinstance(ratio, (int, float)) else None)
            reason = f"external replica owner: {total} instances split by the planned ratio [{reason}]"
        changes = pool_changes(self.current, target)
        tp_changed = any(getattr(self.current, p).tp != getattr(target, p).tp for p in POOLS)
        if not changes and not tp_changed:
            reason = f"hold: {reason}" if not reason.startswith("hold") else reason
        self.current = target
        return LoopOutcome(target=target, reason=reason, observed=True, changes=changes,
                           forecast=dict(decision.forecast), inputs=dict(decision.inputs), observation=obs,
                           forecast_ready=self._forecast_ready())

    def _forecast_ready(self) -> bool:
        forecaster = self.forecaster
        if forecaster is None:
            return False
        try:
            return bool(forecaster.forecast(1).ready)
        except Exception:  # a forecaster that cannot forecast yet is simply not ready
            return False
