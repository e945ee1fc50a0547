"""The routing policy of a replay: the router's own policies (:mod:`fulcrum.routing`), built as the operator builds
them for the router's config, so ``fulcrum replay --routing NAME`` replays what the router would run.

The simulator builds a policy at the start and whenever the planner's target changes what the router's config
holds of the policy (its name and constructor parameters, :class:`~fulcrum.routing.registry.PlanPolicyFactory`),
as the router does when the operator rewrites its config: a plan that moves only parameters the policy does not
take (the split policy takes none of :class:`~fulcrum.target.RoutingParams`) keeps the policy and what it has
learned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fulcrum.api.llmserve import LLMServeSpec, Mode
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.routing.registry import POLICIES, PlanPolicyFactory, policy_params
from fulcrum.simulator import PolicyFactory, RequestRecord
from fulcrum.target import RoutingParams

__all__ = ["ROUTING_POLICIES", "parse_routing", "routing_factory", "path_counts"]

ROUTING_POLICIES: tuple[str, ...] = tuple(POLICIES)
"""The routing policies a replay can run (those of the router)."""


def parse_routing(text: str) -> list[str]:
    """``NAME[,NAME...]`` → the names, in order, without repeats.

    Raises:
        ValueError: an empty list or an unknown name (the message lists the known ones).
    """
    names: list[str] = []
    for part in text.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no routing policy named; choose from {', '.join(ROUTING_POLICIES)}")
    return names


def routing_factory(name: str, spec: LLMServeSpec, profile: PerformanceProfile) -> PolicyFactory:
    """Builds routing policy ``name`` from a plan's routing parameters with the spec's facts (mode, KV block
    size, ``router.prefixPull``) and the replay's ``profile`` (the split policy's execution predictor), through
    :func:`fulcrum.routing.registry.policy_params` — what the operator writes into the router's config.

    Raises:
        ValueError: unknown policy name.
    """
    if name not in POLICIES:  # fail now, not at the simulator's start
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")
    disaggregated = spec.mode is Mode.DISAGGREGATED
    prefix_pull = spec.router.prefix_pull and name == "load_aware"

    def params_of(routing: RoutingParams) -> dict[str, Any]:
        return policy_params(name, routing, disaggregated=disaggregated, kv_block_tokens=spec.engine.block_size,
                             profile=profile, prefix_pull=prefix_pull)

    return PlanPolicyFactory(name, params_of)


def path_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Requests per path ("disaggregated", "split", "local", "unified"; "" never routed), most first."""
    return dict(Counter(r.path for r in records).most_common())
