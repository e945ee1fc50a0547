"""A drain that fails or is stopped part-way (fulcrum.controller.drain.drain_pool) leaves no pod half-drained: its
victims leave the router's draining list and lose the drained pod-deletion cost, unless the replicas already
dropped — against a FAKE DrainIO."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from fulcrum.controller.apply import KubeApiError
from fulcrum.controller.drain import DRAINED_DELETION_COST, PodLoad, drain_pool

pytestmark = pytest.mark.asyncio


class FakeDrainIO:
    """FAKE cluster: idle pods; ``fail`` maps a call to the error it raises, ``block`` to an event it waits for."""

    def __init__(self, pods: list[PodLoad]) -> None:
        self.pods = pods
        self.draining: set[str] = set()
        self.costs: dict[str, int] = {}
        self.replicas = len(pods)
        self.calls: list[str] = []
        self.fail: dict[str, Exception] = {}
        self.block: dict[str, asyncio.Event] = {}
        self.reached: dict[str, asyncio.Event] = {k: asyncio.Event() for k in ("cost", "scale")}

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.reached:
            self.reached[name].set()
        if name in self.block:
            await self.block[name].wait()
        if name in self.fail:
            raise self.fail.pop(name)

    async def pod_loads(self, pool: str) -> list[PodLoad]:
        return list(self.pods)

    async def loads(self, pods: Sequence[str]) -> Mapping[str, float]:
        return {p: 0.0 for p in pods}

    async def mark_draining(self, pods: Sequence[str]) -> None:
        await self._step("mark")
        self.draining |= set(pods)

    async def unmark_draining(self, pods: Sequence[str]) -> None:
        await self._step("unmark")
        self.draining -= set(pods)

    async def routers_lagging(self, pods: Sequence[str]) -> list[str]:
        return []

    async def set_deletion_cost(self, pods: Sequence[str], cost: int) -> None:
        for p in pods:  # the first pod is annotated before a failure on the second one
            await self._step("cost")
            self.costs[p] = cost

    async def scale(self, pool: str, replicas: int) -> None:
        await self._step("scale")
        self.replicas = replicas

    async def event(self, type_: str, reason: str, message: str) -> None:
        self.calls.append("event")


PODS = [PodLoad("p0", True, 5, 0), PodLoad("p1", True, 0, 0), PodLoad("p2", True, 0, 0)]


def _served(io: FakeDrainIO) -> None:
    """Every pod serves as before the drain: none on the draining list, none with the drained deletion cost."""
    assert io.draining == set()
    assert not [p for p, c in io.costs.items() if c == DRAINED_DELETION_COST], io.costs


async def _drain(io: FakeDrainIO) -> None:
    await drain_pool(io, "decode", 1, timeout_s=30, poll_s=1, clock=lambda: 0.0, sleep=lambda s: asyncio.sleep(0))


async def test_a_scale_the_api_refuses_puts_the_victims_back_into_service() -> None:
    io = FakeDrainIO(PODS)
    io.fail["scale"] = KubeApiError(500, "etcd timeout", "/apis/apps/v1/namespaces/default/deployments/x-decode")
    with pytest.raises(KubeApiError):
        await _drain(io)
    assert io.replicas == 3
    _served(io)  # before: p1 and p2 stayed out of the router's rotation, with the cost the ReplicaSet deletes first


async def test_a_deletion_cost_the_api_refuses_puts_the_victims_back_into_service() -> None:
    io = FakeDrainIO(PODS)
    orig = io.set_deletion_cost

    async def set_cost(pods: Sequence[str], cost: int) -> None:  # p1 annotated, then p2 refused
        if cost == DRAINED_DELETION_COST:
            io.costs[pods[0]] = cost
            raise KubeApiError(409, "conflict with another field manager")
        await orig(pods, cost)

    io.set_deletion_cost = set_cost  # type: ignore[method-assign]
    with pytest.raises(KubeApiError):
        await _drain(io)
    assert io.replicas == 3 and "scale" not in io.calls
    _served(io)


async def test_a_drain_stopped_while_annotating_resets_the_deletion_cost() -> None:
    io = FakeDrainIO(PODS)
    io.block["cost"] = asyncio.Event()
    task = asyncio.create_task(_drain(io))
    await io.reached["cost"].wait()
    io.costs["p1"] = DRAINED_DELETION_COST  # the first annotation landed (its API call ran on)
    del io.block["cost"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert io.replicas == 3 and "scale" not in io.calls
    _served(io)  # before: p1 served with the drained cost, first to go at the pool's next scale-in


async def test_a_drain_stopped_while_scaling_finishes_the_scale_it_sent() -> None:
    io = FakeDrainIO(PODS)
    gate = io.block["scale"] = asyncio.Event()
    task = asyncio.create_task(_drain(io))
    await io.reached["scale"].wait()
    task.cancel()
    await asyncio.sleep(0)
    gate.set()  # the replicas write lands after the cancel
    with pytest.raises(asyncio.CancelledError):
        await task
    assert io.replicas == 1
    assert io.costs == {"p1": DRAINED_DELETION_COST, "p2": DRAINED_DELETION_COST}  # the ReplicaSet deletes exactly them
    assert io.draining == set()


async def test_a_drain_that_succeeds_keeps_the_drained_cost_on_its_victims() -> None:
    io = FakeDrainIO(PODS)
    await _drain(io)
    assert io.replicas == 1 and io.draining == set()
    assert io.costs == {"p1": DRAINED_DELETION_COST, "p2": DRAINED_DELETION_COST}
