"""The live router's role reassignment in the simulator (``Simulation(duties=...)``, ``fulcrum replay`` with
``router.roleReassignment``): each unified instance holds a duty that the routing policy sees as its role, the
duties follow the measured load within the plan's bounds, and without duties nothing changes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pytest

from fulcrum.api.llmserve import SLOSpec
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.rebalancing.role_reassignment import RoleBalanceConfig
from fulcrum.replay.roles import SimulatedDuties
from fulcrum.routing.base import InstanceView
from fulcrum.routing.registry import make_policy
from fulcrum.simulator import DecodeInstanceView, Rescheduler, SimConfig, SimResult, Simulation
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams, role_bounds
from fulcrum.workload import Request

PROFILE = builtin_profile("splitwise-llama2-70b-h100")
SLO = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)


def unified(n: int, prefill_share: float | None = None) -> ClusterTarget:
    return ClusterTarget(unified=PoolSize(n, 4), routing=RoutingParams(prefill_share=prefill_share))


def prefill_heavy(seconds: float = 120.0, rate: float = 6.0) -> list[Request]:
    """Long prompts, short outputs: prefill is the hot duty."""
    n = int(seconds * rate)
    return [Request(arrival_s=i / rate, isl=3000, osl=8) for i in range(n)]


class Recording(SimulatedDuties):
    """The replay's duties, recording every period's duty counts and every view the policy was given."""

    def __init__(self, migrate_on_flip: bool = False) -> None:
        super().__init__(ttft_slo_s=SLO.ttft_ms / 1000.0, migrate_on_flip=migrate_on_flip)
        self.counts: list[tuple[int, int]] = []
        self.roles_seen: set[str] = set()
        self.initial: tuple[int, int] | None = None

    def apply(self, views: Sequence[InstanceView]) -> list[InstanceView]:
        out = super().apply(views)
        self.roles_seen.update(v.role for v in out)
        if self.initial is None:
            duties = list(self.book.duties.values())
            self.initial = (duties.count("prefill"), duties.count("decode"))
        return out

    def step(self, now: float, views: Sequence[InstanceView], oldest_wait_s: Mapping[str, float],
             target: ClusterTarget) -> tuple[str, str] | None:
        flip = super().step(now, views, oldest_wait_s, target)
        duties = list(self.book.duties.values())
        self.counts.append((duties.count("prefill"), duties.count("decode")))
        return flip


def run(target: ClusterTarget, requests: list[Request], duties: SimulatedDuties | None):  # type: ignore[no-untyped-def]
    policy = make_policy("disaggregated", {})
    sim = Simulation(requests, PROFILE, SLO, target, SimConfig(reschedule_interval_s=1.0),
                     policy=lambda _routing: policy, duties=duties)
    return sim.finish()


def test_under_a_prefill_heavy_load_unified_instances_take_prefill_duty_and_the_policy_sees_duties() -> None:
    duties = Recording()
    res = run(unified(4), prefill_heavy(), duties)
    assert duties.initial == (2, 2)  # each new instance takes the duty with fewer instances, ties to decode
    assert max(p for p, _ in duties.counts) == 3  # the hot duty gained instances
    assert all(d >= 1 for _, d in duties.counts)  # never below one decode instance (the router's bounds)
    assert res.role_changes == len(duties.book.changes) > 0
    assert all(c.to_duty in ("prefill", "decode") for c in duties.book.changes)
    assert duties.roles_seen <= {"prefill", "decode"}  # no policy ever saw a `both` instance
    assert all(math.isfinite(r.finish_s) for r in res.records)
    assert {r.path for r in res.records} == {"disaggregated"}  # prefill on a prefill-duty one, decode on another


def test_the_plans_prefill_share_bounds_the_duties() -> None:
    duties = Recording()
    run(unified(4, prefill_share=0.25), prefill_heavy(), duties)
    lo_p, hi_p, lo_d, _ = role_bounds(4, 0.25)
    assert (lo_p, hi_p) == (1, 2)
    assert max(p for p, _ in duties.counts) == hi_p  # the load wants more; the plan's bound holds it
    assert all(lo_p <= p <= hi_p and d >= lo_d for p, d in duties.counts)


def test_duties_that_follow_a_prefill_heavy_load_keep_it_in_slo_where_fixed_duties_do_not() -> None:
    reqs = prefill_heavy(rate=7.0)  # more than two instances can prefill, less than three
    fixed = run(unified(4), reqs, SimulatedDuties(2.0, RoleBalanceConfig(delta=10.0)))  # a gap never exceeds 2
    moved = run(unified(4), reqs, Recording())
    assert fixed.role_changes == 0 and moved.role_changes > 0
    assert fixed.summary(SLO)["slo_attainment"] < 0.5 < 0.95 < moved.summary(SLO)["slo_attainment"]


def test_without_duties_the_simulator_counts_no_role_change() -> None:
    res = run(unified(4), prefill_heavy(seconds=30.0), None)
    assert res.role_changes == 0
    assert {r.path for r in res.records} == {"disaggregated"}  # `both` instances take either leg


def test_with_migrate_on_flip_and_rescheduling_an_instance_taking_prefill_duty_hands_its_decodes_on() -> None:
    reqs = [Request(arrival_s=i / 7.0, isl=3000, osl=200) for i in range(840)]
    policy = make_policy("disaggregated", {})

    def no_migrations(now: float, views: Sequence[DecodeInstanceView]) -> list[tuple[int, int]]:
        return []

    def run_with(rescheduler: Rescheduler | None, migrate_on_flip: bool) -> SimResult:
        duties = Recording(migrate_on_flip=migrate_on_flip)
        sim = Simulation(reqs, PROFILE, SLO, unified(4), SimConfig(reschedule_interval_s=1.0),
                         policy=lambda _routing: policy, duties=duties, rescheduler=rescheduler)
        res = sim.finish()
        assert any(c.to_duty == "prefill" for c in duties.book.changes)
        return res

    assert run_with(no_migrations, migrate_on_flip=False).migrations == 0  # they finish there (the default)
    assert run_with(None, migrate_on_flip=True).migrations == 0  # the router needs rescheduling to move them
    moved = run_with(no_migrations, migrate_on_flip=True)
    assert moved.migrations > 0  # only the flips moved anything: the rescheduler asked for nothing
    assert all(math.isfinite(r.finish_s) for r in moved.records)


def test_duties_without_a_tick_are_refused() -> None:
    with pytest.raises(ValueError, match="reschedule_interval_s"):
        Simulation(prefill_heavy(seconds=1.0), PROFILE, SLO, unified(2), SimConfig(reschedule_interval_s=0.0),
                   duties=Recording())


def test_decode_rescheduling_never_sees_a_unified_instance_on_prefill_duty() -> None:
    # the router's rescheduler plans over decode-capable instances only: a prefill-duty instance is neither a
    # source nor a target of ARES's moves
    reqs = [Request(arrival_s=i / 7.0, isl=3000, osl=200) for i in range(840)]
    duties = Recording()
    seen_prefill_duty: list[int] = []
    views_seen = [0]

    def spy(now: float, views: Sequence[DecodeInstanceView]) -> list[tuple[int, int]]:
        views_seen[0] += len(views)
        seen_prefill_duty.extend(v.iid for v in views if duties.book.duties.get(str(v.iid)) == "prefill")
        return []

    policy = make_policy("disaggregated", {})
    Simulation(reqs, PROFILE, SLO, unified(4), SimConfig(reschedule_interval_s=1.0),
               policy=lambda _routing: policy, duties=duties, rescheduler=spy).finish()
    assert views_seen[0] > 0 and any(p >= 2 for p, _ in duties.counts)
    assert seen_prefill_duty == []
