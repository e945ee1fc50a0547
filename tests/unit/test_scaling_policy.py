"""The scaling policy: scale out at once, scale in slowly, react to SLO misses, never oscillate."""

from __future__ import annotations

import math

from fulcrum.observation import Observation, ReadyCounts
from fulcrum.scaling.policy import ScalingSettings, ScalingState, apply_scaling_policy, backlog_draining
from fulcrum.target import ClusterTarget, PoolSize


def obs(t: float, **kw) -> Observation:
    base = dict(time_s=t, interval_s=60.0, arrivals=300, mean_isl=1000.0, mean_osl=200.0, completed=300,
                ttft_attainment=1.0, tpot_attainment=1.0, slo_attainment=1.0)
    base.update(kw)
    return Observation(**base)


def target(p: int, d: int, tp_p: int = 1, tp_d: int = 2) -> ClusterTarget:
    return ClusterTarget(prefill=PoolSize(p, tp_p), decode=PoolSize(d, tp_d))


def run(plans: list[ClusterTarget], start: ClusterTarget, settings: ScalingSettings, observations=None):
    state, cur, out = ScalingState(), start, []
    for i, planned in enumerate(plans):
        o = observations[i] if observations else obs(60.0 * (i + 1))
        cur, state, _ = apply_scaling_policy(planned, cur, now_s=o.time_s, obs=o, state=state, settings=settings)
        out.append((cur.prefill.replicas, cur.decode.replicas))
    return out


def test_scale_out_is_immediate_but_bounded_by_max_step():
    out = run([target(20, 5)], target(2, 1), ScalingSettings(max_step=4))
    assert out == [(6, 5)]


def test_scale_in_waits_for_hysteresis_and_goes_to_the_highest_recent_plan():
    s = ScalingSettings(hysteresis_ticks=3, cooldown_s=0, max_step=8)
    out = run([target(6, 2), target(5, 2), target(4, 2), target(4, 2)], target(8, 2), s)
    assert out[0] == (8, 2) and out[1] == (8, 2)
    assert out[2] == (6, 2)  # three plans agree; the highest of them (6) wins
    assert out[3] == (5, 2)  # the window slid past the 6: now 5


def test_cooldown_spaces_scale_ins_of_a_pool():
    s = ScalingSettings(hysteresis_ticks=1, cooldown_s=300, max_step=1)
    out = run([target(4, 2)] * 6, target(8, 2), s)
    assert [p for p, _ in out] == [7, 7, 7, 7, 7, 6]


def test_a_steady_load_with_noisy_plans_never_oscillates():
    s = ScalingSettings(hysteresis_ticks=3, cooldown_s=300)
    noisy = [target(6 + (i % 3 == 0), 2 + (i % 4 == 0)) for i in range(60)]
    out = run(noisy, target(6, 2), s)
    changes = sum(1 for a, b in zip(out, out[1:]) if a != b)
    assert changes <= 2  # it may settle up once per pool, then holds
    assert out[-1] == out[10]


def test_the_n_minus_one_check_blocks_a_scale_in_that_would_overload():
    s = ScalingSettings(hysteresis_ticks=1, cooldown_s=0, scale_in_utilisation=0.8)
    state = ScalingState()
    cur, state, _ = apply_scaling_policy(target(3, 2), target(4, 2), now_s=60, obs=obs(60), state=state,
                                         settings=s, utilisation={"prefill": 2.9, "decode": 1.0})
    assert cur.prefill.replicas == 4  # 2.9 instances of work on 3 would run at 97% > 80%
    cur, state, _ = apply_scaling_policy(target(3, 2), target(4, 2), now_s=120, obs=obs(120), state=state,
                                         settings=s, utilisation={"prefill": 2.2, "decode": 1.0})
    assert cur.prefill.replicas == 3


def test_the_reactive_guard_scales_out_when_ttft_misses_with_queued_prefills():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25)
    bad = obs(60, ttft_attainment=0.5, slo_attainment=0.5, prefill_queue=40, ready=ReadyCounts(prefill=4, decode=2))
    out = run([target(4, 2)], target(4, 2), s, [bad])
    assert out == [(5, 2)]


