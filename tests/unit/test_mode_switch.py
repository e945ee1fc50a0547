"""Auto mode: switch between Disaggregated and Unified only when it pays, and never drop ready capacity doing so."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from fulcrum.api import parse_llmserve
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.planner import WorkloadEstimate, plan_modes
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.scaling.fulcrum import FulcrumPlanner
from fulcrum.scaling.mode import ModeState, ModeSwitchSettings, decide_mode
from fulcrum.simulator import SimConfig, Simulation
from fulcrum.target import ClusterTarget, PoolSize
from fulcrum.workload import Request

FEASIBLE = {"Disaggregated": True, "Unified": True}
S = ModeSwitchSettings(agree_ticks=3, min_dwell_s=600.0, horizon_s=900.0, min_saving_fraction=0.0)


def tick(state: ModeState, t: float, dis: int, uni: int, **kw: object):
    args = dict(now_s=t, gpus={"Disaggregated": dis, "Unified": uni}, feasible=FEASIBLE, new_pools_ready=False,
                pressure=False, room=True, startup_s=120.0, settings=S)
    args.update(kw)
    return decide_mode(state, **args)  # type: ignore[arg-type]


def test_a_switch_needs_every_recent_plan_to_find_the_other_mode_cheaper() -> None:
    st = ModeState("Disaggregated", since_s=0.0)
    phases = []
    for i, uni in enumerate([4, 6, 4, 4, 8, 4, 4, 4]):  # dis plans 6 GPUs throughout
        d = tick(st, 1000.0 + 60 * i, 6, uni)
        st = d.state
        phases.append(d.phase)
    # the 6 (a tie) and the 8 reset the count; three cheaper plans in a row start the switch
    assert phases == ["steady"] * 7 + ["start"]
    assert st.switching_to == "Unified" and st.serving == "Disaggregated"


def test_no_switch_within_the_dwell_time_under_pressure_or_without_room() -> None:
    fresh = ModeState("Disaggregated", since_s=900.0, savings=(2.0, 2.0))
    assert tick(fresh, 1000.0, 6, 4).phase == "steady"  # 100 s in the mode < 600 s dwell
    old = ModeState("Disaggregated", since_s=0.0, savings=(2.0, 2.0))
    assert tick(old, 1000.0, 6, 4, pressure=True).phase == "steady"
    assert tick(old, 1000.0, 6, 4, room=False).phase == "steady"
    assert tick(old, 1000.0, 6, 4).phase == "start"


def test_a_saving_that_does_not_pay_back_the_start_up_is_not_taken() -> None:
    # 1 GPU saved over 900 s = 900 GPU·s < 10 GPUs × 120 s of start-up
    st = ModeState("Disaggregated", since_s=0.0, savings=(1.0, 1.0))
    assert tick(st, 1000.0, 11, 10).phase == "steady"
    st = ModeState("Disaggregated", since_s=0.0, savings=(3.0, 3.0))
    assert tick(st, 1000.0, 13, 10).phase == "start"  # 3 GPUs: 2,700 GPU·s > 1,200


def test_a_near_tie_between_the_two_plans_is_not_switched_on() -> None:
    strict = ModeSwitchSettings(agree_ticks=3, min_dwell_s=600.0, horizon_s=900.0, min_saving_fraction=0.3)
    st = ModeState("Disaggregated", since_s=0.0, savings=(2.0, 2.0))
    d = tick(st, 1000.0, 8, 6, settings=strict)  # 2 of 8 GPUs: 25% < 30%, although 1,800 GPU·s > 720
    assert d.phase == "steady" and "25%" in d.reason
    assert tick(st, 1000.0, 6, 4, settings=strict).phase == "start"  # 2 of 6: 33%
    # an infeasible serving plan is left whatever the share
    feas = {"Disaggregated": False, "Unified": True}
    st = ModeState("Disaggregated", since_s=0.0, savings=(math.inf, math.inf))
    assert tick(st, 1000.0, 8, 8, settings=strict, feasible=feas).phase == "start"
    with pytest.raises(ValueError, match="min_saving_fraction"):
        ModeSwitchSettings(min_saving_fraction=1.0)


def test_the_callers_last_check_can_veto_a_switch_and_runs_only_when_all_else_holds() -> None:
    calls: list[str] = []

    def veto(serving: str) -> tuple[bool, str]:
        calls.append(serving)
        return False, "at the horizon's peak Unified needs more"

    old = ModeState("Disaggregated", since_s=0.0, savings=(2.0, 2.0))
    d = tick(old, 1000.0, 6, 4, confirm=veto)
    assert d.phase == "steady" and "horizon's peak" in d.reason and d.state.switching_to is None
    assert d.state.savings[-1] == 2.0  # the tick still counts towards the agreement
    assert tick(old, 1000.0, 6, 4, confirm=veto, pressure=True).phase == "steady"
    assert calls == ["Disaggregated"]  # not asked under pressure
    assert tick(old, 1000.0, 6, 4, confirm=lambda m: (True, "")).phase == "start"


def test_a_serving_plan_that_flaps_above_a_steady_other_plan_is_switched_on_what_the_pools_hold() -> None:
    # Disaggregated plans flap 6/4/8 GPUs with the interval's lengths (a need near 1.0 instance per pool), and
    # the scaling policy's window holds their largest, 8; Unified plans 4 throughout. No tick saving (the 4 is a
    # tie), but a held saving of 8 − 4 = 4 GPUs, 50% of what Disaggregated holds: the switch starts.
    strict = ModeSwitchSettings(agree_ticks=5, min_dwell_s=600.0, horizon_s=900.0, min_saving_fraction=0.3)
    st = ModeState("Disaggregated", since_s=0.0)
    phases = []
    for i, dis in enumerate([6, 4, 8, 6, 4]):
        d = tick(st, 1000.0 + 60 * i, dis, 4, settings=strict)
        st = d.state
        phases.append(d.phase)
    assert phases == ["steady"] * 4 + ["start"], phases
    assert "saves 4 GPUs" in d.reason
    # but never while a tick of the window found the other mode dearer
    st = ModeState("Disaggregated", since_s=0.0)
    for i, (dis, uni) in enumerate([(6, 4), (4, 6), (8, 4), (6, 4), (8, 4)]):
        d = tick(st, 1000.0 + 60 * i, dis, uni, settings=strict)
        st = d.state
    assert d.phase == "steady" and "not cheaper" in d.reason
    # nor on a held saving that is a small share of what the serving mode holds (2 of 8 GPUs, 25%)
    st = ModeState("Disaggregated", since_s=0.0)
    for i, (dis, uni) in enumerate([(8, 6), (8, 6), (6, 6), (8, 6), (8, 6)]):
        d = tick(st, 1000.0 + 60 * i, dis, uni, settings=strict)
        st = d.state
    assert d.phase == "steady" and "25%" in d.reason


def test_a_tie_at_the_horizons_peak_does_not_veto_a_switch(splitwise) -> None:
    # the fulcrum planner's last check: at the highest rate planned over the horizon the other mode may cost
    # the same (both plan 8 GPUs at 8.8 req/s of 1,030/228-token requests), not more
    spec = parse_llmserve({"model": {"name": "m"}, "mode": "Auto", "profile": {"name": "splitwise-llama2-70b-h100"},
                           "scaling": {"maxGPUs": 64, "minGPUs": 0}}).spec
    planner = FulcrumPlanner(spec, splitwise)
    current = ClusterTarget(prefill=PoolSize(2, 2), decode=PoolSize(2, 2))
    now = WorkloadEstimate.from_means(2.0, 1030, 228)
    plans = planner._plans(now, current)
    peak = plan_modes(WorkloadEstimate.from_means(8.8, 1030, 228), splitwise, spec, planner.settings)
    assert peak["Disaggregated"].gpus == peak["Unified"].gpus
    planner._planned_rates = deque([(0.0, 8.8), (60.0, 2.0)])
    assert planner._peak_confirms("Disaggregated", now, plans, current) == (True, "")
    # where the other mode is dearer at the peak, the check still vetoes
    dearer = plan_modes(WorkloadEstimate.from_means(5.0, 1030, 228), splitwise, spec, planner.settings)
    assert dearer["Unified"].gpus > dearer["Disaggregated"].gpus
    planner._planned_rates = deque([(0.0, 5.0), (60.0, 2.0)])
    go, why = planner._peak_confirms("Disaggregated", now, plans, current)
    assert not go and "peak of 5.00" in why


def test_the_fulcrum_planner_stays_in_its_mode_through_a_lull_between_bursts(splitwise) -> None:
    # Auto serving Disaggregated: 20 minutes of bursts at 8 req/s, then a lull at 0.5 req/s. In the lull the
    # Unified plan is the cheaper, but not at the bursts' rate while the last hour (the peak window) still holds
    # them: the switch waits until the bursts are an hour old (without the check it came 5 ticks into the lull;
    # with the 15-minute horizon's planned rates alone, 15 ticks in).
    # (1,500-token prompts, 60-token answers: 2,000/30 made Unified dearer even in the lull once the TPOT tail
    # counted the prompt already being prefilled.)
    spec = parse_llmserve({"model": {"name": "m"}, "mode": "Auto", "profile": {"name": "splitwise-llama2-70b-h100"},
                           "scaling": {"maxGPUs": 64, "minGPUs": 0}}).spec
    planner = FulcrumPlanner(spec, splitwise)
    cur = planner.initial()
    switched = []
    for i in range(90):
        rate = 8.0 if i < 20 else 0.5
        n = int(rate * 60)
        o = Observation(time_s=60.0 * (i + 1), interval_s=60.0, arrivals=n, mean_isl=1500.0, mean_osl=60.0,
                        completed=n, ttft_attainment=1.0, tpot_attainment=1.0, slo_attainment=1.0,
                        ready=ReadyCounts(prefill=cur.prefill.replicas, decode=cur.decode.replicas,
                                          unified=cur.unified.replicas))
        d = planner.step(o, cur)
        cur = d.target
        if d.numbers.detail.get("mode_phase") == "start":
            switched.append((i, d.reason))
    # the last burst (i = 19) leaves the 60-interval peak window at i = 79
    assert switched and 19 + 60 <= switched[0][0] <= 19 + 60 + 5, switched


def test_an_infeasible_serving_mode_is_left_for_a_feasible_one_whatever_the_gpus() -> None:
    st = ModeState("Unified", since_s=0.0)
    feas = {"Disaggregated": True, "Unified": False}
    for i in range(3):
        d = tick(st, 1000.0 + 60 * i, 20, 8, feasible=feas)
        st = d.state
    assert d.phase == "start" and st.switching_to == "Disaggregated"


def test_the_old_mode_serves_until_the_new_pools_are_ready_then_cuts_over() -> None:
    st = ModeState("Disaggregated", since_s=0.0, switching_to="Unified", started_s=1000.0)
    d = tick(st, 1060.0, 6, 4)
    assert d.phase == "starting" and d.state.serving == "Disaggregated"
    d = tick(d.state, 1120.0, 6, 4, new_pools_ready=True)
    assert d.phase == "cut-over" and d.state == ModeState("Unified", since_s=1120.0)


# ---------------------------------------------------------------------------------------------- end to end
SPEC = parse_llmserve({
    "model": {"name": "m"},
    "mode": "Auto",
    "engine": {"maxModelLen": 4096},
    "slo": {"ttftMs": 2000, "tpotMs": 100, "percentile": 90},
    "scaling": {"minGPUs": 0, "maxGPUs": 64, "intervalSeconds": 30, "podStartupSeconds": 60},
}).spec


def two_phase_trace() -> list[Request]:
    """1 req/s for 15 min (Unified is cheaper), then 14 req/s for 25 min (Disaggregated is): code-like lengths."""
    rng = random.Random(7)
    out, t = [], 0.0
    while t < 2400.0:
        t += rng.expovariate(1.0 if t < 900.0 else 14.0)
        out.append(Request(t, 2048, 28))
    return out


def ready_gpus(sim: Simulation) -> int:
    """GPUs of instances ready and taking new work (draining and starting ones excluded)."""
    return sum(s.tp for s in sim.instances() if s.state == "ready")


def test_no_mode_flip_ever_drops_ready_capacity_in_the_simulated_cluster(splitwise: PerformanceProfile) -> None:
    planner = FulcrumPlanner(SPEC, splitwise, mode_switch=ModeSwitchSettings(agree_ticks=3, min_dwell_s=300.0, horizon_s=600.0))
    reqs = two_phase_trace()
    current = planner.initial()
    sim = Simulation(reqs, splitwise, SPEC.slo, current, SimConfig(pod_startup_s=60.0))
    flips: list[tuple[float, float]] = []  # (start, cut-over) of each switch
    floor: float | None = None  # ready GPUs when the switch under way began
    t = 0.0
    while t < reqs[-1].arrival_s:
        # between ticks, every 5 s: a switch under way never leaves fewer ready GPUs than at its start
        for k in range(1, 7):
            sim.run_until(t + 5.0 * k)
            if floor is not None:
                assert ready_gpus(sim) >= floor, f"ready capacity fell during the switch at t={sim.now:g}"
        t += 30.0
        d = planner.step(sim.observe(30.0), current)
        phase = d.numbers.detail.get("mode_phase")
        if phase == "start":
            floor = ready_gpus(sim)
            flips.append((t, math.nan))
            # the old pools stay in the target beside the new ones
            assert (current.unified.replicas > 0) != (current.prefill.replicas > 0)
            assert d.target.unified.replicas > 0 and d.target.prefill.replicas + d.target.decode.replicas > 0
        elif phase == "cut-over":
            # the new pools are all ready before the old ones leave the target
            new = ("unified",) if d.target.unified.replicas else ("prefill", "decode")
            for pool in new:
                assert sum(1 for s in sim.instances() if s.role == pool and s.state == "ready") >= getattr(current, pool).replicas
            floor = None
            flips[-1] = (flips[-1][0], t)
        current = d.target
        sim.apply(current)
    assert len(flips) >= 2, "the trace was built to make Auto switch both ways"
    for start, cut in flips:
        assert math.isfinite(cut) and 60.0 <= cut - start <= 180.0  # about one pod start-up
    assert [s for s, _ in flips] == sorted(s for s, _ in flips)
    assert all(b[0] - a[1] >= 300.0 for a, b in zip(flips, flips[1:]))  # the dwell time between switches
    res = sim.finish()
    assert all(math.isfinite(r.finish_s) for r in res.records)


def steady_obs(t: float, rate: float, ready: ReadyCounts) -> Observation:
    n = int(round(rate * 30))
    return Observation(
        time_s=t, interval_s=30.0, arrivals=n, mean_isl=1155.0, mean_osl=211.0,
        isl_quantiles=tuple(1155.0 * f for f in (0.3, 0.6, 0.9, 1.2, 1.6, 2.5)),
        osl_quantiles=tuple(211.0 * f for f in (0.3, 0.6, 0.9, 1.2, 1.6, 2.5)),
        completed=n, ttft_attainment=1.0, tpot_attainment=1.0, slo_attainment=1.0, ready=ready,
    )


def test_auto_holds_one_mode_on_a_noisy_load_where_both_cost_about_the_same(splitwise: PerformanceProfile) -> None:
    planner = FulcrumPlanner(SPEC, splitwise)
    cur = planner.initial()
    modes, gpus = [], []
    for i in range(240):  # two hours around 3–4 req/s, where both modes plan 4 GPUs or within 2 of each other
        ready = ReadyCounts(prefill=cur.prefill.replicas, decode=cur.decode.replicas, unified=cur.unified.replicas)
        d = planner.step(steady_obs(30.0 * (i + 1), 3.5 + 1.5 * math.sin(i), ready), cur)
        cur = d.target
        modes.append(d.numbers.detail.get("mode_serving"))
        gpus.append((d.numbers.detail["gpus_disaggregated"], d.numbers.detail["gpus_unified"]))
    changes = sum(1 for a, b in zip(modes, modes[1:]) if a != b)
    assert changes <= 1, (modes, gpus)


@pytest.mark.parametrize("q, expected", [(0.0, -2.0), (0.5, 1.0), (1.0, 4.0), (0.9, 3.2)])
def test_residual_quantile_interpolates_between_order_statistics(q: float, expected: float) -> None:
    from fulcrum.scaling.fulcrum import residual_quantile

    assert residual_quantile([4.0, -2.0, 1.0, 0.0, 2.0], q) == pytest.approx(expected)
