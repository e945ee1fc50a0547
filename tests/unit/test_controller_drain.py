"""The drain protocol (fulcrum.controller.drain): victim choice, step order, waiting, timeout — against a FAKE I/O."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence

import pytest

from fulcrum.controller.drain import (
    DRAINED_DELETION_COST,
    DrainStep,
    PodLoad,
    drain_pool,
    drain_steps,
    draining_from_metrics,
    load_from_metrics,
    pick_victims,
)

class FakeDrainIO:
    """FAKE cluster for the drain: pods with loads that fall by ``finish_per_poll`` per poll; records every call."""

    def __init__(self, pods: list[PodLoad], finish_per_poll: float = 1.0) -> None:
        self.pods = {p.name: p for p in pods}
        self.load = {p.name: p.load if math.isfinite(p.load) else 0.0 for p in pods}
        self.finish_per_poll = finish_per_poll
        self.calls: list[tuple[str, object]] = []
        self.draining: set[str] = set()
        self.replicas = len(pods)

    async def pod_loads(self, pool: str) -> list[PodLoad]:
        self.calls.append(("pod_loads", pool))
        return list(self.pods.values())

    async def loads(self, pods: Sequence[str]) -> Mapping[str, float]:
        self.calls.append(("loads", tuple(pods)))
        out = {p: self.load.get(p, 0.0) for p in pods}
        for p in pods:
            assert p in self.draining, "polled a pod the router still sends requests to"
            self.load[p] = max(self.load.get(p, 0.0) - self.finish_per_poll, 0.0)
        return out

    async def mark_draining(self, pods: Sequence[str]) -> None:
        self.calls.append(("mark", tuple(pods)))
        self.draining |= set(pods)

    async def unmark_draining(self, pods: Sequence[str]) -> None:
        self.calls.append(("unmark", tuple(pods)))
        self.draining -= set(pods)

    #: polls of ``routers_lagging`` before the router reports the marked pods draining (its config reload)
    router_lag_polls = 0

    async def routers_lagging(self, pods: Sequence[str]) -> list[str]:
        self.calls.append(("confirm", tuple(pods)))
        assert set(pods) <= self.draining, "asked the router to confirm pods never marked"
        if self.router_lag_polls > 0:
            self.router_lag_polls -= 1
            return ["router-0"]
        return []

    async def set_deletion_cost(self, pods: Sequence[str], cost: int) -> None:
        self.calls.append(("cost", (tuple(pods), cost)))

    async def scale(self, pool: str, replicas: int) -> None:
        assert all(self.load[p] == 0 for p in self.draining) or self.timed_out_ok
        self.calls.append(("scale", replicas))
        self.replicas = replicas

    async def event(self, type_: str, reason: str, message: str) -> None:
        self.calls.append(("event", (type_, reason, message)))

    timed_out_ok = False


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


def test_victims_are_unready_pods_first_then_the_least_loaded_then_by_name() -> None:
    pods = [PodLoad("a", True, 5, 0), PodLoad("b", True, 0, 0), PodLoad("c", False, 9, 9),
            PodLoad("d", True, 0, 0), PodLoad("e", True, math.nan, 0)]
    assert pick_victims(pods, 1) == ["c"]
    assert pick_victims(pods, 3) == ["c", "b", "d"]
    assert pick_victims(pods, 5)[-1] == "e"  # a ready pod whose load is unknown goes last
    assert pick_victims(pods, 0) == []


def test_the_steps_mark_confirm_wait_annotate_scale_then_unmark() -> None:
    steps = drain_steps("decode", ["x", "y"], 3)
    assert [s.kind for s in steps] == ["mark", "confirm", "wait", "deletion_cost", "scale", "unmark"]
    assert steps[4] == DrainStep("scale", ("x", "y"), 3)
    assert drain_steps("decode", [], 2) == [DrainStep("scale", (), 2)]
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        drain_steps("decode", ["x"], -1)


@pytest.mark.asyncio
async def test_a_drain_waits_for_in_flight_requests_before_lowering_replicas() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 4, 0), PodLoad("p1", True, 2, 1), PodLoad("p2", True, 8, 0)])
    clock = Clock()
    r = await drain_pool(io, "prefill", 2, timeout_s=60, poll_s=5, clock=clock, sleep=clock.sleep)
    assert r.victims == ("p1",) and not r.timed_out and r.replicas == 2
    kinds = [c[0] for c in io.calls]
    assert kinds == ["pod_loads", "mark", "confirm", "loads", "loads", "loads", "loads", "cost", "scale", "unmark"]
    assert ("cost", (("p1",), DRAINED_DELETION_COST)) in io.calls
    assert r.waited_s == 15 and io.replicas == 2 and io.draining == set()


@pytest.mark.asyncio
async def test_a_drain_past_its_timeout_posts_a_warning_and_still_scales_in() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 100, 0), PodLoad("p1", True, 50, 0)], finish_per_poll=0.0)
    io.timed_out_ok = True
    clock = Clock()
    r = await drain_pool(io, "decode", 1, timeout_s=30, poll_s=10, clock=clock, sleep=clock.sleep)
    assert r.timed_out and r.busy == {"p1": 50.0} and r.waited_s == 30
    warn = [c for c in io.calls if c[0] == "event"]
    assert len(warn) == 1 and warn[0][1][1] == "DrainTimeout" and "p1 (50)" in warn[0][1][2]
    assert io.replicas == 1 and io.draining == set()


@pytest.mark.asyncio
async def test_scaling_to_the_same_count_drains_nobody() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 1, 0)])
    clock = Clock()
    r = await drain_pool(io, "decode", 1, timeout_s=30, poll_s=10, clock=clock, sleep=clock.sleep)
    assert r.victims == () and [c[0] for c in io.calls] == ["pod_loads", "scale"]


@pytest.mark.asyncio
async def test_a_cancelled_drain_unmarks_its_pods_and_never_scales_in() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 9, 0), PodLoad("p1", True, 5, 0)], finish_per_poll=0.0)
    polled = asyncio.Event()

    async def sleep(s: float) -> None:  # the pods stay busy: the drain waits until it is cancelled
        polled.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(drain_pool(io, "decode", 1, timeout_s=600, poll_s=5, clock=lambda: 0.0, sleep=sleep))
    await polled.wait()
    assert io.draining == {"p1"}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert io.draining == set() and io.replicas == 2  # back in the router's rotation, the pool untouched
    assert [c[0] for c in io.calls][-1] == "unmark" and "scale" not in [c[0] for c in io.calls]


def test_the_load_is_read_from_vllm_metrics_text() -> None:
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert load_from_metrics(text) == 5.0
    with pytest.raises(ValueError, match="no vllm:num_requests"):
        load_from_metrics("# TYPE other gauge\nother 1\n")


@pytest.mark.asyncio
async def test_idleness_is_polled_only_once_every_router_reports_the_victims_draining() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 0, 0), PodLoad("p1", True, 3, 0)])
    io.router_lag_polls = 3  # the router reloads its config after three looks
    clock = Clock()
    r = await drain_pool(io, "decode", 1, timeout_s=60, poll_s=5, clock=clock, sleep=clock.sleep)
    kinds = [c[0] for c in io.calls]
    assert kinds[:6] == ["pod_loads", "mark", "confirm", "confirm", "confirm", "confirm"]
    assert kinds.index("loads") > kinds.index("confirm") + 3
    assert r.confirmed_s == 3.0 and r.unconfirmed == ()  # polled each second (poll_s capped at 1 s)
    assert not [c for c in io.calls if c[0] == "event"]


@pytest.mark.asyncio
async def test_a_router_that_never_confirms_gets_a_warning_and_the_drain_still_waits_for_idle() -> None:
    io = FakeDrainIO([PodLoad("p0", True, 5, 0), PodLoad("p1", True, 2, 0)])
    io.router_lag_polls = 10**6
    clock = Clock()
    r = await drain_pool(io, "prefill", 1, timeout_s=60, poll_s=5, clock=clock, sleep=clock.sleep,
                         confirm_timeout_s=10)
    assert r.unconfirmed == ("router-0",) and r.confirmed_s == 10
    warn = [c[1] for c in io.calls if c[0] == "event"]
    assert len(warn) == 1 and warn[0][1] == "DrainUnconfirmed" and "router-0" in warn[0][2] and "p1" in warn[0][2]
    assert not r.timed_out and io.replicas == 1 and ("loads", ("p1",)) in io.calls


def test_the_draining_flags_are_read_from_the_router_metrics() -> None:
    text = (
        "# HELP fulcrum_router_instance_draining 1 while draining\n"
        "# TYPE fulcrum_router_instance_draining gauge\n"
        'fulcrum_router_instance_draining{instance="p0",role="decode"} 1.0\n'
        'fulcrum_router_instance_draining{instance="p1",role="decode"} 0.0\n'
    )
    assert draining_from_metrics(text) == {"p0": True, "p1": False}
    assert draining_from_metrics("") == {}
