"""Role reassignment (BanaServe Alg. 1 with a role flip): the pure decision, and in the simulator an instance
that changes duty without a restart while the ISL/OSL mix shifts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fulcrum.api.llmserve import SLOSpec
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.replay.roles import role_balancer
from fulcrum.rebalancing.role_reassignment import (
    InstanceUtilisation,
    RoleBalanceConfig,
    RoleBounds,
    plan_role_change,
)
from fulcrum.simulator import SimConfig, Simulation
from fulcrum.target import ClusterTarget, PoolSize
from fulcrum.workload import Request


def pool(pre: list[float], dec: list[float]) -> list[InstanceUtilisation]:
    return ([InstanceUtilisation(f"p{i}", "prefill", u) for i, u in enumerate(pre)]
            + [InstanceUtilisation(f"d{i}", "decode", u) for i, u in enumerate(dec)])


def test_hot_prefill_takes_the_least_utilised_decode_instance() -> None:
    change = plan_role_change(pool([1.8, 1.9], [0.4, 0.2, 0.5]))
    assert change is not None and change.instance == "d1" and change.to_duty == "prefill"


def test_hot_decode_takes_a_prefill_instance() -> None:
    change = plan_role_change(pool([0.1, 0.3, 0.2], [1.6, 1.7]))
    assert change is not None and change.to_duty == "decode" and change.instance == "p0"


def test_duties_within_delta_stay_as_they_are() -> None:
    assert plan_role_change(pool([1.0, 1.1], [0.9, 1.0]), config=RoleBalanceConfig(delta=0.3)) is None


def test_a_flip_that_would_overshoot_is_refused() -> None:
    # one prefill instance at 0.9 vs two decode at 0.5: moving one decode doubles the other's load (1.0 vs 0.45)
    assert plan_role_change(pool([0.9], [0.5, 0.5]), config=RoleBalanceConfig(delta=0.3)) is None


def test_bounds_cooldown_and_dwell_are_respected() -> None:
    hot_p = pool([1.9, 1.9], [0.2, 0.2, 0.2])
    assert plan_role_change(hot_p, RoleBounds(min_decode=3)) is None
    assert plan_role_change(hot_p, RoleBounds(max_prefill=2)) is None
    assert plan_role_change(hot_p, now_s=5.0, last_change_s=0.0, config=RoleBalanceConfig(cooldown_s=10)) is None
    recent = {"d0": 0.0, "d1": 0.0, "d2": 0.0}
    assert plan_role_change(hot_p, now_s=30.0, flipped_at_s=recent, config=RoleBalanceConfig(dwell_s=60)) is None
    assert plan_role_change(hot_p, now_s=61.0, flipped_at_s=recent, config=RoleBalanceConfig(dwell_s=60)) is not None


def test_bad_thresholds_are_rejected() -> None:
    with pytest.raises(ValueError, match="delta"):
        RoleBalanceConfig(delta=0)
    with pytest.raises(ValueError, match="maximum"):
        RoleBounds(min_prefill=3, max_prefill=2)


PROFILE = builtin_profile("splitwise-llama2-70b-h100")
SLO = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)


def shifting_mix(seed: int = 1) -> list[Request]:
    """Long prompts with short outputs, then short prompts with long outputs (a summarisation-to-chat shift)."""
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    t = 0.0
    for _ in range(600):
        t += float(rng.exponential(1 / 4.0))
        out.append(Request(arrival_s=t, isl=int(rng.integers(3000, 4000)), osl=int(rng.integers(10, 30))))
    for _ in range(900):
        t += float(rng.exponential(1 / 10.0))
        out.append(Request(arrival_s=t, isl=int(rng.integers(100, 300)), osl=int(rng.integers(400, 700))))
    return out


def test_instances_change_duty_in_place_and_every_request_completes() -> None:
    reqs = shifting_mix()
    target = ClusterTarget(prefill=PoolSize(2, 4), decode=PoolSize(2, 4))
    cfg = SimConfig(pod_startup_s=0, reschedule_interval_s=1.0)
    fixed = Simulation(reqs, PROFILE, SLO, target, cfg).finish()
    moving = Simulation(reqs, PROFILE, SLO, target, cfg,
                        role_balancer=role_balancer(RoleBalanceConfig(delta=0.3, cooldown_s=5, dwell_s=20))).finish()
    assert moving.role_changes >= 1
    assert all(math.isfinite(r.finish_s) for r in moving.records)
    # the same GPUs throughout: a role change is not a restart
    assert {g for _, g, _ in moving.gpu_timeline} == {16}
    s_fixed, s_moving = fixed.summary(SLO), moving.summary(SLO)
    # fixed 2P:2D is short of decode capacity once the chat phase starts; flipping a P instance fixes it
    assert s_fixed["slo_attainment"] < 0.9
    assert s_moving["slo_attainment"] > s_fixed["slo_attainment"] + 0.1
