"""Least-loaded baseline: every request colocated on the instance with the least outstanding work.

Load of an instance (from the router's own accounting in :class:`~fulcrum.routing.base.InstanceView`)::

    load = inflight + queued_prefill_tokens / max_num_batched_tokens

i.e. requests in flight plus the engine passes its queued prompt tokens still need — the "least outstanding
requests" rule, with queued prompt work breaking near-ties in favour of the instance that can start sooner.
Ties are broken round-robin. This is also the pair choice Libra §4.1 makes before splitting ("r^α and r^β are
assigned to the two instances with the lowest current load, with round-robin dispatch to break ties").
"""

from __future__ import annotations

from collections.abc import Sequence

from fulcrum.routing.base import NO_CAPABILITIES, InstanceView, NoInstanceError, RequestInfo, RouteDecision
from fulcrum.routing.round_robin import TieBreaker, colocated_candidates, colocated_decision

__all__ = ["LeastLoadedPolicy", "instance_load"]


def instance_load(inst: InstanceView) -> float:
    """In-flight requests plus queued prompt tokens in units of the engine's per-step budget (module doc)."""
    return inst.inflight + inst.queued_prefill_tokens / max(inst.max_num_batched_tokens, 1)


class LeastLoadedPolicy:
    """Baseline: colocate each request on the available "both"/"decode" instance of least :func:`instance_load`.

    ``route`` raises :class:`~fulcrum.routing.base.NoInstanceError` when no instance may take a whole
    request.
    """

    name = "least_loaded"
    capabilities = NO_CAPABILITIES

    def __init__(self) -> None:
        self._ties = TieBreaker()

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        """The least-loaded colocation candidate. Raises NoInstanceError when there is none."""
        cands = colocated_candidates(instances)
        if not cands:
            raise NoInstanceError("least_loaded: no available instance with role 'both' or 'decode'")
        inst = self._ties.pick(cands, instance_load)
        return colocated_decision(req, inst, f"least-loaded load={instance_load(inst):.3g}")

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        """Stateless: nothing to record."""
        return None

    def on_finish(self, request_id: str, now: float) -> None:
        """Stateless: nothing to forget."""
        return None
