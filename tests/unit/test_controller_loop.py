"""The operator's control-loop step (fulcrum.controller.loop): the replay planner, blind intervals, external owner."""

from __future__ import annotations

import math

import pytest

from fulcrum.api.llmserve import parse_llmserve
from fulcrum.controller.loop import ControlLoop, distribute, pool_changes, policy_name, replica_owner
from fulcrum.errors import SpecError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.planner import Decision
from fulcrum.target import ClusterTarget, PoolSize


def spec(**scaling: object):
    sc = {"intervalSeconds": 10, "cooldownSeconds": 0, "podStartupSeconds": 0, **scaling}
    return parse_llmserve({"spec": {"model": {"name": "m"}, "scaling": sc}}).spec


def obs(t: float, rate: float, ready: ReadyCounts = ReadyCounts(1, 1, 0)) -> Observation:
    n = int(rate * 10)
    return Observation(time_s=t, interval_s=10.0, arrivals=n, mean_isl=1000.0, mean_osl=150.0, ready=ready)


START = ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2))


class RecordingPlanner:
    """FAKE planner that records its steps and asks for one more prefill instance each time."""

    name = "recording"
    tick_s = 10.0

    def __init__(self) -> None:
        self.steps: list[Observation] = []

    def initial(self) -> ClusterTarget:
        return START

    def step(self, o: Observation, current: ClusterTarget) -> Decision:
        self.steps.append(o)
        t = ClusterTarget(prefill=PoolSize(current.prefill.replicas + 1, 1), decode=current.decode)
        return Decision(o.time_s, t, "more", inputs={"ratio": 2.0})


def test_the_loop_drives_the_same_planner_as_replay_to_the_same_targets(table_i) -> None:
    s = spec()
    loop = ControlLoop(s, table_i, START)
    twin = FulcrumPlanner(s, table_i)
    current = START
    for k, rate in enumerate([1.0, 20.0, 20.0, 5.0, 0.5, 0.5, 0.5, 0.5], start=1):
        out = loop.step(obs(10.0 * k, rate))
        d = twin.step(obs(10.0 * k, rate), current)
        current = d.target
        assert out.target == d.target and out.reason.endswith(d.reason)
        assert out.observed and out.degraded is None
    assert loop.current == current
    assert loop.interval_s == 10.0


def test_a_burst_is_reported_as_a_scale_out_with_the_pools_that_change(table_i) -> None:
    loop = ControlLoop(spec(), table_i, START)
    out = loop.step(obs(10.0, 30.0))
    assert out.scale_out and not out.scale_in
    for pool, (old, new) in out.changes.items():
        assert old == getattr(START, pool).replicas and new == getattr(out.target, pool).replicas
    assert out.forecast["rate"]["mean"] >= 0 and out.inputs["ratio"] > 0


def test_no_observation_keeps_the_target_and_never_steps_the_planner(table_i) -> None:
    p = RecordingPlanner()
    loop = ControlLoop(spec(), table_i, START, planner=p)
    out = loop.step(None, error="Prometheus unreachable")
    assert out.target == START and not out.changes and not out.observed
    assert out.degraded == "Prometheus unreachable" and "not scaling blind" in out.reason
    assert p.steps == [] and loop.current == START
    out2 = loop.step(obs(10.0, 1.0))
    assert out2.observed and out2.changes == {"prefill": (1, 2)} and len(p.steps) == 1


def test_an_external_replica_owner_sets_the_total_and_the_plan_sets_the_split(table_i) -> None:
    s = spec(replicaOwner="External", replicas=6)
    assert replica_owner(s) == ("External", 6)
    loop = ControlLoop(s, table_i, START, planner=RecordingPlanner())
    out = loop.step(obs(10.0, 50.0))
    t = out.target
    assert t.prefill.replicas + t.decode.replicas == 6
    assert (t.prefill.replicas, t.decode.replicas) == (4, 2)  # planned ratio 2 → 4 P : 2 D
    assert "external replica owner" in out.reason


def test_distribute_keeps_one_instance_per_pool_and_handles_unified() -> None:
    planned = ClusterTarget(prefill=PoolSize(9, 1), decode=PoolSize(1, 2))
    assert (distribute(4, planned).prefill.replicas, distribute(4, planned).decode.replicas) == (3, 1)
    assert (distribute(2, planned, 100.0).prefill.replicas, distribute(2, planned, 100.0).decode.replicas) == (1, 1)
    assert distribute(0, planned).gpus == 0
    assert distribute(5, planned, math.nan).decode.tp == 2
    uni = ClusterTarget(unified=PoolSize(2, 4))
    assert distribute(7, uni).unified == PoolSize(7, 4)


def test_the_policy_defaults_to_fulcrum_and_an_owner_to_the_operator() -> None:
    s = spec()
    assert policy_name(s) == "fulcrum"
    assert policy_name(spec(planner="dopd")) == "dopd"
    assert replica_owner(s) == ("Operator", None)
    assert pool_changes(START, START) == {}


@pytest.mark.parametrize("planner", ["fulcrum", "dopd", "static", "dynamo-sla", "dynamo-load"])
def test_the_control_loop_runs_the_planner_the_spec_names(planner: str, table_i) -> None:
    loop = ControlLoop(spec(planner=planner), table_i, START)
    assert loop.planner.name == planner


def test_an_unknown_planner_is_rejected_with_the_choices() -> None:
    with pytest.raises(SpecError, match="scaling.planner"):
        spec(planner="magic")


def test_a_planner_that_keeps_the_pools_reports_hold(table_i) -> None:
    class Steady(RecordingPlanner):
        def step(self, o: Observation, current: ClusterTarget) -> Decision:
            return Decision(o.time_s, current, "nothing to do")

    loop = ControlLoop(spec(), table_i, START, planner=Steady())
    out = loop.step(obs(10.0, 1.0))
    assert out.reason.startswith("hold") and out.changes == {}


def test_a_warm_start_feeds_the_forecaster_so_the_first_interval_forecasts_from_history(table_i) -> None:
    cold = ControlLoop(spec(), table_i, START)
    assert cold.history_wanted == 64  # the default ARIMA window
    assert cold.step(obs(1000.0, 5.0)).forecast_ready is False  # one interval: ARIMA falls back

    warm = ControlLoop(spec(), table_i, START)
    history = [obs(10.0 * k, 5.0 + (k % 3)) for k in range(1, 41)]
    assert warm.warm_start(history) == 40
    out = warm.step(obs(410.0, 5.0))
    assert out.forecast_ready is True
    assert out.forecast["rate"]["mean"] == pytest.approx(6.0, abs=1.5)  # the history's level, not one interval's


def test_a_planner_without_a_forecaster_wants_no_history_and_takes_none(table_i) -> None:
    loop = ControlLoop(spec(), table_i, START, planner=RecordingPlanner())  # type: ignore[arg-type]
    assert loop.history_wanted == 0
    assert loop.warm_start([obs(10.0, 1.0)]) == 0
    assert loop.planner.steps == []  # type: ignore[attr-defined]
    seasonal = ControlLoop(spec(forecaster={"method": "seasonal_naive", "seasonLength": 144}), table_i, START)
    assert seasonal.history_wanted == 144  # a whole season, more than the fitting window