def test_the_reactive_guard_grows_decode_on_a_tpot_miss_only_with_decode_work_queued():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25)
    ready = ReadyCounts(prefill=4, decode=2)
    # the misses of requests that finished after a backlog had drained: nothing waits now, nothing to add
    drained = obs(60, tpot_attainment=0.4, slo_attainment=0.4, decode_queue=0, ready=ready)
    assert run([target(4, 2)], target(4, 2), s, [drained]) == [(4, 2)]
    waiting = obs(60, tpot_attainment=0.4, slo_attainment=0.4, decode_queue=12, ready=ready)
    assert run([target(4, 2)], target(4, 2), s, [waiting]) == [(4, 3)]
    # a decode queue with the KV cache nearly full grows decode even while TPOT still holds
    full = obs(60, decode_queue=12, kv_utilisation=0.95, ready=ready)
    assert run([target(4, 2)], target(4, 2), s, [full]) == [(4, 3)]


def test_the_reactive_guard_judges_a_target_out_of_reach_by_the_target_the_plan_was_sized_for():
    # a target the plan found out of reach (fulcrum.ratio.feasibility) is missed whatever the pools; the plan was
    # sized for a reachable one (planned_for_s), and the interval's value at the SLO percentile is judged by it
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25)
    ready = ReadyCounts(prefill=4, decode=2)

    def step(o: Observation, out_of_reach: dict[str, float] | None) -> tuple[int, int]:
        cur, _, _ = apply_scaling_policy(target(4, 2), target(4, 2), now_s=60, obs=o, state=ScalingState(),
                                         settings=s, out_of_reach=out_of_reach)
        return cur.prefill.replicas, cur.decode.replicas

    def slow_prompts(p90_s: float) -> Observation:
        return obs(60, ttft_attainment=0.3, slo_attainment=0.3, ttft_p_s=p90_s, prefill_queue=40, ready=ready)

    def slow_tokens(p90_s: float) -> Observation:
        return obs(60, tpot_attainment=0.0, slo_attainment=0.0, tpot_p_s=p90_s, decode_queue=12, ready=ready)

    assert step(slow_prompts(1.2), None) == (5, 2) and step(slow_tokens(0.036), None) == (4, 3)
    assert step(slow_prompts(1.2), {"ttft": 1.5}) == (4, 2)  # the P90 TTFT meets what the plan was sized for
    assert step(slow_prompts(2.0), {"ttft": 1.5}) == (5, 2)  # it does not: the guard grows prefill
    assert step(slow_tokens(0.036), {"tpot": 0.0376}) == (4, 2)
    assert step(slow_tokens(0.050), {"tpot": 0.0376}) == (4, 3)
    assert step(slow_tokens(0.036), {"ttft": 1.5}) == (4, 3)  # only the metric out of reach is judged so
    assert step(slow_tokens(math.nan), {"tpot": 0.0376}) == (4, 2)  # no value, no reaction
    # a backlog larger than an interval's arrivals, or a nearly full KV cache, still grows a pool
    backlog = obs(60, ttft_attainment=0.3, slo_attainment=0.3, ttft_p_s=1.2, arrivals=300, prefill_queue=400,
                  ready=ready)
    assert step(backlog, {"ttft": 1.5}) == (5, 2)
    full = obs(60, tpot_attainment=0.0, slo_attainment=0.0, tpot_p_s=0.036, decode_queue=12, kv_utilisation=0.95,
               ready=ready)
    assert step(full, {"tpot": 0.0376}) == (4, 3)


def test_the_reactive_guard_waits_while_instances_of_the_pool_are_starting():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25)
    starting = obs(60, ttft_attainment=0.5, slo_attainment=0.5, prefill_queue=40, ready=ReadyCounts(prefill=2, decode=2))
    assert run([target(4, 2)], target(4, 2), s, [starting]) == [(4, 2)]


def test_the_reactive_guard_grows_at_most_max_step():
    s = ScalingSettings(slo_target=0.9, max_step=2)
    bad = obs(60, ttft_attainment=0.2, slo_attainment=0.2, prefill_queue=400, ready=ReadyCounts(prefill=4, decode=2))
    assert run([target(30, 2)], target(4, 2), s, [bad]) == [(6, 2)]


def test_the_reactive_guard_ignores_too_few_samples_and_nan_attainment():
    s = ScalingSettings(reactive_min_samples=20)
    few = obs(60, completed=3, ttft_attainment=0.0, prefill_queue=1)
    nan = obs(120, completed=0, ttft_attainment=math.nan, tpot_attainment=math.nan)
    assert run([target(4, 2), target(4, 2)], target(4, 2), s, [few, nan]) == [(4, 2), (4, 2)]


