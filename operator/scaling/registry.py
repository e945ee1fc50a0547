"""The planner registry: a name of :class:`~fulcrum.api.llmserve.PlannerName` → the planner it builds.

``spec.scaling.planner`` names the planner the operator runs; ``fulcrum replay --policy`` / ``--compare`` run the
same names through the same :func:`make_planner`, so a replay runs the object the operator runs.
"""

from __future__ import annotations

from collections.abc import Callable

from fulcrum.api.llmserve import LLMServeSpec, PlannerName
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.dopd import DopdPlanner
from fulcrum.scaling.dynamo_load import DynamoLoadPlanner
from fulcrum.scaling.dynamo_sla import DynamoSlaPlanner, DynamoSlaSettings
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.planner import Planner
from fulcrum.scaling.static import StaticPlanner

__all__ = ["PLANNERS", "make_planner"]

#: Planner name (a :class:`PlannerName` value) → factory. ``fulcrum`` first: the others are compared against it.
PLANNERS: dict[str, Callable[[LLMServeSpec, PerformanceProfile], Planner]] = {
    PlannerName.FULCRUM.value: FulcrumPlanner,
    PlannerName.DOPD.value: DopdPlanner,
    PlannerName.STATIC.value: StaticPlanner,
    # Dynamo counts demand at request start since 2026 (ai-dynamo/dynamo PRs #9526, #11693): compare with that.
    PlannerName.DYNAMO_SLA.value: lambda spec, profile: DynamoSlaPlanner(spec, profile, DynamoSlaSettings(demand="arrivals")),
    PlannerName.DYNAMO_LOAD.value: DynamoLoadPlanner,
}


def make_planner(name: str | PlannerName, spec: LLMServeSpec, profile: PerformanceProfile) -> Planner:
    """Build the planner called ``name`` for ``spec`` timed by ``profile``.

    Raises:
        ValueError: unknown planner name (the message lists the known ones).
        PlanningError: the planner cannot be built for this spec and profile (e.g. no TP holds the model).
    """
    key = name.value if isinstance(name, PlannerName) else name
    try:
        factory = PLANNERS[key]
    except KeyError:
        raise ValueError(f"unknown planner {key!r}; choose one of {', '.join(PLANNERS)}") from None
    return factory(spec, profile)
