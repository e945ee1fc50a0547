"""Leftovers of the operator's handler logic (on :class:`InMemoryObjects`, as in test_controller_handlers.py):

- a drain in flight whose target a newer plan raises (4→2, then the plan wants 3) is stopped and drains again to
  the new target, instead of finishing at 2 and starting a cold pod for the third;
- a cancel that arrives while the drain's replicas write is in flight (the write is waited for: the scale-in
  happened) is reported as ``ScaledIn``, not ``DrainCancelled``;
- ``ReplicasReverted`` of the router Deployment points at ``spec.router.replicas``, not at ``replicaOwner``;
- ``ObservationUnavailable`` is posted even when a drain note already made the runtime degraded.

The planner is scripted (:class:`ScriptedPlanner`): the plans under test are exact counts.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

pytest.importorskip("kopf")

from fulcrum.controller.apply import ApplyReport
from fulcrum.controller.drain import DRAINED_DELETION_COST
from fulcrum.controller.handlers import Controller
from fulcrum.controller.objects import InMemoryObjects
from fulcrum.observation import Observation
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.target import ClusterTarget, Pool, PoolSize

from test_controller_handlers import (KEY, NAME, NS, Clock, FakePrometheus, PodMetrics, _deletion_cost, cond, live,
                                      make_controller, replicas, seed)

pytestmark = pytest.mark.asyncio


@pytest.fixture
def objs() -> InMemoryObjects:
    return InMemoryObjects()


def prefill(n: int) -> ClusterTarget:
    return ClusterTarget(prefill=PoolSize(n, 1), decode=PoolSize(1, 1))


class ScriptedPlanner:
    """FAKE planner: plans :attr:`target` every interval."""

    name = "scripted"
    tick_s = 10.0
    forecaster = None
    horizon_steps = 1

    def __init__(self, target: ClusterTarget) -> None:
        self.target = target

    def initial(self) -> ClusterTarget:
        return self.target

    def step(self, o: Observation, current: ClusterTarget) -> Decision:
        return Decision(o.time_s, self.target, f"scripted: prefill {self.target.prefill.replicas}",
                        numbers=PlanNumbers())


class GatedObjects(InMemoryObjects):
    """FAKE objects whose apply that lowers the prefill Deployment's replicas waits, once armed, until released
    (a replicas write in flight): :attr:`entered` is set when it starts waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply_all(self, objs: Iterable[Mapping[str, Any]]) -> ApplyReport:
        objs = list(objs)
        if self.armed:
            live = self.objects.get(("Deployment", NS, f"{NAME}-prefill"))
            for o in objs:
                if (o.get("kind") == "Deployment" and o["metadata"]["name"] == f"{NAME}-prefill" and live
                        and o["spec"]["replicas"] < live["spec"]["replicas"]):
                    self.armed = False
                    self.entered.set()
                    assert self.release.wait(10.0), "the test never released the write"
        return super().apply_all(objs)


async def _until(check: Any, what: str) -> None:
    for _ in range(5_000):
        if check():
            return
        await asyncio.sleep(0.002)
    pytest.fail(f"never: {what}")


async def _drain_4_to_2(objs: InMemoryObjects) -> tuple[Controller, ScriptedPlanner, Clock, PodMetrics]:
    """Prefill at 4 busy pods, then a plan for 2: a drain 4→2 in flight (its victims marked, their requests still
    running: the drain polls until the test frees them)."""
    seed(objs)
    clock = Clock()
    pods = PodMetrics()
    c = make_controller(objs, FakePrometheus(rate=1.0), clock=clock, pods=pods)
    await c.reconcile(live(objs))
    rt = c.runtimes[KEY]
    planner = ScriptedPlanner(prefill(4))
    rt.loop.planner = planner
    clock.t += 10
    await c.interval(live(objs))
    assert replicas(objs, "prefill") == 4
    for i, load in enumerate((1.0, 2.0, 5.0, 5.0)):  # prefill-0 the least loaded, then prefill-1
        pods.add_pod(objs, f"{NAME}-prefill-{i}", "prefill", running=load)

    async def sleep(s: float) -> None:
        await asyncio.sleep(0.002)

    c.sleep = sleep
    planner.target = prefill(2)
    clock.t += 10
    await c.interval(live(objs))
    assert Pool.PREFILL in rt.drains
    await _until(lambda: {f"{NAME}-prefill-0", f"{NAME}-prefill-1"} <= set(rt.draining), "the victims marked")
    return c, planner, clock, pods


async def test_a_plan_that_raises_a_drains_target_drains_fewer_pods_instead_of_starting_a_cold_one() -> None:
    objs = InMemoryObjects()
    c, planner, clock, pods = await _drain_4_to_2(objs)
    rt = c.runtimes[KEY]
    planner.target = prefill(3)
    clock.t += 10
    await c.interval(live(objs))
    assert replicas(objs, "prefill") == 4  # nothing cut yet: the drain to 3 waits for its victim
    assert f"{NAME}-prefill-1" not in rt.draining  # no longer a victim: back in the router's rotation
    assert Pool.PREFILL in rt.drains
    pods.idle()
    await c.settle(KEY)
    assert replicas(objs, "prefill") == 3  # never down to 2: no pod removed only to start a cold one
    costs = {f"{NAME}-prefill-{i}": _deletion_cost(objs, f"{NAME}-prefill-{i}") for i in range(4)}
    assert costs == {f"{NAME}-prefill-0": DRAINED_DELETION_COST, f"{NAME}-prefill-1": 0, f"{NAME}-prefill-2": 0,
                     f"{NAME}-prefill-3": 0}
    ins = [e["message"] for e in objs.by_reason("ScaledIn") if e["message"].startswith("prefill")]
    assert len(ins) == 1 and ins[0].startswith("prefill: 4→3 ")
    stopped = [e["message"] for e in objs.by_reason("DrainCancelled")]
    assert len(stopped) == 1 and "3" in stopped[0] and "4→3" in stopped[0]
    assert not [e for e in objs.by_reason("ScaledOut") if e["message"].startswith("prefill")][1:]  # only 1→4
    clock.t += 10
    await c.interval(live(objs))  # the plan still wants 3: nothing more to do
    await c.settle(KEY)
    assert replicas(objs, "prefill") == 3 and len(objs.by_reason("ScaledOut")) == 1


