"""The control loop (fulcrum.scaling.loop) that both the operator and ``fulcrum replay`` run: the planner the spec
names, blind intervals, the external replica owner, scale-ins drained; on the in-memory cluster where a whole
interval (observe → plan → apply) is tested."""

from __future__ import annotations

import math

import pytest

from fulcrum.api.llmserve import parse_llmserve
from fulcrum.cluster import Cluster, ObservationError
from fulcrum.errors import SpecError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.in_memory import InMemoryCluster
from fulcrum.scaling.loop import ControlLoop, distribute, external_replicas, pool_changes
from fulcrum.scaling.planner import Decision, PlanNumbers
from fulcrum.target import ClusterTarget, Pool, PoolSize


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
    forecaster = None
    horizon_steps = 1

    def __init__(self) -> None:
        self.steps: list[Observation] = []

    def initial(self) -> ClusterTarget:
        return START

    def step(self, o: Observation, current: ClusterTarget) -> Decision:
        self.steps.append(o)
        t = ClusterTarget(prefill=PoolSize(current.prefill.replicas + 1, 1), decode=current.decode)
        return Decision(o.time_s, t, "more", numbers=PlanNumbers(ratio=2.0))


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
        assert old == START.pool(pool).replicas and new == out.target.pool(pool).replicas
    assert out.forecast["rate"]["mean"] >= 0 and out.numbers.ratio > 0


def test_no_observation_keeps_the_target_and_never_steps_the_planner(table_i) -> None:
    p = RecordingPlanner()
    loop = ControlLoop(spec(), table_i, START, planner=p)
    out = loop.step(None, error="Prometheus unreachable")
    assert out.target == START and not out.changes and not out.observed
    assert out.degraded == "Prometheus unreachable" and "not scaling blind" in out.reason
    assert p.steps == [] and loop.current == START
    out2 = loop.step(obs(10.0, 1.0))
    assert out2.observed and out2.changes == {Pool.PREFILL: (1, 2)} and len(p.steps) == 1


def test_an_external_replica_owner_sets_the_total_and_the_plan_sets_the_split(table_i) -> None:
    s = spec(replicaOwner="External", replicas=6)
    assert external_replicas(s) == 6
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


def test_the_planner_defaults_to_fulcrum_and_the_count_to_the_operator() -> None:
    s = spec()
    assert ControlLoop(s, None, START, planner=RecordingPlanner()).spec.scaling.planner.value == "fulcrum"  # type: ignore[arg-type]
    assert external_replicas(s) is None
    assert external_replicas(spec(replicas=3)) is None  # replicas obeyed only under an External owner
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


def test_the_simulator_the_in_memory_cluster_and_the_kubernetes_adapter_are_clusters() -> None:
    from fulcrum.controller.handlers import KubernetesCluster
    from fulcrum.simulator import Simulation

    for cls in (Simulation, InMemoryCluster, KubernetesCluster):
        for method in ("observe", "apply", "ready", "draining"):
            assert callable(getattr(cls, method)), (cls, method)
    assert isinstance(InMemoryCluster(START), Cluster)


def test_an_interval_on_the_in_memory_cluster_observes_plans_and_applies(table_i) -> None:
    cluster = InMemoryCluster(START, startup_s=20.0)
    loop = ControlLoop(spec(), table_i, START, planner=RecordingPlanner())
    cluster.feed(obs(0.0, 1.0))
    out = loop.run_interval(cluster)
    assert out.observed and out.target.prefill.replicas == 2
    assert cluster.applied[-1].target == out.target and cluster.applied[-1].reason == out.reason
    assert cluster.ready() == ReadyCounts(1, 1, 0)  # the new instance starts for 20 s
    assert out.observation is not None and out.observation.time_s == 10.0  # the cluster's clock, its readiness
    cluster.feed(obs(0.0, 1.0), obs(0.0, 1.0))
    loop.run_interval(cluster)
    third = loop.run_interval(cluster)
    assert third.observation is not None and third.observation.ready.prefill == 2  # ready 20 s after the scale-out


