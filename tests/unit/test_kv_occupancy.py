"""The KV-cache occupancy model of decode and unified pools (fulcrum.ratio.capacity, issue 13)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from fulcrum.api import Mode, SLOSpec, parse_llmserve
from fulcrum.observation import QUANTILE_LEVELS
from fulcrum.ratio.capacity import kv_context_moments, kv_instances_needed
from fulcrum.ratio.lengths import LengthDistribution
from fulcrum.ratio.planner import PlannerSettings, WorkloadEstimate, plan_disaggregated, plan_unified
from fulcrum.replay.driver import ReplayOptions, run_planner
from fulcrum.replay.static_best import _static_spec
from fulcrum.scaling.static import StaticPlanner
from fulcrum.traces import load_trace
from fulcrum.workload import Request


def test_moments_of_fixed_lengths_are_the_time_average_over_the_decode():
    # prompt x, output o: context x + k for k in [0, o): mean x + o/2, mean square x² + x·o + o²/3
    m1, m2 = kv_context_moments(LengthDistribution.point(1000), LengthDistribution.point(300))
    assert m1 == pytest.approx(1000 + 150)
    assert m2 == pytest.approx(1000**2 + 1000 * 300 + 300**2 / 3)


def test_longer_outputs_weigh_more_in_the_in_flight_mix():
    # half the requests have 10 output tokens, half 1000: an in-flight request is the long kind 99% of the time
    osl = LengthDistribution((10.0, 1000.0), (0.5, 0.5))
    m1, _ = kv_context_moments(LengthDistribution.point(1), osl)
    assert m1 == pytest.approx(1 + (0.5 * 100 + 0.5 * 1e6) / (2 * 505))
    assert m1 > osl.mean() / 2


def test_the_median_demand_needs_exactly_the_mean_tokens():
    # z = 0 at the median: L·m1 tokens over caches of C tokens
    assert kv_instances_needed(50, 1000.0, 2e6, 10_000.0, 0.5) == pytest.approx(5.0)


def test_instances_hold_the_quantile_of_a_compound_poisson_demand():
    n = kv_instances_needed(52.0, 1218.6, 2.07e6, 76_931.0, 0.99)
    y = 52.0 / n  # requests per instance at the need
    z = NormalDist().inv_cdf(0.99)
    assert y * 1218.6 + z * math.sqrt(y * 2.07e6) == pytest.approx(76_931.0)
    assert 1.0 < n < 1.3  # the mean alone (52 × 1219 = 63k tokens) fits one 77k-token cache


def test_a_higher_level_or_a_wider_spread_needs_more_instances():
    base = kv_instances_needed(40, 1000.0, 2e6, 60_000.0, 0.9)
    assert kv_instances_needed(40, 1000.0, 2e6, 60_000.0, 0.99) > base
    assert kv_instances_needed(40, 1000.0, 8e6, 60_000.0, 0.9) > base


def test_edge_cases_of_the_instance_need():
    assert kv_instances_needed(0.0, 1000.0, 2e6, 1e4, 0.99) == 0.0
    assert kv_instances_needed(10.0, 1000.0, 2e6, 0.0, 0.99) == math.inf
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="quantile"):
            kv_instances_needed(10.0, 1000.0, 2e6, 1e4, bad)


def _lengths(trace: str, t0: float) -> tuple[LengthDistribution, LengthDistribution, list[Request]]:
    reqs = [r for r in load_trace(trace, None).requests if r.arrival_s >= t0]
    isl = np.array([r.isl for r in reqs], dtype=float)
    osl = np.array([r.osl for r in reqs], dtype=float)
    dist = [LengthDistribution.from_quantiles(QUANTILE_LEVELS, [float(np.quantile(a, q)) for q in QUANTILE_LEVELS],
                                              float(a.mean())) for a in (isl, osl)]
    return dist[0], dist[1], reqs


def test_decode_pools_are_sized_for_the_kv_tail_and_meet_the_slo_in_the_simulator(splitwise):
    """At the steady 5 req/s of the synthetic trace (Llama-2-70B, TP 2), the mean in-flight context fits one
    decode instance's cache (eq. 13), but the KV demand's P99 does not: one D instance preempts and recomputes,
    and its pools miss the P90 SLO on a Poisson load of that rate in the simulator; the plan asks for two, and
    those pools meet it."""
    isl, osl, src = _lengths("synthetic-burst-steady", 1800.0)
    slo = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)
    lam = 5.0
    p = plan_disaggregated(WorkloadEstimate(lam, isl, osl), splitwise, slo, tp_prefill=2, tp_decode=2)
    assert p.inputs["decode_kv_need"] > 1.0 > lam * osl.mean() * p.t_d_s / p.decode_concurrency
    assert p.decode.replicas == 2
    no_tail = plan_disaggregated(WorkloadEstimate(lam, isl, osl), splitwise, slo, tp_prefill=2, tp_decode=2,
                                 settings=PlannerSettings(kv_occupancy_quantile=0.5))
    assert no_tail.decode.replicas == 1

    spec = parse_llmserve({
        "model": {"name": "m"}, "slo": {"ttftMs": 2000, "tpotMs": 100, "percentile": 90},
        "scaling": {"minGPUs": 0, "maxGPUs": 64, "intervalSeconds": 60, "tpPrefill": 2, "tpDecode": 2},
        "profile": {"name": "splitwise-llama2-70b-h100"},
    }).spec
    rng = np.random.default_rng(0)
    n = int(rng.poisson(lam * 900))
    t = np.sort(rng.uniform(0.0, 900.0, n))
    pick = rng.integers(0, len(src), n)
    load = [Request(float(t[i]), src[pick[i]].isl, src[pick[i]].osl) for i in range(n)]

    def attainment(p_: int, d_: int) -> float:
        static = StaticPlanner(_static_spec(spec, Mode.DISAGGREGATED, p_, d_, 0), splitwise)
        return run_planner(static, load, spec, splitwise, ReplayOptions(warmup_s=120.0), name="static").summary.slo_attainment

    assert attainment(p.prefill.replicas, p.decode.replicas) >= 0.9
    assert attainment(no_tail.prefill.replicas, no_tail.decode.replicas) < 0.9


def test_unified_pools_count_the_kv_tail_at_the_batch_they_will_run(splitwise):
    """The unified KV need is solved at the per-instance load it implies (more instances, smaller batches)."""
    isl, osl, _ = _lengths("synthetic-burst-steady", 1800.0)
    slo = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)
    for lam in (2.0, 5.0, 8.0):
        p = plan_unified(WorkloadEstimate(lam, isl, osl), splitwise, slo, tp_unified=2)
        assert p.inputs["unified_need"] >= p.inputs["unified_rate_need"]
        assert p.unified.replicas == math.ceil(p.inputs["unified_need"] - 1e-9)
