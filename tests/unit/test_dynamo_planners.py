"""The two Dynamo reference planners: hand-computed replica counts on a hand-made profile.

The profile (TP=1 for both phases, 40 960 KV tokens per instance):

- prefill: TTFT(512) = 40 ms, TTFT(1536) = 96 ms, TTFT(3072) = 300 ms → at ISL 1536 one instance prefills
  1536 / 0.096 = 16 000 tokens/s;
- decode step (ms), batch × context 1024 / 2048 / 4096: batch 1: 10/10/10, batch 20: 20/25/30, batch 40: 30/40/50.
  At context 2048 (ISL 1536 + OSL 1024 / 2) the KV cache holds 40 960 / 2048 = 20 requests; with an ITL
  target of 30 ms all 20 fit (25 ms) → 20 / 0.025 = 800 tokens/s; with 15 ms the step at batch b is
  10 + (b − 1)·15/19 ms, so b = 7 (14.74 ms) → 7 / (0.28/19) = 475 tokens/s.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from fulcrum.api import EngineSpec, LLMServeSpec, ModelSpec, ScalingSpec, SLOSpec
from fulcrum.errors import PlanningError
from fulcrum.observation import Observation, ReadyCounts
from fulcrum.ratio.profile import PerformanceProfile, profile_from_dict
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.scaling.dynamo_load import DynamoLoadPlanner, DynamoLoadSettings, load_move
from fulcrum.scaling.dynamo_sla import (
    DynamoSlaPlanner,
    DynamoSlaSettings,
    clamp_to_gpu_budget,
    decode_throughput_per_gpu,
    prefill_throughput_per_gpu,
)
from fulcrum.scaling.planner import Planner
from fulcrum.target import ClusterTarget, PoolSize

GIB = 1 << 30


def make_profile(weight_gib: float = 40.0, decode_tps: tuple[int, ...] = (1,)) -> PerformanceProfile:
    decode_row = {"batch": [1, 20, 40], "context": [1024, 2048, 4096], "tpotMs": [[10, 10, 10], [20, 25, 30], [30, 40, 50]]}
    return profile_from_dict(
        {
            "name": "hand",
            "gpu": {"type": "H100", "memoryGiB": 80, "hbmBandwidthGBps": 3350},
            "weightBytes": weight_gib * GIB,
            "kvBytesPerToken": 1 << 20,  # 1 MiB: 40 GiB free → 40 960 tokens at TP=1
            "activationReserveGiB": 0,
            "cudaGraphMaxBatch": 256,
            "prefill": [{"tp": tp, "isl": [512, 1536, 3072], "ttftMs": [40, 96, 300]} for tp in (1, 2)],
            "decode": [{"tp": tp, **decode_row} for tp in decode_tps],
        }
    )


def make_spec(*, ttft_ms: float = 960.0, tpot_ms: float = 30.0, **scaling: Any) -> LLMServeSpec:
    scaling.setdefault("interval_seconds", 60.0)
    return LLMServeSpec(model=ModelSpec(name="m"), slo=SLOSpec(ttft_ms=ttft_ms, tpot_ms=tpot_ms), scaling=ScalingSpec(**scaling))


def obs(
    *,
    t: float = 60.0,
    interval: float = 60.0,
    arrivals: int = 1200,
    completed: int | None = None,
    isl: float = 1536.0,
    osl: float = 1024.0,
    ttft: float = 0.096,
    tpot: float = 0.010,
    concurrency: float = 1.0,
    ready: tuple[int, int] = (1, 1),
    **extra: Any,
) -> Observation:
    return Observation(
        time_s=t,
        interval_s=interval,
        arrivals=arrivals,
        mean_isl=isl,
        mean_osl=osl,
        completed=arrivals if completed is None else completed,
        ttft_p_s=ttft,
        tpot_p_s=tpot,
        concurrency=concurrency,
        ready=ReadyCounts(prefill=ready[0], decode=ready[1]),
        **extra,
    )


def pools(n_p: int, n_d: int) -> ClusterTarget:
    return ClusterTarget(prefill=PoolSize(n_p, 1), decode=PoolSize(n_d, 1))


# ---------------------------------------------------------------------------------------------- helpers


def test_profile_throughputs_match_the_hand_computation() -> None:
    prof = make_profile()
    assert prefill_throughput_per_gpu(prof, 1, 1536) == pytest.approx(16_000)
    thpt, batch, step = decode_throughput_per_gpu(prof, 1, 0.030, 2048)
    assert (batch, step, thpt) == (20, pytest.approx(0.025), pytest.approx(800))
    thpt, batch, _ = decode_throughput_per_gpu(prof, 1, 0.015, 2048)
    assert (batch, thpt) == (7, pytest.approx(475))


def test_decode_throughput_falls_back_to_batch_one_when_no_load_meets_the_itl() -> None:
    thpt, batch, step = decode_throughput_per_gpu(make_profile(), 1, 0.005, 2048)
    assert batch == 1 and step == pytest.approx(0.010) and thpt == pytest.approx(100)


def test_budget_clamp_shrinks_both_pools_and_never_exceeds_max_gpus() -> None:
    assert clamp_to_gpu_budget(2, 26, 1, 1, 1, 10) == (1, 9)
    for n_p in range(0, 30, 3):
        for n_d in range(0, 30, 4):
            for tp_p, tp_d, cap in ((1, 1, 10), (2, 4, 22), (4, 2, 13)):
                p, d = clamp_to_gpu_budget(n_p, n_d, tp_p, tp_d, 0, cap)
                assert p >= 1 and d >= 1 and p * tp_p + d * tp_d <= cap


def test_budget_clamp_grows_toward_min_gpus() -> None:
    assert clamp_to_gpu_budget(1, 1, 1, 1, 6, 64) == (3, 3)


def test_budget_clamp_refuses_a_budget_below_one_instance_per_pool() -> None:
    with pytest.raises(PlanningError, match="maxGPUs"):
        clamp_to_gpu_budget(1, 1, 2, 2, 0, 3)


# ------------------------------------------------------------------------------------------ dynamo-sla


def test_sla_planner_implements_the_planner_protocol() -> None:
    planner = DynamoSlaPlanner(make_spec(interval_seconds=180.0), make_profile())
    assert isinstance(planner, Planner)
    assert planner.name == "dynamo-sla" and planner.tick_s == 180.0
    assert planner.initial() == pools(1, 1)


def test_sla_planner_sizes_each_pool_from_its_own_throughput_curve() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile(), DynamoSlaSettings(demand="arrivals"))
    d = planner.step(obs(), pools(1, 1))
    # prefill: 20 req/s × 1536 = 30 720 tok/s / 16 000 = 1.92 → 2; decode: 20 × 1024 = 20 480 / 800 = 25.6 → 26
    assert (d.target.prefill.replicas, d.target.decode.replicas) == (2, 26)
    assert d.target.unified.replicas == 0
    assert d.numbers.detail["p_correction_factor"] == pytest.approx(1.0)
    assert d.numbers.detail["d_correction_factor"] == pytest.approx(1.0)
    assert d.numbers.detail["decode_context_tokens"] == pytest.approx(2048)
    assert d.forecast["rate"] == {"mean": pytest.approx(20), "lower": pytest.approx(20), "upper": pytest.approx(20)}
    assert d.forecast["isl"]["mean"] == 1536 and d.forecast["osl"]["mean"] == 1024
    assert "prefill" in d.reason and "decode" in d.reason


def test_sla_planner_counts_completed_requests_by_default_like_classic_dynamo() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile())
    d = planner.step(obs(arrivals=1200, completed=600), pools(1, 1))
    # 10 req/s: prefill 15 360 / 16 000 → 1; decode 10 240 / 800 = 12.8 → 13
    assert (d.target.prefill.replicas, d.target.decode.replicas) == (1, 13)


def test_decode_correction_factor_raises_decode_replicas_when_itl_exceeds_the_profile() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile())
    d = planner.step(obs(tpot=0.020), pools(1, 1))  # expected 10 ms at batch 1 → d_cf = 2 → ITL* = 15 ms
    assert d.numbers.detail["d_correction_factor"] == pytest.approx(2.0)
    assert d.numbers.detail["corrected_itl_s"] == pytest.approx(0.015)
    assert d.target.decode.replicas == 44  # 20 480 / 475 = 43.1 → 44 (26 without the correction)


def test_prefill_correction_below_one_lowers_prefill_replicas() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile())
    d = planner.step(obs(ttft=0.048), pools(1, 1))  # p_cf = 0.5: 15 360 / 16 000 → 1
    assert d.target.prefill.replicas == 1


def test_prefill_correction_above_one_is_capped_as_in_dynamo_unless_the_cap_is_lifted() -> None:
    capped = DynamoSlaPlanner(make_spec(), make_profile()).step(obs(ttft=0.192), pools(1, 1))
    assert capped.numbers.detail["p_correction_factor"] == pytest.approx(2.0)
    assert capped.target.prefill.replicas == 2  # min(1, 2) = 1: no extra replica
    uncapped = DynamoSlaPlanner(make_spec(), make_profile(), DynamoSlaSettings(prefill_correction_cap=None))
    d = uncapped.step(obs(ttft=0.192), pools(1, 1))
    assert d.target.prefill.replicas == 4  # 61 440 / 16 000 = 3.84 → 4


def test_sla_planner_respects_the_gpu_budget() -> None:
    planner = DynamoSlaPlanner(make_spec(max_gpus=10), make_profile())
    d = planner.step(obs(), pools(1, 1))
    assert (d.target.prefill.replicas, d.target.decode.replicas) == (1, 9)
    assert d.target.gpus <= 10 and "maxGPUs" in d.reason


def test_sla_planner_keeps_the_pools_on_an_interval_without_requests() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile())
    first = planner.step(obs(), pools(1, 1))
    idle = Observation(time_s=120.0, interval_s=60.0, arrivals=0, mean_isl=0.0, mean_osl=0.0)
    d = planner.step(idle, first.target)
    assert d.target == first.target and "skipped" in d.reason
    for series in d.forecast.values():
        assert all(math.isfinite(v) for v in series.values())
    again = planner.step(obs(t=180.0), d.target)
    assert (again.target.prefill.replicas, again.target.decode.replicas) == (2, 26)


def test_sla_planner_never_raises_on_degenerate_observations() -> None:
    planner = DynamoSlaPlanner(make_spec(), make_profile())
    odd = [
        Observation(time_s=0.0, interval_s=0.0, arrivals=0, mean_isl=0.0, mean_osl=0.0),
        obs(ttft=math.nan, tpot=math.nan),
        obs(concurrency=math.nan),
        obs(isl=1.0, osl=1.0, concurrency=0.0),
        obs(isl=50_000.0, osl=8_000.0, ttft=100.0, tpot=5.0),
    ]
    current = pools(1, 1)
    for o in odd:
        d = planner.step(o, current)
        assert d.target.prefill.replicas >= 1 and d.target.decode.replicas >= 1
        assert d.target.gpus <= 64
        current = d.target


def test_sla_planner_uses_the_injected_predictor() -> None:
    class Doubling:
        def __init__(self) -> None:
            self.last = 0.0

        def observe(self, value: float) -> None:
            self.last = value

        def forecast(self, steps: int = 1, level: float = 0.9) -> Any:
            class F:
                mean = lower = upper = 2 * self.last

            return F()

    planner = DynamoSlaPlanner(make_spec(), make_profile(), predictor_factory=Doubling)
    d = planner.step(obs(arrivals=600, isl=768, osl=512), pools(1, 1))
    assert d.numbers.detail["predicted_rate_rps"] == pytest.approx(20)
    assert (d.numbers.detail["predicted_isl"], d.numbers.detail["predicted_osl"]) == (1536, 1024)


def test_sla_planner_can_forecast_with_fulcrums_arima() -> None:
    pytest.importorskip("fulcrum.forecast.arima")
    planner = DynamoSlaPlanner(make_spec(), make_profile(), DynamoSlaSettings(demand="arrivals", predictor="arima"))
    current = planner.initial()
    for k in range(12):  # a steady ramp of 600 → 1700 requests per minute
        d = planner.step(obs(t=60.0 * (k + 1), arrivals=600 + 100 * k), current)
        current = d.target
    assert d.forecast["rate"]["mean"] > 1700 / 60  # the trend is extrapolated, not the last value repeated
    assert d.forecast["rate"]["lower"] <= d.forecast["rate"]["mean"] <= d.forecast["rate"]["upper"]
    assert all(math.isfinite(v) for series in d.forecast.values() for v in series.values())


def test_tp_is_the_smallest_one_that_holds_the_weights_unless_fixed() -> None:
    prof = make_profile(weight_gib=100.0, decode_tps=(1, 2))  # 100 GiB of weights: TP=1 cannot hold them
    planner = DynamoSlaPlanner(make_spec(), prof)
    assert planner.initial() == ClusterTarget(prefill=PoolSize(1, 2), decode=PoolSize(1, 2))
    with pytest.raises(PlanningError):
        DynamoSlaPlanner(make_spec(tp_decode=1), prof)
    with pytest.raises(PlanningError):
        DynamoLoadPlanner(make_spec(tp_decode=4), make_profile())


def _long_spec(max_model_len: int, **scaling: Any) -> LLMServeSpec:
    scaling.setdefault("interval_seconds", 60.0)
    return LLMServeSpec(
        model=ModelSpec(name="m"), engine=EngineSpec(max_model_len=max_model_len), slo=SLOSpec(ttft_ms=2000, tpot_ms=100),
        scaling=ScalingSpec(**scaling),
    )


@pytest.mark.parametrize("planner_cls", [DynamoSlaPlanner, DynamoLoadPlanner])
def test_tp_holds_one_max_model_len_sequence_in_its_kv_cache(planner_cls: Any) -> None:
    # splitwise-llama2-70b-h100 holds 76,931 tokens at TP2, 575,004 at TP4: vLLM would refuse a TP2 engine at 100,000
    prof = builtin_profile("splitwise-llama2-70b-h100")
    short = planner_cls(_long_spec(8192), prof).initial()
    assert (short.prefill.tp, short.decode.tp) == (2, 2)  # unchanged where the smallest TP holds maxModelLen
    long = planner_cls(_long_spec(100_000), prof).initial()
    assert long.prefill.tp >= 4 and long.decode.tp >= 4
    assert prof.kv_capacity_tokens(long.prefill.tp) >= 100_000 and prof.kv_capacity_tokens(long.decode.tp) >= 100_000


@pytest.mark.parametrize("planner_cls", [DynamoSlaPlanner, DynamoLoadPlanner])
def test_no_tp_holding_max_model_len_is_a_planning_error(planner_cls: Any) -> None:
    # the hand profile holds 40,960 tokens at TP1 (its only decode TP by default) and 122,880 at TP2
    with pytest.raises(PlanningError, match=r"maxModelLen 50,000.*decode"):
        planner_cls(_long_spec(50_000), make_profile())
    with pytest.raises(PlanningError, match="maxModelLen 150,000"):
        planner_cls(_long_spec(150_000), make_profile(decode_tps=(1, 2)))


@pytest.mark.parametrize("planner_cls", [DynamoSlaPlanner, DynamoLoadPlanner])
@pytest.mark.parametrize(("pin", "field"), [("tp_prefill", "spec.scaling.tpPrefill"), ("tp_decode", "spec.scaling.tpDecode")])
def test_a_pinned_tp_that_cannot_hold_max_model_len_raises_naming_the_field(planner_cls: Any, pin: str, field: str) -> None:
    prof = builtin_profile("splitwise-llama2-70b-h100")
    with pytest.raises(PlanningError, match=rf"{re.escape(field)}=2 cannot serve maxModelLen 100,000.*TP 4 does"):
        planner_cls(_long_spec(100_000, **{pin: 2}), prof)
    assert planner_cls(_long_spec(100_000, **{pin: 4}), prof).initial() is not None  # a pin that holds it stands
    with pytest.raises(PlanningError, match="no .* table for TP=3"):  # an unmeasured pin: the old error first
        planner_cls(_long_spec(100_000, **{pin: 3}), prof)


def test_a_budget_smaller_than_one_instance_per_pool_is_a_planning_error() -> None:
    with pytest.raises(PlanningError):
        DynamoSlaPlanner(make_spec(max_gpus=1), make_profile())


# ----------------------------------------------------------------------------------------- dynamo-load

STATIC = DynamoLoadSettings(thresholds="static")


def test_load_planner_implements_the_planner_protocol() -> None:
    planner = DynamoLoadPlanner(make_spec(initial_prefill=2, initial_decode=3), make_profile())
    assert isinstance(planner, Planner)
    assert planner.name == "dynamo-load" and planner.tick_s == 5.0
    assert planner.initial() == pools(2, 3)


def test_load_move_is_plus_one_above_target_and_minus_one_only_under_the_n_over_n_minus_one_boundary() -> None:
    assert load_move(5.1, 5.0, 3, 0.8, 1).delta == +1
    # 4 instances, 11 queued → 2.75 each < 5 × 3/4 × 0.8 = 3.0 → −1; 12 queued → 3.0, not below → 0
    assert load_move(11 / 4, 5.0, 4, 0.8, 1).delta == -1
    assert load_move(12 / 4, 5.0, 4, 0.8, 1).delta == 0
    assert load_move(0.0, 5.0, 1, 0.8, 1).delta == 0
    assert load_move(0.0, 5.0, 2, 0.8, 2).delta == 0
    assert load_move(math.nan, 5.0, 3, 0.8, 1).delta == 0


def test_load_planner_moves_at_most_one_replica_per_pool_per_tick() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile(), STATIC)
    d = planner.step(obs(t=5, interval=5, prefill_queue=500, kv_utilisation=0.99, ready=(2, 2)), pools(2, 2))
    assert (d.target.prefill.replicas, d.target.decode.replicas) == (3, 3)


def test_load_planner_scales_in_only_after_the_n_over_n_minus_one_check() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile(), STATIC)
    # KV 50 %: with 4 decode instances 0.5 < 0.9 × 3/4 × 0.8 = 0.54 → 3; with 2, 0.5 ≥ 0.36 → stay
    d4 = planner.step(obs(t=5, interval=5, kv_utilisation=0.5, prefill_queue=4, ready=(1, 4)), pools(1, 4))
    assert d4.target.decode.replicas == 3
    d2 = DynamoLoadPlanner(make_spec(), make_profile(), STATIC).step(
        obs(t=5, interval=5, kv_utilisation=0.5, prefill_queue=4, ready=(1, 2)), pools(1, 2)
    )
    assert d2.target.decode.replicas == 2
    assert d4.numbers.detail["decode_boundary"] == pytest.approx(0.54)


def test_load_planner_counts_queued_decode_requests_as_kv_load() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile(), STATIC)
    # 80 % used + 20 queued per instance × 1536 tokens / 40 960 = 0.75 → 1.55 > 0.9
    d = planner.step(obs(t=5, interval=5, kv_utilisation=0.8, decode_queue=40, ready=(1, 2)), pools(1, 2))
    assert d.numbers.detail["decode_kv_load"] == pytest.approx(0.8 + 20 * 1536 / 40960)
    assert d.target.decode.replicas == 3


def test_load_planner_observes_only_while_a_scaling_is_in_progress() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile(), STATIC)
    hot = dict(interval=5, prefill_queue=100)
    d1 = planner.step(obs(t=5, ready=(1, 1), **hot), pools(1, 1))
    assert d1.target.prefill.replicas == 2
    d2 = planner.step(obs(t=10, ready=(1, 1), **hot), d1.target)  # the new instance is not ready yet
    assert d2.target.prefill.replicas == 2 and d2.numbers.detail["prefill_in_progress"]
    d3 = planner.step(obs(t=15, ready=(2, 1), **hot), d2.target)
    assert d3.target.prefill.replicas == 3
    stuck = planner.step(obs(t=15 + 1800, ready=(2, 1), **hot), d3.target)  # gives up waiting after 30 min
    assert stuck.target.prefill.replicas == 4


def steady_run(planner: DynamoLoadPlanner, queued: float, kv_total: float, n0: tuple[int, int], ticks: int) -> list[tuple[int, int]]:
    """Replay a steady load: ``queued`` prefill requests and ``kv_total`` instances' worth of KV in total."""
    current = pools(*n0)
    seen = [n0]
    for k in range(ticks):
        n_p, n_d = current.prefill.replicas, current.decode.replicas
        o = obs(t=5.0 * (k + 1), interval=5.0, prefill_queue=int(queued), kv_utilisation=kv_total / n_d, ready=(n_p, n_d))
        current = planner.step(o, current).target
        seen.append((current.prefill.replicas, current.decode.replicas))
    return seen