def test_a_blind_interval_on_a_cluster_holds_the_pools_and_reapplies_them(table_i) -> None:
    p = RecordingPlanner()
    cluster = InMemoryCluster(START)
    loop = ControlLoop(spec(), table_i, START, planner=p)
    cluster.feed(ObservationError("Prometheus query failed: 503"))
    out = loop.run_interval(cluster)
    assert not out.observed and out.degraded == "Prometheus query failed: 503" and out.target == START
    assert p.steps == [] and cluster.applied[-1].target == START
    nothing_fed = loop.run_interval(cluster)  # no observation at all is blind too, never a zero load
    assert not nothing_fed.observed and "no load fed" in (nothing_fed.degraded or "")
    assert cluster.applied[-1].target == START and p.steps == []


def test_a_scale_in_on_a_cluster_drains_before_the_instances_go(table_i) -> None:
    class Shrink(RecordingPlanner):
        def step(self, o: Observation, current: ClusterTarget) -> Decision:
            return Decision(o.time_s, current.with_replicas(Pool.PREFILL, 1), "less")

    big = START.with_replicas(Pool.PREFILL, 3)
    cluster = InMemoryCluster(big, drain_s=15.0)
    loop = ControlLoop(spec(), table_i, big, planner=Shrink())
    cluster.feed(obs(0.0, 1.0), obs(0.0, 1.0))
    out = loop.run_interval(cluster)
    assert out.scale_in == {Pool.PREFILL: (3, 1)} and not out.scale_out
    assert cluster.draining() == {Pool.PREFILL: 2} and cluster.ready().prefill == 1
    assert len(cluster.instances(Pool.PREFILL)) == 3  # the victims still finish their requests
    loop.run_interval(cluster)  # 10 s later: still within the 15-s drain
    assert cluster.draining() == {Pool.PREFILL: 2}
    cluster.advance(5.0)
    assert cluster.draining() == {} and len(cluster.instances(Pool.PREFILL)) == 1


def test_an_external_owner_on_a_cluster_applies_the_external_total_split_by_the_plan(table_i) -> None:
    cluster = InMemoryCluster(START)
    loop = ControlLoop(spec(replicaOwner="External", replicas=6), table_i, START, planner=RecordingPlanner())
    cluster.feed(obs(0.0, 50.0))
    loop.run_interval(cluster)
    applied = cluster.applied[-1].target
    assert (applied.prefill.replicas, applied.decode.replicas) == (4, 2)
    assert cluster.ready() == ReadyCounts(4, 2, 0)


def test_a_tp_change_on_the_in_memory_cluster_replaces_the_pool() -> None:
    cluster = InMemoryCluster(START, startup_s=30.0)
    cluster.apply(START.with_pool(Pool.DECODE, PoolSize(1, 4)), "TP 2→4")
    assert cluster.draining() == {Pool.DECODE: 1} and cluster.ready().decode == 0
    cluster.advance(30.0)
    assert cluster.draining() == {} and cluster.ready().decode == 1


def test_an_unreachable_tpot_target_is_in_the_plan_numbers_and_the_plan_stays_under_the_gpu_cap(table_i) -> None:
    s = parse_llmserve({"spec": {"model": {"name": "m"}, "slo": {"ttftMs": 5000, "tpotMs": 80},
                                 "scaling": {"intervalSeconds": 10, "podStartupSeconds": 0, "maxGPUs": 32}}}).spec
    loop = ControlLoop(s, table_i, START)
    cluster = InMemoryCluster(START)
    # 12,000-token prompts, 1,000 output tokens: one request's decode step on Table I's TP=2 is ~80.2 ms
    long = Observation(time_s=0.0, interval_s=10.0, arrivals=5, mean_isl=12000.0, mean_osl=1000.0)
    cluster.feed(long, long)
    loop.run_interval(cluster)
    out = loop.run_interval(cluster)
    found = out.numbers.slo_infeasible
    assert found is not None and [f.metric for f in found] == ["tpot"] and found[0].best_s > 0.08
    assert out.numbers.feasible is False and out.numbers.gpus is not None and out.numbers.gpus < 32
    assert cluster.applied[-1].target.gpus <= 32


def test_the_registry_builds_every_planner_the_crd_offers_and_rejects_others(table_i) -> None:
    from fulcrum.api.llmserve import PlannerName
    from fulcrum.scaling.registry import PLANNERS, make_planner

    assert list(PLANNERS) == [p.value for p in PlannerName]
    for name in PlannerName:
        assert make_planner(name, spec(), table_i).name == name.value
    with pytest.raises(ValueError, match="unknown planner 'magic'; choose one of fulcrum, dopd"):
        make_planner("magic", spec(), table_i)


