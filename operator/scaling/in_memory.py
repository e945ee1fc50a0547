"""A :class:`~fulcrum.cluster.Cluster` held in memory: pools of instances with a start-up and a drain time, and
the load of each interval handed to it. No requests are served and nothing is timed by a profile.

Used by the control-loop and operator tests (the loop's rules — hold when blind, the external replica owner,
drain before scale-in — tested without a Kubernetes API or a simulator) and for dry runs of a planner on
recorded observations (``observe`` returns what was fed, with this cluster's readiness).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from fulcrum.cluster import ObservationError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.target import ClusterTarget, Pool

__all__ = ["InMemoryCluster", "Applied"]


@dataclass
class _Instance:
    """One instance: ready from ``ready_at_s``; drained away at ``gone_at_s`` (None while serving)."""

    name: str
    tp: int
    ready_at_s: float
    gone_at_s: float | None = None


@dataclass(frozen=True)
class Applied:
    """One :meth:`InMemoryCluster.apply` call: when (s), the target, and the reason given."""

    time_s: float
    target: ClusterTarget
    reason: str


class InMemoryCluster:
    """Pools of instances in memory (module doc). Implements :class:`fulcrum.cluster.Cluster`.

    Time advances only by :meth:`observe` (``interval_s`` per call) and :meth:`advance`.

    Args:
        initial: the pools at time 0; their instances are ready at once.
        startup_s: seconds from a scale-out until a new instance is ready (≥ 0).
        drain_s: seconds a drained instance keeps serving its in-flight requests before it is gone (≥ 0; 0:
            gone at the next tick of time).

    Raises:
        ValueError: a negative start-up or drain time.
    """

    def __init__(self, initial: ClusterTarget = ClusterTarget(), *, startup_s: float = 0.0, drain_s: float = 0.0) -> None:
        if startup_s < 0 or drain_s < 0:
            raise ValueError(f"start-up and drain times must be >= 0, got {startup_s}, {drain_s}")
        self.startup_s = float(startup_s)
        self.drain_s = float(drain_s)
        self.now_s = 0.0
        self.target = initial
        self.applied: list[Applied] = []
        """Every ``apply`` call, oldest first."""
        self._loads: deque[Observation | ObservationError] = deque()
        self._pools: dict[Pool, list[_Instance]] = {p: [] for p in Pool}
        self._next = 0
        for pool, size in initial.pools():
            self._add(pool, size.replicas, size.tp, ready_at_s=0.0)

    # ------------------------------------------------------------------ feeding
    def feed(self, *loads: Observation | ObservationError) -> None:
        """Queue what the next :meth:`observe` calls return: an observation (its time, interval and readiness
        are replaced by this cluster's), or an :class:`ObservationError` to raise (a blind interval)."""
        self._loads.extend(loads)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (≥ 0) pass: instances become ready, drained ones go."""
        self.now_s += max(float(seconds), 0.0)
        for instances in self._pools.values():
            instances[:] = [i for i in instances if i.gone_at_s is None or i.gone_at_s > self.now_s]

    # ------------------------------------------------------------------ Cluster
    def observe(self, interval_s: float) -> Observation:
        """Advance ``interval_s`` seconds and return the next fed load over them.

        Raises:
            ObservationError: nothing fed for this interval, or an error was fed.
        """
        self.advance(interval_s)
        if not self._loads:
            raise ObservationError(f"no load fed for the interval ending at {self.now_s:g} s")
        load = self._loads.popleft()
        if isinstance(load, ObservationError):
            raise load
        return replace(load, time_s=self.now_s, interval_s=float(interval_s), ready=self.ready())

    def apply(self, target: ClusterTarget, reason: str = "") -> None:
        """Converge to ``target`` now: new instances ready after ``startup_s``; a TP change replaces the pool's
        instances (the old ones drain); a shrinking pool drains its victims (not ready first, then the newest),
        which leave after ``drain_s``. Every call is recorded in :attr:`applied`."""
        self.applied.append(Applied(self.now_s, target, reason))
        self.target = target
        for pool, size in target.pools():
            serving = [i for i in self._pools[pool] if i.gone_at_s is None]
            if any(i.tp != size.tp for i in serving):
                self._drain(serving)
                serving = []
            if len(serving) < size.replicas:
                self._add(pool, size.replicas - len(serving), size.tp, ready_at_s=self.now_s + self.startup_s)
            elif len(serving) > size.replicas:
                order = sorted(serving, key=lambda i: (i.ready_at_s <= self.now_s, -i.ready_at_s, i.name))
                self._drain(order[: len(serving) - size.replicas])

    def ready(self) -> ReadyCounts:
        """Instances ready and not draining, per pool."""
        n = {p: sum(1 for i in self._pools[p] if i.gone_at_s is None and i.ready_at_s <= self.now_s) for p in Pool}
        return ReadyCounts(prefill=n[Pool.PREFILL], decode=n[Pool.DECODE], unified=n[Pool.UNIFIED])

    def draining(self) -> dict[Pool, int]:
        """Instances draining (scaled in, not yet gone), per pool that has any."""
        n = {p: sum(1 for i in self._pools[p] if i.gone_at_s is not None) for p in Pool}
        return {p: k for p, k in n.items() if k}

    # ------------------------------------------------------------------ helpers
    def instances(self, pool: Pool) -> list[str]:
        """Names of ``pool``'s instances not yet gone (draining ones included), oldest first."""
        return [i.name for i in self._pools[pool]]

    def _add(self, pool: Pool, n: int, tp: int, *, ready_at_s: float) -> None:
        for _ in range(n):
            self._pools[pool].append(_Instance(f"{pool.value}-{self._next}", tp, ready_at_s))
            self._next += 1

    def _drain(self, victims: list[_Instance]) -> None:
        for i in victims:
            i.gone_at_s = self.now_s + self.drain_s
