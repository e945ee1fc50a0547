"""ARES decode rescheduling (Algorithm 1): classification, cost and memory filters, best variance reduction,
hysteresis."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fulcrum.rebalancing.decode_rescheduling import (
    DecodeInstanceLoad,
    DecodeRequestLoad,
    ReschedulingConfig,
    future_loads,
    plan_migration,
    weighted_variance,
)

CFG = ReschedulingConfig(horizon_steps=256, horizon_points=8, min_gain=0.0)


def inst(iid: str, *reqs: tuple[int, float], cap: float = 1e6, step: float = 0.03, accepting: bool = True) -> DecodeInstanceLoad:
    return DecodeInstanceLoad(
        id=iid,
        requests=tuple(DecodeRequestLoad(f"{iid}-{k}", tok, rem) for k, (tok, rem) in enumerate(reqs)),
        kv_capacity_tokens=cap, step_time_s=step, accepting=accepting,
    )


def moved(instances: list[DecodeInstanceLoad], rid: str, src: str, dst: str) -> list[DecodeInstanceLoad]:
    r = next(x for i in instances if i.id == src for x in i.requests if x.id == rid)
    out = []
    for i in instances:
        if i.id == src:
            i = dataclasses.replace(i, requests=tuple(x for x in i.requests if x.id != rid))
        elif i.id == dst:
            i = dataclasses.replace(i, requests=i.requests + (r,))
        out.append(i)
    return out


def test_a_balanced_cluster_moves_nothing() -> None:
    a = inst("a", (1000, 200), (1000, 200))
    b = inst("b", (1000, 200), (1000, 200))
    assert plan_migration([a, b], CFG) is None


def test_a_long_running_request_moves_from_the_overloaded_to_the_idle_instance() -> None:
    a = inst("a", (3000, 400), (2000, 300), (500, 5))
    b = inst("b", (200, 50))
    m = plan_migration([a, b], CFG)
    assert m is not None and (m.source, m.target) == ("a", "b")
    assert m.variance_after < m.variance_before
    assert m.tokens in (3000, 2000)


def test_the_chosen_move_is_the_one_that_minimises_the_weighted_variance_by_brute_force() -> None:
    rng = np.random.default_rng(7)
    instances = [inst(f"i{k}", *[(int(rng.integers(100, 4000)), float(rng.integers(1, 600)))
                                 for _ in range(int(rng.integers(1, 8)))]) for k in range(5)]
    m = plan_migration(instances, CFG)
    assert m is not None
    beta = CFG.weights()
    after = weighted_variance(future_loads(moved(instances, m.request_id, m.source, m.target), CFG), beta)
    assert after == pytest.approx(m.variance_after, rel=1e-9)
    # no other single move (allowed by the filters) does better
    best = min(
        weighted_variance(future_loads(moved(instances, r.id, s.id, d.id), CFG), beta)
        for s in instances for r in s.requests for d in instances if d.id != s.id
    )
    assert m.variance_after <= best * (1 + 1e-9) or m.variance_after == pytest.approx(best, rel=1e-6)


def test_a_request_about_to_finish_is_not_worth_its_transfer() -> None:
    # 3000 tokens of 320 KiB over 25 GB/s ≈ 39 ms + 5 ms = ~1.5 steps of 30 ms: remaining 1 token is not enough
    a = inst("a", (3000, 1), (3000, 1), (3000, 1))
    b = inst("b")
    assert plan_migration([a, b], CFG) is None


def test_the_target_must_have_room_for_the_request_and_its_growth() -> None:
    a = inst("a", (3000, 400), (3000, 400))
    small = inst("b", cap=3200)  # 3000 + 400 > 3200
    assert plan_migration([a, small], CFG) is None
    roomy = inst("b", cap=3400)
    assert plan_migration([a, roomy], CFG) is not None


def test_a_draining_instance_is_never_a_target_but_can_be_a_source() -> None:
    a = inst("a", (3000, 400), (3000, 400))
    b = inst("b", accepting=False)
    assert plan_migration([a, b], CFG) is None
    c = inst("c")
    m = plan_migration([inst("a", (3000, 400), (3000, 400), accepting=False), c], CFG)
    assert m is not None and m.source == "a" and m.target == "c"


def test_hysteresis_stops_a_request_from_moving_back_and_forth() -> None:
    cfg = dataclasses.replace(CFG, request_cooldown_s=10.0, instance_cooldown_s=2.0, min_gain=0.02)
    a = inst("a", (3000, 400), (2500, 400))
    b = inst("b", (100, 10))
    m = plan_migration([a, b], cfg, now_s=0.0)
    assert m is not None
    after = moved([a, b], m.request_id, m.source, m.target)
    again = plan_migration(after, cfg, now_s=1.0, last_moved_s={m.request_id: 0.0}, last_received_s={m.target: 0.0})
    assert again is None or again.request_id != m.request_id


def test_a_small_gain_below_the_threshold_is_not_worth_a_move() -> None:
    a = inst("a", (1100, 200), (1000, 200))
    b = inst("b", (1000, 200), (1000, 200))
    strict = dataclasses.replace(CFG, theta=0.0, min_gain=0.5)
    assert plan_migration([a, b], strict) is None


def test_predicted_lengths_decide_the_future_load() -> None:
    # equal now; a's requests are predicted to run long, b's to finish at once: a is overloaded over the horizon
    a = inst("a", (1000, 500), (1000, 500))
    b = inst("b", (1000, 1), (1000, 1))
    m = plan_migration([a, b], CFG)
    assert m is not None and m.source == "a"
    loads = future_loads([a, b], CFG)
    assert loads[0, 0] == loads[1, 0] == 2000
    assert loads[0, -1] == 2 * (1000 + 256) and loads[1, 1] == 0  # a still runs at the horizon; b is done


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="discount"):
        ReschedulingConfig(discount=0.0)
    with pytest.raises(ValueError, match="min_gain"):
        ReschedulingConfig(min_gain=1.0)


def test_a_recompute_migration_is_priced_by_the_targets_prefill_throughput_not_the_link() -> None:
    """The live router moves a request by recomputing its context on the target (vLLM cannot export a running
    request's KV): C_mig = tokens / prefill rate; ARES's KV move (the simulator's) = bytes over the link."""
    kv = ReschedulingConfig(kv_bytes_per_token=327_680.0, link_gbps=25.0, transfer_overhead_s=0.005)
    recompute = ReschedulingConfig(recompute_tokens_per_s=8_000.0, transfer_overhead_s=0.005)
    assert kv.migration_seconds(4000) == pytest.approx(4000 * 327_680.0 / 25e9 + 0.005)
    assert recompute.migration_seconds(4000) == pytest.approx(0.5 + 0.005)
    with pytest.raises(ValueError, match="recompute_tokens_per_s"):
        ReschedulingConfig(recompute_tokens_per_s=0.0)


def test_a_recompute_is_not_worth_it_onto_a_busy_target_whose_batch_it_would_stall() -> None:
    """By recompute, C_mig also stalls the target's b_t running decodes: N̂(r) > C_mig·(1 + b_t)/T_exec.
    C_mig = 2000 tokens / 8000 tokens/s + 5 ms = 0.255 s = 8.5 steps of 30 ms; N̂ = 40 steps: worth it onto an
    idle target (8.5) or one of three decodes (34), not onto one of five (51)."""
    cfg = dataclasses.replace(CFG, recompute_tokens_per_s=8_000.0, transfer_overhead_s=0.005)
    # the heavy requests cannot fit the target (cap 2100 tokens): only a-0 (2000 + 40) is a candidate
    src = inst("a", (2000, 40), *[(6000, 600)] * 6)

    def target(b: int) -> DecodeInstanceLoad:
        return inst("b", *[(10, 5)] * b, cap=2100)

    for b in (0, 3):
        m = plan_migration([src, target(b)], cfg)
        assert m is not None and m.request_id == "a-0", b
    assert plan_migration([src, target(5)], cfg) is None
    # b_t counts the whole batch where the caller knows it (the router's untracked work): three listed, five running
    m = plan_migration([src, dataclasses.replace(target(3), batch=5)], cfg)
    assert m is None and dataclasses.replace(target(3), batch=5).batch_size == 5 and target(3).batch_size == 3
    # with the KV moved over the link (ARES), no batch is stalled: the busy target still takes it
    kv = dataclasses.replace(CFG, transfer_overhead_s=0.005)
    m = plan_migration([src, target(5)], kv)
    assert m is not None and m.request_id == "a-0"


def test_a_step_time_or_capacity_that_is_zero_or_nan_is_refused_where_the_load_is_built() -> None:
    """T_exec divides the migration cost (Alg. 1 line 20): 0 used to raise ZeroDivisionError inside
    plan_migration, NaN turned the cost filter off (every comparison with NaN is false), and a NaN C_mem turned
    the memory filter off. Each is refused, naming the field, when the instance's load is built."""
    for step in (0.0, -0.03, float("nan")):
        with pytest.raises(ValueError, match="step_time_s"):
            inst("a", (3000, 400), step=step)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        inst("b", cap=float("nan"))
    with pytest.raises(ValueError, match="predicted_remaining"):
        DecodeRequestLoad("r", 100, float("nan"))
    # what stays allowed: an unknown capacity as +inf (the router's), an infinite step time, 0 remaining, and a
    # capacity of 0 or less, which only makes the instance no target
    assert inst("b", cap=float("inf"), step=float("inf")).kv_capacity_tokens == float("inf")
    assert plan_migration([inst("a", (3000, 400), (3000, 400)), inst("b", cap=-1.0)], CFG) is None
    assert DecodeRequestLoad("r", 100, 0.0).predicted_remaining == 0.0


def test_a_cooldown_that_is_not_a_number_or_negative_is_refused() -> None:
    """The router's config refuses them (``ge=0``), the planner's own config took them: a NaN instance cooldown
    made every source fail ``now − received >= NaN`` (rescheduling silently never ran), a NaN or negative request
    cooldown let a request that had just moved move again (the hysteresis against ping-pong was gone)."""
    for field in ("request_cooldown_s", "instance_cooldown_s"):
        for bad in (float("nan"), -1.0):
            with pytest.raises(ValueError, match=field):
                ReschedulingConfig(**{field: bad})
    assert ReschedulingConfig(request_cooldown_s=0.0, instance_cooldown_s=0.0).request_cooldown_s == 0.0