@pytest.mark.parametrize("thresholds", ["static", "sla"])
def test_load_planner_never_oscillates_on_a_steady_load(thresholds: str) -> None:
    for queued in (0, 3, 7, 12, 25, 60):
        for kv_total in (0.0, 0.4, 1.3, 2.7, 6.0):
            for n0 in ((1, 1), (3, 2), (8, 8)):
                planner = DynamoLoadPlanner(make_spec(), make_profile(), DynamoLoadSettings(thresholds=thresholds))  # type: ignore[arg-type]
                seen = steady_run(planner, queued, kv_total, n0, ticks=30)
                for pool in (0, 1):
                    steps = [b[pool] - a[pool] for a, b in zip(seen, seen[1:]) if b[pool] != a[pool]]
                    assert all(abs(s) == 1 for s in steps)
                    assert all(s > 0 for s in steps) or all(s < 0 for s in steps), (queued, kv_total, n0, seen)
                    assert seen[-1][pool] == seen[-2][pool]  # settled


def test_load_planner_settles_where_the_hand_computation_says() -> None:
    # 12 queued prefills, static target 5/instance: 1 → 2 (6 > 5) → 3 (4 ≤ 5); in: 12/2 = 6 ≥ 4 → stays at 3
    seen = steady_run(DynamoLoadPlanner(make_spec(), make_profile(), STATIC), 12, 0.45, (1, 1), ticks=10)
    assert seen[-1][0] == 3 and seen[-1][1] == 1


