"""The planner protocol every scaling policy implements (Fulcrum's and the reference planners)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fulcrum.observation import Observation
from fulcrum.target import ClusterTarget

__all__ = ["Decision", "Planner"]


@dataclass(frozen=True)
class Decision:
    """One planner decision.

    Attributes:
        time_s: when it was made, seconds since the start of the run.
        target: pools the cluster should converge to.
        reason: why, in one line (shown in events, logs and the replay report).
        forecast: the forecast behind it, series name → {"mean", "lower", "upper"} (requests/s or tokens);
            empty for planners that do not forecast.
        inputs: the numbers the plan came from (ratio, cc_d, t_p, t_d, …), for status and reports.
    """

    time_s: float
    target: ClusterTarget
    reason: str
    forecast: dict[str, dict[str, float]] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Planner(Protocol):
    """A scaling policy. ``fulcrum replay`` and the operator drive it the same way:

    1. ``initial()`` once, before any load: the pools to start with;
    2. every ``tick_s`` seconds, ``step(observation, current)`` with what was measured over the last
       ``tick_s`` seconds and the target now in force; it returns the next :class:`Decision`.

    Implementations are deterministic given their inputs, perform no I/O and never raise on odd
    observations (no arrivals, NaN attainment, zeros).
    """

    name: str
    tick_s: float

    def initial(self) -> ClusterTarget: ...

    def step(self, obs: Observation, current: ClusterTarget) -> Decision: ...
