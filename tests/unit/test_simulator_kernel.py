"""The simulator's building blocks: event kernel, DOPD Alg. 1 prefill queue, percentiles with unserved requests."""

from __future__ import annotations

import math

import pytest

from fulcrum.ratio.step_cost import nearest_tp
from fulcrum.simulator import Kernel, PrefillQueue, Priority, percentile
from fulcrum.simulator.instances import SimRequest
from fulcrum.target import RoutingParams


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


def test_fcfs_batches_fill_the_token_budget_in_arrival_order() -> None:
    q = PrefillQueue()
    routing = RoutingParams(max_prefill_batch_tokens=1000)
    for i, isl in enumerate([400, 500, 300, 900]):
        q.push(_req(i, isl), 0.0, routing)
    batch, _ = q.take(0.0, routing)
    assert batch is not None and [r.idx for r in batch] == [0, 1]
    batch, _ = q.take(0.0, routing)
    assert batch is not None and [r.idx for r in batch] == [2]
    batch, _ = q.take(0.0, routing)
    assert batch is not None and [r.idx for r in batch] == [3]
    assert q.take(0.0, routing) == (None, None)


def test_length_aware_queue_runs_long_prompts_alone_and_holds_short_ones_until_i_next_or_timeout() -> None:
    q = PrefillQueue()
    routing = RoutingParams(length_aware_batching=True, long_request_tokens=1000, batch_timeout_s=0.5)
    q.push(_req(0, 300), 0.0, routing)
    # a lone short prompt waits for company until its timeout
    assert q.take(0.1, routing) == (None, 0.5)
    q.push(_req(1, 1500), 0.2, routing)
    batch, _ = q.take(0.2, routing)  # a long prompt does not wait behind the forming short batch
    assert batch is not None and [r.idx for r in batch] == [1]
    q.push(_req(2, 300), 0.3, routing)
    q.push(_req(3, 500), 0.3, routing)
    batch, _ = q.take(0.3, routing)  # 300 + 300 + 500 >= i_next: the group goes at once
    assert batch is not None and [r.idx for r in batch] == [0, 2, 3]
    q.push(_req(4, 200), 1.0, routing)
    assert q.take(1.2, routing) == (None, 1.5)
    batch, _ = q.take(1.5, routing)  # timed out
    assert batch is not None and [r.idx for r in batch] == [4]


def test_percentile_is_infinite_when_it_falls_among_unserved_requests() -> None:
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([1.0, 2.0, math.inf, math.inf], 90) == math.inf
    assert percentile([1.0, 2.0, 3.0, math.inf], 50) == pytest.approx(2.5)
    assert math.isnan(percentile([], 90))


def test_nearest_measured_tp_prefers_the_smaller_on_ties() -> None:
    assert nearest_tp((1, 4), 2) == 1
    assert nearest_tp((2, 4, 8), 8) == 8
    assert nearest_tp((2, 4, 8), 6) == 4