def test_load_planner_scale_out_stops_at_the_gpu_budget_prefill_first() -> None:
    planner = DynamoLoadPlanner(make_spec(max_gpus=4), make_profile(), STATIC)
    d = planner.step(obs(t=5, interval=5, prefill_queue=100, kv_utilisation=0.99, ready=(1, 2)), pools(1, 2))
    assert (d.target.prefill.replicas, d.target.decode.replicas) == (2, 2)
    assert "decode scale-out held by maxGPUs" in d.reason


def test_load_planner_scale_in_stops_at_min_gpus() -> None:
    planner = DynamoLoadPlanner(make_spec(min_gpus=4), make_profile(), STATIC)
    d = planner.step(obs(t=5, interval=5, arrivals=0, ready=(2, 2)), pools(2, 2))
    assert d.target.gpus == 4


def test_load_planner_shrinks_one_per_tick_to_one_each_once_arrivals_stop() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile())
    busy = obs(t=5, interval=5, arrivals=50, prefill_queue=30, kv_utilisation=0.8, ready=(3, 4))
    current = planner.step(busy, pools(3, 4)).target  # 10 queued per instance > 9: prefill grows
    assert current == pools(4, 4)
    for k in range(6):
        n_p, n_d = current.prefill.replicas, current.decode.replicas
        idle = Observation(time_s=10.0 + 5 * k, interval_s=5.0, arrivals=0, mean_isl=0.0, mean_osl=0.0, ready=ReadyCounts(n_p, n_d))
        d = planner.step(idle, current)
        assert n_p - d.target.prefill.replicas in (0, 1) and n_d - d.target.decode.replicas in (0, 1)
        current = d.target
    assert current == pools(1, 1)


