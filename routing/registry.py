"""Build a routing policy from the router config: ``make_policy(name, params)``.

Names are those of :class:`fulcrum.api.llmserve.RouterPolicy`; ``params`` are the constructor's keyword
arguments (each policy documents them and the reason for each default):

- ``round_robin``: none;
- ``least_loaded``: none;
- ``disaggregated``: ``ultra_short_tokens``, ``miss_weight``, ``kv_block_tokens``, ``long_request_tokens``,
  ``batch_timeout_s``, ``max_batch_tokens``;
- ``split``: ``profile`` (a :class:`~fulcrum.ratio.profile.PerformanceProfile`, a built-in profile name, or the
  profile mapping format — the caller reads files), ``max_probes``, ``epsilon_s``, ``kv_block_tokens``;
- ``load_aware``: ``load_threshold``, ``estimate_ttl_s``, ``disaggregate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from fulcrum.routing.base import Policy
from fulcrum.routing.disaggregated import DisaggregatedPolicy
from fulcrum.routing.least_loaded import LeastLoadedPolicy
from fulcrum.routing.load_aware import LoadAwarePolicy
from fulcrum.routing.round_robin import RoundRobinPolicy
from fulcrum.routing.split import SplitPolicy

__all__ = ["POLICIES", "make_policy", "policy_parameters"]

POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    DisaggregatedPolicy.name: DisaggregatedPolicy,
    SplitPolicy.name: SplitPolicy,
    LoadAwarePolicy.name: LoadAwarePolicy,
}
"""Policy name → constructor."""


def policy_parameters(name: str) -> dict[str, Any]:
    """The keyword parameters of policy ``name`` and their defaults.

    Raises:
        ValueError: unknown policy (the message lists the known ones).
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    sig = inspect.signature(factory)
    return {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Construct policy ``name`` with keyword ``params``.

    Raises:
        ValueError: unknown policy, unknown parameter (the message names it and lists the known ones), or a
            value the policy rejects.
        TypeError: a value of the wrong type where the policy checks it.
    """
    known = policy_parameters(name)
    given = dict(params or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))} for routing policy {name!r}; known: {listed}")
    return POLICIES[name](**given)
