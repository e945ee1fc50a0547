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

:func:`policy_params` derives those parameters from a plan (:class:`~fulcrum.target.RoutingParams`) and the
serving spec's facts; the operator writes its result into the router's config and ``fulcrum replay`` builds the
simulator's policy from it, so both run the same policy with the same parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.routing.base import Policy
from fulcrum.routing.disaggregated import DisaggregatedPolicy
from fulcrum.routing.least_loaded import LeastLoadedPolicy
from fulcrum.routing.load_aware import LoadAwarePolicy
from fulcrum.routing.round_robin import RoundRobinPolicy
from fulcrum.routing.split import SplitPolicy
from fulcrum.target import RoutingParams

__all__ = ["POLICIES", "PlanPolicyFactory", "make_policy", "policy_parameters", "policy_params", "reconfigured"]

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
            value the policy rejects or of the wrong type (the message names the policy, the parameter and its
            value).
    """
    known = policy_parameters(name)
    given = dict(params or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))} for routing policy {name!r}; known: {listed}")
    factory = POLICIES[name]
    try:
        return factory(**given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"routing policy {name!r}: {_culprit(factory, given)}: {err}") from err


def _culprit(factory: Callable[..., Policy], given: Mapping[str, Any]) -> str:
    """Which of ``given`` a failed construction is about: the first parameter the policy refuses on its own
    (the others at their defaults), else all of them (they are refused only together)."""
    for key, value in given.items():
        try:
            factory(**{key: value})
        except (TypeError, ValueError):
            return f"parameter {key!r} = {_short(value)} is invalid"
    listed = ", ".join(f"{k}={_short(v)}" for k, v in given.items())
    return f"parameters {listed} are invalid together" if given else "cannot be built"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def policy_params(
    name: str,
    routing: RoutingParams,
    *,
    disaggregated: bool,
    kv_block_tokens: int,
    profile: PerformanceProfile | str | Mapping[str, Any] | None = None,
    prefix_pull: bool = False,
) -> dict[str, Any]:
    """The constructor parameters of policy ``name`` under a plan.

    Args:
        name: a policy name (:data:`POLICIES`).
        routing: the plan's per-request parameters (ultra-short threshold, DOPD Alg. 1's i_next, timeout and
            token budget).
        disaggregated: the spec serves in Disaggregated mode (``load_aware`` then always picks a prefill and a
            decode instance; otherwise it goes by the roles on offer, :class:`LoadAwarePolicy`'s default, which
            follows an Auto spec's mode and a Unified pool's role reassignment).
        kv_block_tokens: the engines' KV block size, tokens (prefix hashes; the split policy's handoff nudge).
        profile: timing data of the split policy's execution predictor (an object, a built-in name or the
            mapping format); None: the split policy runs its cold-start path.
        prefix_pull: BanaServe §4.2 prefix pulls (``load_aware`` only).

    Raises:
        ValueError: unknown policy (the message lists the known ones).
    """
    policy_parameters(name)  # unknown names fail here
    if name == DisaggregatedPolicy.name:
        return {
            "ultra_short_tokens": routing.ultra_short_tokens,
            "kv_block_tokens": kv_block_tokens,
            "long_request_tokens": routing.long_request_tokens,
            # DOPD Alg. 1 groups short prompts only when the plan asks for length-aware batching
            "batch_timeout_s": routing.batch_timeout_s if routing.length_aware_batching else 0.0,
            "max_batch_tokens": routing.max_prefill_batch_tokens,
        }
    if name == SplitPolicy.name:
        params: dict[str, Any] = {"kv_block_tokens": kv_block_tokens}
        if profile is not None:
            params["profile"] = profile
        return params
    if name == LoadAwarePolicy.name:
        params = {"disaggregate": True} if disaggregated else {}
        if prefix_pull:  # BanaServe §4.2: pull a cached prefix from its holder when cheaper
            params.update(prefix_pull=True, kv_block_tokens=kv_block_tokens)
        return params
    return {}


def reconfigured(policy: Policy, name: str, params: Mapping[str, Any] | None = None,
                 build: Callable[[str, Mapping[str, Any]], Policy] = make_policy) -> Policy:
    """Policy ``name`` with ``params``: ``policy`` itself, changed in place, when it is policy ``name`` and its
    ``reconfigure(params)`` takes them (it keeps what it learned: :meth:`DisaggregatedPolicy.reconfigure`), else
    ``build(name, params)`` (default :func:`make_policy`; the router passes its own factory). The caller compares
    ``capabilities`` by identity: a new object (always, for a new policy) means new prefill gates.

    Raises:
        whatever ``build`` raises (:func:`make_policy`: ValueError for an unknown policy or parameter or a value
        the policy rejects or of the wrong type); ``policy`` is unchanged then.
    """
    given = dict(params or {})
    reconfigure = getattr(policy, "reconfigure", None)
    if policy.name == name and callable(reconfigure):
        try:
            if reconfigure(given):
                return policy
        except (TypeError, ValueError):
            pass  # nothing changed; ``build`` says what is wrong with the parameters
    return build(name, given)


@dataclass(frozen=True)
class PlanPolicyFactory:
    """Routing policy ``name`` as the router runs it under a sequence of plans: ``factory(routing)`` builds it
    from a plan's :class:`~fulcrum.target.RoutingParams` (``params_of`` maps them to the constructor's
    parameters, as :func:`policy_params` does for the operator), and ``factory.config(routing)`` is what the
    router's config holds of it: ``(name, params)``.

    The router builds a new policy only when that config changes (``RouterState.apply_config``), so the
    policy's learned state (the split policy's execution predictor, the in-flight placements) survives a plan
    that moves only parameters the policy does not take; the simulator rebuilds on the same condition.

    Raises (on a call):
        ValueError: unknown parameter or a value the policy rejects (:func:`make_policy`).
    """

    name: str
    params_of: Callable[[RoutingParams], dict[str, Any]]

    def config(self, routing: RoutingParams) -> tuple[str, dict[str, Any]]:
        """The router config's policy section under ``routing``: (name, constructor parameters)."""
        return self.name, self.params_of(routing)

    def __call__(self, routing: RoutingParams) -> Policy:
        return make_policy(self.name, self.params_of(routing))

    def rebuild(self, policy: Policy, routing: RoutingParams) -> Policy:
        """The policy under a plan whose config section differs from ``policy``'s: ``policy`` reconfigured in
        place where it can take the new parameters, else a new one (:func:`reconfigured`, as the router's
        ``RouterState.apply_config`` does)."""
        return reconfigured(policy, self.name, self.params_of(routing))