def test_load_planner_with_sla_targets_keeps_the_pools_before_any_request_is_seen() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile())
    idle = Observation(time_s=5.0, interval_s=5.0, arrivals=0, mean_isl=0.0, mean_osl=0.0, ready=ReadyCounts(3, 4))
    d = planner.step(idle, pools(3, 4))
    assert d.target == pools(3, 4) and "no ISL seen yet" in d.reason


def test_load_planner_holds_a_pool_whose_signal_is_not_a_number() -> None:
    planner = DynamoLoadPlanner(make_spec(), make_profile(), STATIC)
    d = planner.step(obs(t=5, interval=5, kv_utilisation=math.nan, ready=(1, 3)), pools(1, 3))
    assert d.target.decode.replicas == 3


def test_load_planner_sla_targets_come_from_the_slos_and_the_profile() -> None:
    planner = DynamoLoadPlanner(make_spec(ttft_ms=960.0, tpot_ms=15.0), make_profile())
    d = planner.step(obs(t=5, interval=5, prefill_queue=20, kv_utilisation=0.30, ready=(2, 2)), pools(2, 2))
    # prefill: 0.96 s / 0.096 s − 1 = 9 requests per instance; 20/2 = 10 > 9 → +1
    assert d.numbers.detail["prefill_target"] == pytest.approx(9.0)
    assert d.target.prefill.replicas == 3
    # decode: 7 requests × 2048 tokens / 40 960 = 0.35; 0.30 is inside [0.35 × 1/2 × 0.8, 0.35] → stay
    assert d.numbers.detail["decode_target"] == pytest.approx(0.35)
    assert d.target.decode.replicas == 2


def test_load_planner_leaves_prefill_alone_when_the_ttft_slo_is_unreachable() -> None:
    planner = DynamoLoadPlanner(make_spec(ttft_ms=50.0), make_profile())  # one 1536-token prefill takes 96 ms
    d = planner.step(obs(t=5, interval=5, prefill_queue=500, ready=(2, 1)), pools(2, 1))
    assert d.target.prefill.replicas == 2 and "unreachable" in d.reason


def test_load_planner_reconciles_a_target_outside_the_budget() -> None:
    planner = DynamoLoadPlanner(make_spec(max_gpus=6), make_profile(), STATIC)
    d = planner.step(obs(t=5, interval=5), pools(5, 5))
    assert d.target.gpus <= 6 and d.target.prefill.replicas >= 1 and d.target.decode.replicas >= 1
