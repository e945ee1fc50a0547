"""Graceful scale-in: drain the least-loaded pods of a pool, then lower its replicas. No in-flight request dies.

The protocol, for a pool going from N to M < N instances (DESIGN principle 3; the users' complaint that
"scale-down kills in-flight requests"):

1. **pick** the N−M victims: pods that are not ready first (they serve nothing), then the least loaded by
   their own ``/metrics`` (``vllm:num_requests_running + vllm:num_requests_waiting``), ties by name;
2. **mark draining**: add them to the router ConfigMap's ``draining`` list — the router sends them no new
   requests, in-flight ones finish (the router reloads its config within seconds);
3. **wait** until each victim's running + waiting is 0 (polling its ``/metrics``) or the drain timeout
   (``spec.scaling.drainTimeoutSeconds``, default 300 s) — on timeout a Warning Event and the Degraded condition
   say which pods still had work, and the scale-in proceeds (the worker's own SIGTERM drain still runs);
4. **set** ``controller.kubernetes.io/pod-deletion-cost`` to :data:`DRAINED_DELETION_COST` on the victims, so
   the ReplicaSet controller deletes exactly them when replicas drop;
5. **lower replicas** of the pool Deployment to M;
6. **unmark**: remove them from ``draining`` (they are terminating; their registry entries go with them).

Cancelled (the operator runs drains in the background and stops one when the plan wants the pool back),
:func:`drain_pool` unmarks the pods it marked before re-raising: they serve again.

:func:`drain_steps` is the pure ordering (unit-tested); :func:`drain_pool` runs it against a
:class:`DrainIO` (the Kubernetes/HTTP adapter in ``handlers.py``, an in-memory fake in tests) with an
injected clock and sleep.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "DELETION_COST_ANNOTATION",
    "DRAINED_DELETION_COST",
    "PodLoad",
    "DrainStep",
    "DrainIO",
    "DrainResult",
    "pick_victims",
    "drain_steps",
    "drain_pool",
    "load_from_metrics",
]

#: The annotation the ReplicaSet controller reads to choose which pods to delete first (lower = first).
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
#: The cost set on drained pods: far below the default 0 of every other pod.
DRAINED_DELETION_COST = -1_000_000


@dataclass(frozen=True)
class PodLoad:
    """One worker pod and its load.

    Attributes:
        name: pod name (= the instance id in the router and etcd, contract).
        ready: the pod's Ready condition.
        running: ``vllm:num_requests_running`` (requests), NaN when its /metrics could not be read.
        waiting: ``vllm:num_requests_waiting`` (requests), NaN when unread.
    """

    name: str
    ready: bool = True
    running: float = 0.0
    waiting: float = 0.0

    @property
    def load(self) -> float:
        """running + waiting; +inf when unknown (an unreadable ready pod may be busy: never pick it first)."""
        v = self.running + self.waiting
        return v if math.isfinite(v) else math.inf


def pick_victims(pods: Sequence[PodLoad], count: int) -> list[str]:
    """The ``count`` pods to remove: not ready first, then least loaded, then by name (deterministic)."""
    if count <= 0:
        return []
    ranked = sorted(pods, key=lambda p: (p.ready, p.load if p.ready else 0.0, p.name))
    return [p.name for p in ranked[:count]]


@dataclass(frozen=True)
class DrainStep:
    """One step of the protocol: ``kind`` in mark | wait | deletion_cost | scale | unmark."""

    kind: str
    pods: tuple[str, ...] = ()
    replicas: int | None = None


def drain_steps(pool: str, victims: Sequence[str], new_replicas: int) -> list[DrainStep]:
    """The protocol's ordering for ``victims`` of ``pool`` (module doc, steps 2–6); pure.

    Raises:
        ValueError: ``new_replicas`` < 0.
    """
    if new_replicas < 0:
        raise ValueError(f"{pool}: replicas must be >= 0, got {new_replicas}")
    v = tuple(victims)
    if not v:
        return [DrainStep("scale", (), new_replicas)]
    return [DrainStep("mark", v), DrainStep("wait", v), DrainStep("deletion_cost", v),
            DrainStep("scale", v, new_replicas), DrainStep("unmark", v)]


class DrainIO(Protocol):
    """The I/O a drain needs. Implementations translate their errors to FulcrumError subclasses."""

    async def pod_loads(self, pool: str) -> list[PodLoad]:
        """Every pod of the pool with its load."""
        ...

    async def loads(self, pods: Sequence[str]) -> Mapping[str, float]:
        """running + waiting of each named pod now; a pod that is gone or unreadable maps to 0."""
        ...

    async def mark_draining(self, pods: Sequence[str]) -> None:
        """Add ``pods`` to the router ConfigMap's ``draining`` list."""
        ...

    async def unmark_draining(self, pods: Sequence[str]) -> None:
        """Remove ``pods`` from ``draining``."""
        ...

    async def set_deletion_cost(self, pods: Sequence[str], cost: int) -> None:
        """Annotate ``pods`` with the pod-deletion cost."""
        ...

    async def scale(self, pool: str, replicas: int) -> None:
        """Set the pool Deployment's replicas."""
        ...

    async def event(self, type_: str, reason: str, message: str) -> None:
        """Post an Event on the LLMServe (``type_``: Normal | Warning)."""
        ...


