"""The planner protocol every scaling policy implements (Fulcrum's and the reference planners)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from fulcrum.forecast.workload import WorkloadForecaster
from fulcrum.observation import Observation
from fulcrum.ratio.feasibility import SLOInfeasible
from fulcrum.target import ClusterTarget

__all__ = ["Decision", "PlanNumbers", "Planner"]


@dataclass(frozen=True)
class PlanNumbers:
    """The numbers a decision came from (STYLE §7): typed where the control loop, the operator's status and
    metrics, and the replay report read them; every other number of a planner in :attr:`detail`.

    Attributes:
        mode: the serving mode planned for (``"Disaggregated"`` | ``"Unified"``), None when the planner does not say.
        ratio: planned prefill instances per decode instance, n_p/n_d (an externally owned instance count is
            split by it, :func:`fulcrum.scaling.loop.distribute`); NaN when the plan has none (Unified mode, a
            planner without a ratio).
        balanced_ratio: DOPD eq. (15)'s n_p/n_d = cc_d·t_p/(t_d·OSL); NaN when not computed.
        decode_concurrency: cc_d, requests one decode instance holds within the TPOT SLO (DOPD eqs. 11–14);
            NaN when unknown.
        expected_ttft_s: TTFT at the SLO percentile the plan expects, seconds; NaN when unknown.
        gpus: GPUs the plan uses before the scaling policy (hysteresis, cooldowns); None when unknown.
        feasible: the plan meets both SLOs within the GPU limits; None when the planner does not judge.
        slo_infeasible: the SLO targets found out of the profile's reach at the forecast lengths (empty: both can
            be met); None when the planner does not judge feasibility (the reference planners).
        notes: why the plan is not feasible, or what it had to give up, one line each.
        detail: the planner's other numbers by name (rates, lengths, capacities, correction factors, mode-switch
            phase, …), for ``fulcrum plan``, reports and tests; nothing reads them to decide.
    """

    mode: str | None = None
    ratio: float = math.nan
    balanced_ratio: float = math.nan
    decode_concurrency: float = math.nan
    expected_ttft_s: float = math.nan
    gpus: int | None = None
    feasible: bool | None = None
    slo_infeasible: tuple[SLOInfeasible, ...] | None = None
    notes: tuple[str, ...] = ()
    detail: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """One planner decision.

    Attributes:
        time_s: when it was made, seconds since the start of the run.
        target: pools the cluster should converge to.
        reason: why, in one line (shown in events, logs and the replay report).
        forecast: the forecast behind it, series name → {"mean", "lower", "upper"} (requests/s or tokens);
            empty for planners that do not forecast.
        numbers: the numbers the plan came from (:class:`PlanNumbers`), for the loop, status and reports.
    """

    time_s: float
    target: ClusterTarget
    reason: str
    forecast: dict[str, dict[str, float]] = field(default_factory=dict)
    numbers: PlanNumbers = field(default_factory=PlanNumbers)


@runtime_checkable
class Planner(Protocol):
    """A scaling policy. ``fulcrum replay`` and the operator drive it the same way:

    1. ``initial()`` once, before any load: the pools to start with;
    2. every ``tick_s`` seconds, ``step(observation, current)`` with what was measured over the last
       ``tick_s`` seconds and the target now in force; it returns the next :class:`Decision`.

    Implementations are deterministic given their inputs, perform no I/O and never raise on odd
    observations (no arrivals, NaN attainment, zeros).

    Attributes:
        name: the registry name (``fulcrum``, ``dopd``, …).
        tick_s: seconds between steps.
        forecaster: the load forecaster the planner keeps (a new control loop feeds it the intervals Prometheus
            kept, ``ControlLoop.warm_start``), or None for a planner without one.
        horizon_steps: how many intervals ahead the forecast in ``Decision.forecast`` is for (1 when it is for
            the next interval or there is none); the replay scores it against the load observed then.
    """

    name: str
    tick_s: float

    @property
    def forecaster(self) -> WorkloadForecaster | None: ...

    @property
    def horizon_steps(self) -> int: ...

    def initial(self) -> ClusterTarget: ...

    def step(self, obs: Observation, current: ClusterTarget) -> Decision: ...