# --- robustness: a failed plan, unknown lengths, zero load with a small minGPUs ----------------------------------

def _loop_obs(t: float, arrivals: int, isl: float = 1000.0, osl: float = 150.0) -> Observation:
    return Observation(time_s=t, interval_s=10.0, arrivals=arrivals, mean_isl=isl if arrivals else 0.0,
                       mean_osl=osl if arrivals else 0.0, ready=ReadyCounts(1, 1, 0))


def test_a_planning_error_holds_the_target_and_reports_degraded_with_the_cause(table_i) -> None:
    loop = ControlLoop(spec(), table_i, START)
    for k in range(1, 21):
        loop.step(_loop_obs(10.0 * k, 50))
    held = loop.current
    out = loop.step(_loop_obs(210.0, 50, isl=300_075.0))  # a mean prompt beyond any TP's KV memory
    assert out.target == held and loop.current == held and not out.changes
    assert out.degraded is not None and out.degraded.startswith("planning failed: ")
    assert "leave no KV memory for one request of" in out.degraded
    assert out.reason.startswith("hold: planning failed") and out.observed and out.observation is not None


def test_a_planning_error_never_escapes_run_interval(table_i) -> None:
    from fulcrum.errors import PlanningError

    class Failing(RecordingPlanner):
        def step(self, o: Observation, current: ClusterTarget) -> Decision:
            raise PlanningError("profile 'x': the weights leave no KV memory for one request of 300075 tokens")

    class OneCluster:
        applied: list[tuple[ClusterTarget, str]] = []

        def observe(self, interval_s: float) -> Observation:
            return _loop_obs(10.0, 50)

        def apply(self, target: ClusterTarget, reason: str) -> None:
            self.applied.append((target, reason))

    cluster = OneCluster()
    out = ControlLoop(spec(), table_i, START, planner=Failing()).run_interval(cluster)
    assert out.target == START and cluster.applied == [(START, out.reason)]
    assert out.degraded == "planning failed: profile 'x': the weights leave no KV memory for one request of 300075 tokens"


@pytest.mark.parametrize("min_gpus", [1, 2])
def test_hours_of_zero_load_keep_one_prefill_and_one_decode_with_a_small_min_gpus(table_i, min_gpus) -> None:
    loop = ControlLoop(spec(minGPUs=min_gpus), table_i, START)
    for k in range(1, 31):
        loop.step(_loop_obs(10.0 * k, 50))
    seen = set()
    for k in range(31, 31 + 360):  # an hour of zero traffic
        out = loop.step(_loop_obs(10.0 * k, 0))
        seen.add((out.target.prefill.replicas, out.target.decode.replicas))
    assert seen == {(1, 1)}, seen
    assert loop.current.prefill.replicas == 1 and loop.current.decode.replicas == 1


def test_an_external_total_is_cut_to_max_gpus_and_the_reason_says_so(table_i) -> None:
    # regression: replicas 8 split 4 P (TP 1) + 4 D (TP 2) asked 12 GPUs of a maxGPUs=8 budget
    s = spec(replicaOwner="External", replicas=8, maxGPUs=8)
    planned = ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2))
    assert distribute(8, planned).gpus == 12  # without a budget: the plain split (replay's first target)
    cut = distribute(8, planned, max_gpus=8)
    assert cut.gpus <= 8 and cut.prefill.replicas >= 1 and cut.decode.replicas >= 1
    assert (cut.prefill.tp, cut.decode.tp) == (1, 2)
    assert distribute(4, planned, max_gpus=8) == distribute(4, planned)  # within the budget: unchanged

    class OneToOne(RecordingPlanner):
        def step(self, o: Observation, current: ClusterTarget) -> Decision:
            return Decision(o.time_s, planned, "balanced", numbers=PlanNumbers(ratio=1.0))

    out = ControlLoop(s, table_i, START, planner=OneToOne()).step(obs(10.0, 5.0))
    assert out.target.gpus <= 8 and out.target.prefill.replicas >= 1 and out.target.decode.replicas >= 1
    assert "maxGPUs=8" in out.reason and "12 GPUs" in out.reason and "external replica owner" in out.reason
    within = ControlLoop(spec(replicaOwner="External", replicas=4, maxGPUs=8), table_i, START,
                         planner=OneToOne()).step(obs(10.0, 5.0))
    assert within.target.gpus == 6 and "maxGPUs" not in within.reason