def test_a_tp_change_replaces_the_pool_at_once():
    s = ScalingSettings()
    state = ScalingState()
    cur, _, reasons = apply_scaling_policy(target(3, 2, tp_d=4), target(3, 4, tp_d=2), now_s=60, obs=obs(60),
                                           state=state, settings=s)
    assert cur.decode == PoolSize(2, 4)
    assert any("TP 2→4" in r for r in reasons)


def test_growth_never_exceeds_the_gpu_budget():
    s = ScalingSettings(max_gpus=12, max_step=10)
    out = run([target(10, 5)], target(2, 1), s)
    p, d = out[0]
    assert p * 1 + d * 2 <= 12 and p >= 2 and d >= 1


def test_the_reactive_guard_waits_a_tick_after_instances_of_the_pool_became_ready():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25)
    state, cur = ScalingState(), target(4, 2)
    calm = obs(60, ready=ReadyCounts(prefill=3, decode=2))
    cur, state, _ = apply_scaling_policy(target(4, 2), cur, now_s=60, obs=calm, state=state, settings=s)
    # the fourth instance became ready during the interval whose misses were measured: no reaction yet
    miss = dict(ttft_attainment=0.5, slo_attainment=0.5, prefill_queue=40, ready=ReadyCounts(prefill=4, decode=2))
    cur, state, _ = apply_scaling_policy(target(4, 2), cur, now_s=120, obs=obs(120, **miss), state=state, settings=s)
    assert cur.prefill.replicas == 4
    # a whole interval with all four ready and still missing: now it reacts
    cur, state, _ = apply_scaling_policy(target(4, 2), cur, now_s=180, obs=obs(180, **miss), state=state, settings=s)
    assert cur.prefill.replicas == 5


def test_a_backlog_drains_within_the_startup_when_it_shrank_fast_enough():
    # 94 → 36 prompts in 60 s: the 36 left are gone in ~37 s, before a pod started now (180 s) could serve one
    assert backlog_draining(94, 36, 60.0, 180.0)
    assert not backlog_draining(40, 36, 60.0, 180.0)  # 540 s at that pace
    assert not backlog_draining(36, 40, 60.0, 180.0)  # growing
    assert not backlog_draining(36, 36, 60.0, 180.0)  # stuck
    assert not backlog_draining(94, 0, 60.0, 180.0)  # empty: no backlog behind a miss
    assert not backlog_draining(94, 36, 60.0, 0.0)  # no start-up time given: never skip


def test_the_reactive_guard_skips_a_pool_whose_backlog_drains_before_new_instances_could_start():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25, startup_s=180.0)
    ready = ReadyCounts(prefill=4, decode=2)

    def tick(settings: ScalingSettings, before: tuple[int, int] | None, queue: int) -> int:
        o = obs(120, ttft_attainment=0.2, slo_attainment=0.2, prefill_queue=queue, ready=ready)
        cur, _, _ = apply_scaling_policy(target(4, 2), target(4, 2), now_s=120, obs=o,
                                         state=ScalingState(queues=before, ready={}), settings=settings)
        return cur.prefill.replicas

    assert tick(s, None, 94) == 5  # the first tick: nothing known of the queue before → react
    assert tick(s, (0, 0), 94) == 5  # a growing backlog → react
    assert tick(s, (94, 0), 36) == 4  # the burst is over, 94 → 36 in a minute: the misses are its past
    assert tick(s, (40, 0), 36) == 5  # draining, but too slowly to be gone before a new pod is ready
    assert tick(ScalingSettings(slo_target=0.9, reactive_growth=0.25), (94, 0), 36) == 5  # no start-up given


def test_the_unified_pool_skips_a_reaction_only_when_every_queue_behind_it_drains():
    s = ScalingSettings(slo_target=0.9, reactive_growth=0.25, startup_s=180.0)
    uni = ClusterTarget(unified=PoolSize(6, 2))
    ready = ReadyCounts(unified=6)
    miss = dict(ttft_attainment=0.2, tpot_attainment=0.2, slo_attainment=0.2, kv_utilisation=0.95, ready=ready)

    def second_tick(prefill_q: int, decode_q: int) -> int:
        state = ScalingState(queues=(94, 30))
        cur, _, _ = apply_scaling_policy(uni, uni, now_s=120, state=state, settings=s,
                                         obs=obs(120, prefill_queue=prefill_q, decode_queue=decode_q, **miss))
        return cur.unified.replicas

    assert second_tick(36, 5) == 6  # both drain within the start-up
    assert second_tick(36, 40) > 6  # the decode queue grows: the unified pool still needs more


