"""Round-robin baseline: every request colocated on the next available instance in turn.

Also home of the small pieces every policy shares: which instances may take which part of a request, and the
round-robin tie-break Libra §4.1 uses between equally loaded instances ("round-robin dispatch to break ties").

Roles (:class:`~fulcrum.routing.base.InstanceView.role`): a "prefill" instance only prefills (it runs
with ``max_tokens = 1`` and hands the KV cache on), a "decode" instance decodes and may also prefill a request it
then decodes itself (DOPD §V-E runs ultra-short prompts locally on D-instances), a "both" instance does anything.
So a colocated request may go to "both" or "decode" instances, the first half of a split to "prefill" or "both",
the second half to "decode" or "both".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fulcrum.routing.base import NO_CAPABILITIES, InstanceView, NoInstanceError, RequestInfo, RouteDecision

__all__ = [
    "RoundRobinPolicy",
    "TieBreaker",
    "colocated_candidates",
    "prefill_candidates",
    "decode_candidates",
    "colocated_decision",
]

class TieBreaker:
    """Minimum by a key, ties broken round-robin: the i-th call takes the (i mod t)-th of the t tied minima.

    O(n) per call; deterministic for a given call sequence.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, items: Sequence[InstanceView], key: Callable[[InstanceView], Any]) -> InstanceView:
        """The item with the smallest ``key``; among equal keys, the next one in turn.

        Raises:
            NoInstanceError: ``items`` is empty.
        """
        if not items:
            raise NoInstanceError("no available instance")
        keys = [key(i) for i in items]
        low = min(keys)
        tied = [i for i, k in zip(items, keys) if k == low]
        turn = self._turn
        self._turn += 1
        return tied[turn % len(tied)]


def colocated_candidates(instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Available instances that may run a whole request (role "both" or "decode")."""
    return [i for i in instances if i.available and i.role != "prefill"]


def prefill_candidates(instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Available instances that may run the first part of a split (role "prefill" or "both")."""
    return [i for i in instances if i.available and i.role != "decode"]


def decode_candidates(instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Available instances that may run the second part of a split (role "decode" or "both")."""
    return [i for i in instances if i.available and i.role != "prefill"]


def colocated_decision(req: RequestInfo, inst: InstanceView, reason: str) -> RouteDecision:
    """A colocated decision on ``inst`` (split_token = P + max_tokens, the contract's convention)."""
    return RouteDecision(
        kind="colocated", first=inst.id, split_token=req.prompt_tokens + req.max_tokens, reason=reason
    )


class RoundRobinPolicy:
    """Baseline: colocate each request on the next available "both"/"decode" instance in turn.

    Stateless apart from the turn counter; ignores load. ``route`` raises
    :class:`~fulcrum.routing.base.NoInstanceError` when no instance may take a whole request.
    """

    name = "round_robin"
    capabilities = NO_CAPABILITIES

    def __init__(self) -> None:
        self._turn = 0

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        """The next colocation candidate in turn. Raises NoInstanceError when there is none."""
        cands = colocated_candidates(instances)
        if not cands:
            raise NoInstanceError("round_robin: no available instance with role 'both' or 'decode'")
        inst = cands[self._turn % len(cands)]
        self._turn += 1
        return colocated_decision(req, inst, "round-robin")

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        """Stateless: nothing to record."""
        return None

    def on_finish(self, request_id: str, now: float) -> None:
        """Stateless: nothing to forget."""
        return None
