"""Graceful scale-in: drain the least-loaded pods of a pool, then lower its replicas. No in-flight request dies.

The protocol, for a pool going from N to M < N instances (DESIGN principle 3; the users' complaint that
"scale-down kills in-flight requests"):

1. **pick** the N−M victims: pods that are not ready first (they serve nothing), then the least loaded by
   their own ``/metrics`` (``vllm:num_requests_running + vllm:num_requests_waiting``), ties by name;
2. **mark draining**: add them to the router ConfigMap's ``draining`` list — the router sends them no new
   requests, in-flight ones finish (the router reloads its config within seconds);
3. **confirm**: poll every router replica's ``/metrics`` until each reports every victim draining
   (``fulcrum_router_instance_draining`` = 1) or does not know it at all — only then is "idle" final, since a
   router that has not reloaded yet may still send a victim a new request after it was seen idle. Past
   ``confirm_timeout_s`` (default 30 s) a Warning Event ``DrainUnconfirmed`` names the routers that lag and the
   drain goes on (the wait below and the worker's own SIGTERM drain still protect in-flight requests);
4. **wait** until each victim's running + waiting is 0 (polling its ``/metrics``) or the drain timeout
   (``spec.scaling.drainTimeoutSeconds``, default 300 s) — on timeout a Warning Event and the Degraded condition
   say which pods still had work, and the scale-in proceeds (the worker's own SIGTERM drain still runs);
5. **set** ``controller.kubernetes.io/pod-deletion-cost`` to :data:`DRAINED_DELETION_COST` on the victims, so
   the ReplicaSet controller deletes exactly them when replicas drop;
6. **lower replicas** of the pool Deployment to M;
7. **unmark**: remove them from ``draining`` (they are terminating; their registry entries go with them).

Cancelled (the operator runs drains in the background and stops one when the plan wants the pool back), or failing
(the API refused a write after retries), :func:`drain_pool` puts its victims back into service before re-raising:
it resets the pod-deletion cost it set (to 0, the default) and unmarks the pods it marked — a pod left with the
drained cost would be the first the ReplicaSet deletes at the pool's next scale-in, busy, instead of that drain's
own victims. Once the replicas write of step 6 is sent it is waited for even when the drain is cancelled (it cannot
be called back): the victims then keep their cost, which makes the ReplicaSet delete exactly them.

:func:`drain_steps` is the pure ordering (unit-tested); :func:`drain_pool` runs it against a
:class:`DrainIO` (the Kubernetes/HTTP adapter in ``handlers.py``, an in-memory fake in tests) with an
injected clock and sleep.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
    "draining_from_metrics",
    "load_from_metrics",
]

log = logging.getLogger("fulcrum.operator")

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
    """One step of the protocol: ``kind`` in mark | confirm | wait | deletion_cost | scale | unmark."""

    kind: str
    pods: tuple[str, ...] = ()
    replicas: int | None = None


def drain_steps(pool: str, victims: Sequence[str], new_replicas: int) -> list[DrainStep]:
    """The protocol's ordering for ``victims`` of ``pool`` (module doc, steps 2–7); pure.

    Raises:
        ValueError: ``new_replicas`` < 0.
    """
    if new_replicas < 0:
        raise ValueError(f"{pool}: replicas must be >= 0, got {new_replicas}")
    v = tuple(victims)
    if not v:
        return [DrainStep("scale", (), new_replicas)]
    return [DrainStep("mark", v), DrainStep("confirm", v), DrainStep("wait", v), DrainStep("deletion_cost", v),
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

    async def routers_lagging(self, pods: Sequence[str]) -> list[str]:
        """The router replicas that may still send one of ``pods`` a new request: those whose ``/metrics`` lists
        one of them as not draining, or that could not be read. Empty when every router has the list (or there
        is no router)."""
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
        confirmed_s: seconds until every router reported the victims draining (the timeout when unconfirmed).
        unconfirmed: the router replicas still lagging at the confirm timeout (empty when confirmed).
    """

    pool: str
    victims: tuple[str, ...]
    replicas: int
    timed_out: bool = False
    busy: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0
    confirmed_s: float = 0.0
    unconfirmed: tuple[str, ...] = ()