@dataclass(frozen=True)
class DrainResult:
    """How a drain went.

    Attributes:
        pool: the pool; victims: the pods removed; replicas: the new count.
        timed_out: the timeout passed with work left; busy: pod → running + waiting left at the timeout.
        waited_s: seconds spent waiting for in-flight requests.
    """

    pool: str
    victims: tuple[str, ...]
    replicas: int
    timed_out: bool = False
    busy: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0


async def drain_pool(
    io: DrainIO,
    pool: str,
    new_replicas: int,
    *,
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
) -> DrainResult:
    """Drain ``pool`` down to ``new_replicas`` instances (module doc). Idempotent over a restart: marking,
    annotating and scaling again are no-ops.

    Args:
        io: the adapter; timeout_s: the drain timeout, seconds; poll_s: seconds between load polls.
        clock: monotonic seconds; sleep: awaits that many seconds (injected: tests run instantly).

    Raises:
        whatever ``io`` raises (the caller reports it; the pool keeps its replicas, the router its list).
    """
    pods = await io.pod_loads(pool)
    victims = pick_victims(pods, len(pods) - new_replicas)
    result = DrainResult(pool, tuple(victims), new_replicas)
    marked: Sequence[str] = ()
    try:
        for step in drain_steps(pool, victims, new_replicas):
            if step.kind == "mark":
                marked = step.pods  # before the await: a cancel during the mark must still unmark them
                await io.mark_draining(step.pods)
            elif step.kind == "wait":
                result = await _wait_idle(io, result, timeout_s=timeout_s, poll_s=poll_s, clock=clock, sleep=sleep)
            elif step.kind == "deletion_cost":
                await io.set_deletion_cost(step.pods, DRAINED_DELETION_COST)
            elif step.kind == "scale":
                await io.scale(pool, int(step.replicas or 0))
            elif step.kind == "unmark":
                await io.unmark_draining(step.pods)
                marked = ()
    except asyncio.CancelledError:
        if marked:  # stopped (the plan wants the pool back): the pods serve again, or leave the router's list
            await io.unmark_draining(marked)
        raise
    return result


async def _wait_idle(io: DrainIO, result: DrainResult, *, timeout_s: float, poll_s: float,
                     clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]]) -> DrainResult:
    start = clock()
    busy: dict[str, float] = {}
    while True:
        loads = await io.loads(result.victims)
        busy = {p: float(v) for p, v in loads.items() if v > 0}
        waited = clock() - start
        if not busy:
            return DrainResult(result.pool, result.victims, result.replicas, False, {}, waited)
        if waited >= timeout_s:
            await io.event("Warning", "DrainTimeout",
                           f"{result.pool}: drain timeout after {waited:.0f} s with requests left on "
                           + ", ".join(f"{p} ({v:g})" for p, v in sorted(busy.items())) + "; scaling in anyway")
            return DrainResult(result.pool, result.victims, result.replicas, True, busy, waited)
        await sleep(min(poll_s, max(timeout_s - waited, 0.0)) or poll_s)


def load_from_metrics(text: str) -> float:
    """running + waiting requests from a worker's ``/metrics`` text (sum over its label sets).

    Raises:
        ValueError: the text is not the Prometheus exposition format or lacks both gauges.
    """
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    seen = False
    for fam in text_string_to_metric_families(text):
        if fam.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            for s in fam.samples:
                if s.name == fam.name:
                    total += float(s.value)
                    seen = True
    if not seen:
        raise ValueError("no vllm:num_requests_running/waiting in the metrics")
    return total