async def test_a_cancel_during_the_replicas_write_reports_the_scale_in_that_happened() -> None:
    objs = GatedObjects()
    c, planner, clock, pods = await _drain_4_to_2(objs)
    drain = c.runtimes[KEY].drains[Pool.PREFILL]
    objs.armed = True
    pods.idle()  # the drain goes on to its replicas write, which hangs in flight
    await _until(objs.entered.is_set, "the replicas write in flight")
    planner.target = prefill(4)  # the plan wants the pool back while the write is in flight
    clock.t += 10
    interval = asyncio.create_task(c.interval(live(objs)))
    await _until(lambda: drain.cancelling() > 0, "the drain cancelled")
    objs.release.set()
    assert await interval is True
    assert objs.by_reason("DrainCancelled") == []  # the drain was not stopped: its write had been sent
    ins = [e["message"] for e in objs.by_reason("ScaledIn")]
    assert len(ins) == 1 and ins[0].startswith("prefill: 4→2 ")
    outs = [e["message"] for e in objs.by_reason("ScaledOut")]
    assert outs[-1].startswith("prefill: 2→4 ")  # and then back out, as the plan wants
    assert replicas(objs, "prefill") == 4


async def test_a_hand_edit_of_the_router_replicas_points_at_spec_router_replicas(objs: InMemoryObjects) -> None:
    seed(objs)
    c = make_controller(objs)
    await c.reconcile(live(objs))
    objs.objects[("Deployment", NS, f"{NAME}-router")]["spec"]["replicas"] = 5
    objs.objects[("Deployment", NS, f"{NAME}-decode")]["spec"]["replicas"] = 7
    await c.reconcile(live(objs))
    msgs = {e["message"].split(":", 1)[0]: e["message"] for e in objs.by_reason("ReplicasReverted")}
    router, pool = msgs[f"Deployment {NAME}-router"], msgs[f"Deployment {NAME}-decode"]
    assert "spec.router.replicas" in router and "replicaOwner" not in router
    assert "replicaOwner: External" in pool  # a pool's count: the planner's, or an external owner's


class FlakyPrometheus(FakePrometheus):
    """FAKE Prometheus that fails while :attr:`down`."""

    down = False

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if self.down:
            raise ConnectionError("Prometheus unreachable")
        return super().custom_query(query, params)


async def test_observation_unavailable_gets_its_event_after_a_drain_failure_made_it_degraded(
        objs: InMemoryObjects, monkeypatch: pytest.MonkeyPatch) -> None:
    import fulcrum.controller.handlers as handlers

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in the drain")

    monkeypatch.setattr(handlers, "drain_pool", broken)
    seed(objs)
    clock = Clock()
    prom = FlakyPrometheus(rate=1.0)
    c = make_controller(objs, prom, clock=clock)
    await c.reconcile(live(objs))
    rt = c.runtimes[KEY]
    planner = ScriptedPlanner(prefill(3))
    rt.loop.planner = planner
    clock.t += 10
    await c.interval(live(objs))
    planner.target = prefill(2)
    clock.t += 10
    await c.interval(live(objs))  # the drain fails
    await c.settle(KEY)
    clock.t += 10
    await c.interval(live(objs))  # its note makes this interval degraded
    assert "drain failed" in cond(live(objs), "Degraded")["message"]
    prom.down = True
    for _ in range(3):  # blind: one Event for the cause, not one per interval
        clock.t += 10
        await c.interval(live(objs))
        await c.settle(KEY)
    d = cond(live(objs), "Degraded")
    assert d["reason"] == "ObservationUnavailable"
    assert len(objs.by_reason("ObservationUnavailable")) == 1
    prom.down = False
    clock.t += 10
    await c.interval(live(objs))
    prom.down = True
    clock.t += 10
    await c.interval(live(objs))  # blind again after a seen interval: a new occurrence, a new Event
    assert len(objs.by_reason("ObservationUnavailable")) == 2


# fulcrum_operator_scale_events_total counts the resizes the ScaledOut/ScaledIn Events report (record_scale), not
# the plan's changes: a drain 4→2 retargeted to 3 grew nothing (one ScaledOut 1→4, one ScaledIn 4→3), where the
# plan's 2→3 looked like a scale-out.
async def test_the_scale_events_metric_counts_the_resizes_the_events_report() -> None:
    objs = InMemoryObjects()
    c, planner, clock, pods = await _drain_4_to_2(objs)
    planner.target = prefill(3)
    clock.t += 10
    await c.interval(live(objs))
    pods.idle()
    await c.settle(KEY)
    outs = [e for e in objs.by_reason("ScaledOut") if e["message"].startswith("prefill")]
    ins = [e for e in objs.by_reason("ScaledIn") if e["message"].startswith("prefill")]
    assert (len(outs), len(ins)) == (1, 1)
    get = c.metrics.registry.get_sample_value
    counted = {d: get("fulcrum_operator_scale_events_total", {"llmserve": KEY, "pool": "prefill", "direction": d})
               for d in ("out", "in")}
    assert counted == {"out": 1.0, "in": 1.0}
