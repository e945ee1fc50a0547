"""The simulator's building blocks: event kernel, a prefill instance's queue, percentiles with unserved requests."""

from __future__ import annotations

import math

import pytest

from fulcrum.ratio.profiles import builtin_profile
from fulcrum.ratio.step_cost import nearest_tp
from fulcrum.simulator import Kernel, Priority, percentile
from fulcrum.simulator.instances import PrefillInstance, SimRequest


def test_events_at_the_same_time_run_by_priority_then_in_scheduling_order() -> None:
    k = Kernel()
    seen: list[tuple[float, str]] = []
    k.schedule(1.0, Priority.ARRIVAL, lambda a: seen.append((k.now, f"arrival{a}")), 1)
    k.schedule(1.0, Priority.STEP, lambda a: seen.append((k.now, "step")))
    k.schedule(1.0, Priority.ARRIVAL, lambda a: seen.append((k.now, f"arrival{a}")), 2)
    k.schedule(0.5, Priority.TIMER, lambda a: seen.append((k.now, "timer")))
    k.run_until(2.0)
    assert seen == [(0.5, "timer"), (1.0, "step"), (1.0, "arrival1"), (1.0, "arrival2")]
    assert k.now == 2.0


def test_cancelled_events_never_run_and_events_scheduled_meanwhile_do() -> None:
    k = Kernel()
    seen: list[str] = []
    h = k.schedule(1.0, Priority.STEP, lambda a: seen.append("cancelled"))

    def chain(_: int) -> None:
        k.schedule(0.8, Priority.STEP, lambda b: seen.append("chained"))

    k.schedule(0.5, Priority.STEP, chain)
    k.cancel(h)
    k.run_until(5.0)
    assert seen == ["chained"]
    assert k.next_time() == math.inf
    with pytest.raises(ValueError):
        k.run_until(4.0)


def test_run_until_leaves_later_events_pending() -> None:
    k = Kernel()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        k.schedule(t, Priority.STEP, lambda a: seen.append(k.now))
    k.run_until(2.0)
    assert seen == [1.0, 2.0]
    assert k.next_time() == 3.0


def _req(idx: int, isl: int) -> SimRequest:
    return SimRequest(idx, 0.0, isl, 10)


class _FakeHost:
    """A FAKE instance host that records the prefill batches it is told of."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_prefill_done(self, inst: PrefillInstance, batch: list[SimRequest]) -> None:
        self.batches.append([r.idx for r in batch])


def test_a_prefill_instance_runs_its_queue_first_come_first_served_up_to_its_token_budget() -> None:
    k = Kernel()
    host = _FakeHost()
    inst = PrefillInstance(host, k, 0, 1, builtin_profile("dopd-llama70b-fp8-h100"), 0.0, 0.0)  # type: ignore[arg-type]
    inst.batch_tokens = 1000
    for i, isl in enumerate([400, 500, 300, 900]):
        inst.offer(_req(i, isl))  # the first starts alone at once (idle), the others wait
    assert inst.load == 4 and inst.queued_tokens == 2100
    while k.step():
        pass
    assert host.batches == [[0], [1, 2], [3]]  # 500 + 300 fit the budget; 900 would overflow it
    assert inst.load == 0 and inst.queued_tokens == 0


def test_percentile_is_infinite_when_it_falls_among_unserved_requests() -> None:
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([1.0, 2.0, math.inf, math.inf], 90) == math.inf
    assert percentile([1.0, 2.0, 3.0, math.inf], 50) == pytest.approx(2.5)
    assert math.isnan(percentile([], 90))


def test_nearest_measured_tp_prefers_the_smaller_on_ties() -> None:
    assert nearest_tp((1, 4), 2) == 1
    assert nearest_tp((2, 4, 8), 8) == 8
    assert nearest_tp((2, 4, 8), 6) == 4