def test_an_empty_planned_pool_is_a_scale_in_not_a_tp_change():
    # Auto mode's other plan writes PoolSize(0, 1) for a pool serving at TP 2: that must wait for the window
    s = ScalingSettings(hysteresis_ticks=3, cooldown_s=0)
    serving = ClusterTarget(unified=PoolSize(5, 2))
    out, state, cur = [], ScalingState(), serving
    for i in range(4):
        cur, state, _ = apply_scaling_policy(target(3, 2, tp_p=2), cur, now_s=60.0 * (i + 1), obs=obs(60.0 * (i + 1)),
                                             state=state, settings=s)
        out.append(cur.unified)
    assert out[0] == PoolSize(5, 2) and out[1] == PoolSize(5, 2)  # not emptied at once
    assert out[2] == PoolSize(0, 2)
    assert cur.prefill == PoolSize(3, 2)  # the new pool starts at the planned TP


def test_a_scale_out_soon_after_a_scale_in_lengthens_that_pools_window_and_calm_shortens_it_again():
    # base window: max(3 ticks × 60 s, 300 s) = 300 s; at most 4× = 1,200 s
    from fulcrum.target import Pool

    s = ScalingSettings(hysteresis_ticks=3, cooldown_s=300, max_window_factor=4.0)
    state, cur, t = ScalingState(), target(3, 1), 0.0
    events: list[tuple[float, int, float | None]] = []

    def step(p: int) -> None:
        nonlocal state, cur, t
        t += 60.0
        before = (cur.prefill.replicas, state.window_s.get(Pool.PREFILL))
        cur, state, _ = apply_scaling_policy(target(p, 1), cur, now_s=t, obs=obs(t), state=state, settings=s)
        if (cur.prefill.replicas, state.window_s.get(Pool.PREFILL)) != before:
            events.append((t, cur.prefill.replicas, state.window_s.get(Pool.PREFILL)))

    for p in [3] * 5 + [2] * 6 + [3] + [2] * 12 + [3] + [2] * 21 + [3] + [2] * 160:
        step(p)
    assert events == [
        (600.0, 2, None),     # 300 s of plans for 2 (the base window): scale-in
        (720.0, 3, 600.0),    # the burst is back within the longest window: that scale-in was premature → 600 s
        (1320.0, 2, 600.0),   # now 600 s of plans before scaling in
        (1500.0, 3, 1200.0),  # premature again → 1,200 s (the cap)
        (2700.0, 2, 1200.0),
        (2820.0, 3, 1200.0),  # premature again: the window stays at the cap
        (4020.0, 2, 1200.0),
        (5280.0, 2, 600.0),   # two longest windows (2,400 s) without a premature scale-in: halved
        (7740.0, 2, 300.0),   # and again, back to the base
    ]
    assert Pool.DECODE not in state.window_s  # the decode pool never scaled out after a scale-in


def test_a_scale_out_long_after_a_scale_in_is_the_load_growing_and_leaves_the_window_alone():
    # base window 300 s: a scale-out 120 s after the scale-in doubles it; one 840 s after (more than twice the
    # window, less than the longest 1,200 s) is a load that grew again, not a premature scale-in
    from fulcrum.target import Pool

    s = ScalingSettings(hysteresis_ticks=3, cooldown_s=300, max_window_factor=4.0)

    def run(lull: int) -> dict[Pool, float]:
        state, cur, t = ScalingState(), target(3, 1), 0.0
        for p in [3] * 5 + [2] * (5 + lull) + [3]:
            t += 60.0
            cur, state, _ = apply_scaling_policy(target(p, 1), cur, now_s=t, obs=obs(t), state=state, settings=s)
        assert cur.prefill.replicas == 3  # scaled in at 600 s, out again at the end
        return dict(state.window_s)

    assert run(lull=1)[Pool.PREFILL] == 600.0  # out 120 s after the scale-in: premature, doubled
    assert Pool.PREFILL not in run(lull=13)  # out 840 s after it: the base window stays