async def drain_pool(
    io: DrainIO,
    pool: str,
    new_replicas: int,
    *,
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
    confirm_timeout_s: float = 30.0,
) -> DrainResult:
    """Drain ``pool`` down to ``new_replicas`` instances (module doc). Idempotent over a restart: marking,
    annotating and scaling again are no-ops.

    Args:
        io: the adapter; timeout_s: the drain timeout, seconds; poll_s: seconds between load polls.
        clock: monotonic seconds; sleep: awaits that many seconds (injected: tests run instantly).
        confirm_timeout_s: seconds to wait for every router to report the victims draining (module doc, step 3).

    Raises:
        whatever ``io`` raises (the caller reports it). Before the replicas dropped, the victims are put back into
        service first (module doc): the pool keeps its replicas and serves with all of them.
    """
    pods = await io.pod_loads(pool)
    victims = pick_victims(pods, len(pods) - new_replicas)
    result = DrainResult(pool, tuple(victims), new_replicas)
    marked: Sequence[str] = ()
    costed: Sequence[str] = ()
    try:
        for step in drain_steps(pool, victims, new_replicas):
            if step.kind == "mark":
                marked = step.pods  # before the await: a cancel during the mark must still unmark them
                await io.mark_draining(step.pods)
            elif step.kind == "confirm":
                result = await _confirm_marked(io, result, timeout_s=confirm_timeout_s, poll_s=poll_s, clock=clock,
                                               sleep=sleep)
            elif step.kind == "wait":
                result = await _wait_idle(io, result, timeout_s=timeout_s, poll_s=poll_s, clock=clock, sleep=sleep)
            elif step.kind == "deletion_cost":
                costed = step.pods  # before the await: an annotation may land although the call failed
                await io.set_deletion_cost(step.pods, DRAINED_DELETION_COST)
            elif step.kind == "scale":
                # its API write cannot be called back: finished even when the drain is stopped meanwhile, so that
                # the victims' cost is kept exactly when the replicas dropped (or still may)
                scaling = asyncio.ensure_future(io.scale(pool, int(step.replicas or 0)))
                scaling.add_done_callback(_retrieve)
                stopped = await _wait_through_cancel(scaling)
                if not scaling.done() or (not scaling.cancelled() and scaling.exception() is None):
                    costed = ()  # the ReplicaSet deletes exactly the pods with the cost
                if stopped:
                    raise asyncio.CancelledError()
                scaling.result()
            elif step.kind == "unmark":
                await io.unmark_draining(step.pods)
                marked = ()
    except (Exception, asyncio.CancelledError):  # not GeneratorExit: a closed coroutine may not await
        # failed or stopped (the plan wants the pool back) before the replicas dropped: the victims serve again —
        # off the router's draining list, and without the cost that would make the ReplicaSet delete them, busy,
        # at the pool's next scale-in instead of that drain's own victims
        await _undo(io, pool, marked, costed)
        raise
    return result


async def _wait_through_cancel(task: asyncio.Future[None]) -> bool:
    """Wait for ``task`` through one cancellation of the caller (a second one stops the wait, the task runs on);
    True when the caller was cancelled meanwhile. The task's own outcome is left in it."""
    stopped = False
    for _ in range(2):
        try:
            await asyncio.shield(task)
            return stopped
        except asyncio.CancelledError:
            if task.done():
                return stopped
            stopped = True
        except Exception:  # noqa: BLE001 - the caller reads it from the task
            return stopped
    return stopped


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a scale's failure retrieved: a stopped drain re-raises its cancel, not the failure of a write it let run."""
    if not task.cancelled():
        task.exception()


async def _undo(io: DrainIO, pool: str, marked: Sequence[str], costed: Sequence[str]) -> None:
    """Put a failed or stopped drain's victims back into service (best effort: the original error is raised)."""
    if costed:
        try:
            await io.set_deletion_cost(costed, 0)
        except Exception as err:  # noqa: BLE001 - reported with the drain's own failure
            log.warning("%s: pod-deletion cost of %s not reset: %s", pool, ", ".join(costed), err)
    if marked:
        try:
            await io.unmark_draining(marked)
        except Exception as err:  # noqa: BLE001
            log.warning("%s: %s not taken off the draining list: %s", pool, ", ".join(marked), err)


async def _confirm_marked(io: DrainIO, result: DrainResult, *, timeout_s: float, poll_s: float,
                          clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]]) -> DrainResult:
    start = clock()
    poll = min(poll_s, 1.0)  # a router reloads its config within seconds: look more often than for idleness
    while True:
        lagging = tuple(sorted(await io.routers_lagging(result.victims)))
        waited = clock() - start
        if not lagging:
            return replace(result, confirmed_s=waited)
        if waited >= timeout_s:
            await io.event("Warning", "DrainUnconfirmed",
                           f"{result.pool}: after {waited:.0f} s the router replicas {', '.join(lagging)} still did "
                           f"not report {', '.join(result.victims)} draining; waiting for in-flight requests anyway")
            return replace(result, confirmed_s=waited, unconfirmed=lagging)
        await sleep(min(poll, max(timeout_s - waited, 0.0)) or poll)


async def _wait_idle(io: DrainIO, result: DrainResult, *, timeout_s: float, poll_s: float,
                     clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]]) -> DrainResult:
    start = clock()
    busy: dict[str, float] = {}
    while True:
        loads = await io.loads(result.victims)
        busy = {p: float(v) for p, v in loads.items() if v > 0}
        waited = clock() - start
        if not busy:
            return replace(result, timed_out=False, busy={}, waited_s=waited)
        if waited >= timeout_s:
            await io.event("Warning", "DrainTimeout",
                           f"{result.pool}: drain timeout after {waited:.0f} s with requests left on "
                           + ", ".join(f"{p} ({v:g})" for p, v in sorted(busy.items())) + "; scaling in anyway")
            return replace(result, timed_out=True, busy=busy, waited_s=waited)
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


def draining_from_metrics(text: str) -> dict[str, bool]:
    """Instance id → draining flag, from a router's ``/metrics`` text (``fulcrum_router_instance_draining``).

    Raises:
        ValueError: the text is not the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, bool] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "fulcrum_router_instance_draining":
            for s in fam.samples:
                if s.name == fam.name and "instance" in s.labels:
                    out[s.labels["instance"]] = out.get(s.labels["instance"], False) or float(s.value) >= 1.0
    return out
