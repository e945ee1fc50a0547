"""The seam between the control loop and a cluster: what :class:`~fulcrum.scaling.loop.ControlLoop` needs of one.

The loop observes the last interval's load, plans, and applies a :class:`~fulcrum.target.ClusterTarget`; a
:class:`Cluster` is where it does so. Three implement it (the connector seam of Dynamo's planner,
``connectors/base.py`` + ``connectors/virtual.py``):

- the simulator (:class:`fulcrum.simulator.Simulation`) in ``fulcrum replay``: instances with start-up delay,
  prefill, transfer and decode timed by the profile;
- the Kubernetes adapter (``fulcrum.controller.handlers.KubernetesCluster``): Prometheus for the observation,
  Deployments for the pools, the router ConfigMap's ``draining`` list and pod-deletion cost for a scale-in;
- :class:`fulcrum.scaling.in_memory.InMemoryCluster`: no time, no requests; observations are handed to it and the
  pools it is told to hold are ready after a given number of intervals (tests, dry runs).

Nothing here performs I/O; the Protocol is synchronous (the Kubernetes adapter's calls block on the API and run
in a worker thread of the operator's event loop).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fulcrum.errors import FulcrumError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.target import ClusterTarget, Pool

__all__ = ["Cluster", "ObservationError"]


class ObservationError(FulcrumError):
    """No trustworthy observation this interval (Prometheus unreachable, failing or without router series; an
    in-memory cluster given none). The control loop holds the target in force: it never scales blind."""


@runtime_checkable
class Cluster(Protocol):
    """What the control loop needs of a cluster: observe, apply a target, readiness, drain.

    Contract, for every implementation:

    - :meth:`observe` measures the interval ``(now − interval_s, now]``; it raises :class:`ObservationError`
      when nothing trustworthy was measured (never returns a made-up zero load).
    - :meth:`apply` converges the pools to ``target``: pools that grow, TP and routing-parameter changes take effect
      at once (new instances become ready after their start-up time); a pool that shrinks is **drained, never
      cut**: its victims get no new requests and leave once their in-flight requests are done (or at the drain
      timeout), so :meth:`ready` may count them until then. Applying the target already in force is a no-op where
      nothing has changed, and reasserts it where something outside the loop has (a person editing replicas).
    - :meth:`ready` counts the instances ready to serve, per pool, now.
    - :meth:`draining` counts the instances being drained (scaled in, not yet gone), per pool, now.
    """

    def observe(self, interval_s: float) -> Observation:
        """Load and service over the last ``interval_s`` seconds.

        Raises:
            ObservationError: nothing trustworthy was measured this interval.
        """
        ...

    def apply(self, target: ClusterTarget, reason: str = "") -> None:
        """Converge to ``target`` (scale-ins drained: see the class doc); ``reason`` says why, in one line, for the
        cluster's events and logs."""
        ...

    def ready(self) -> ReadyCounts:
        """Instances ready to serve now, per pool."""
        ...

    def draining(self) -> dict[Pool, int]:
        """Instances being drained now, per pool (pools without any left out)."""
        ...
