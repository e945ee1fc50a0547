"""Scaling the simulated cluster (start-up, drain, GPU accounting) and what ``observe`` reports."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fulcrum.api.llmserve import SLOSpec
from fulcrum.observation import QUANTILE_LEVELS
from fulcrum.ratio.profile import PerformanceProfile, profile_from_dict
from fulcrum.simulator import SimConfig, SimResult, Simulation
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams
from fulcrum.workload import Request

SLO = SLOSpec(ttft_ms=2000, tpot_ms=80, percentile=90)


def make_profile(kv_tokens: int = 1_000_000) -> PerformanceProfile:
    """A toy profile: prefill at TP 1, decode at TP 1 and 2 (KV capacity ``kv_tokens`` at TP 1)."""
    return profile_from_dict(
        {
            "name": "toy",
            "model": "toy",
            "gpu": {"type": "T", "memoryGiB": 64, "hbmBandwidthGBps": 1000},
            "weightBytes": 64 * 2**30 - kv_tokens * 1024,
            "kvBytesPerToken": 1024,
            "activationReserveGiB": 0,
            "cudaGraphMaxBatch": 64,
            "prefill": [{"tp": 1, "isl": [100, 1000, 2000], "ttftMs": [20, 110, 230]}],
            "decode": [
                {"tp": 1, "batch": [1, 64], "context": [100, 4000], "tpotMs": [[10, 14], [20, 30]]},
                {"tp": 2, "batch": [1, 64], "context": [100, 4000], "tpotMs": [[7, 9], [12, 18]]},
            ],
        }
    )


def pd(p: int, d: int, tp_d: int = 1) -> ClusterTarget:
    return ClusterTarget(prefill=PoolSize(p, 1), decode=PoolSize(d, tp_d))


def integral(timeline: list[tuple[float, int, int]], end: float) -> float:
    """∫ provisioned GPUs dt over [0, end] from a timeline of (time, provisioned, ready)."""
    times = [t for t, _, _ in timeline] + [end]
    return sum(g * (times[i + 1] - times[i]) for i, (_, g, _) in enumerate(timeline))


def states(sim: Simulation, role: str) -> list[str]:
    return [s.state for s in sim.instances() if s.role == role]


def test_scale_out_instances_count_gpus_at_once_and_become_ready_after_the_startup_delay() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 10), Request(400.0, 500, 10)]
    sim = Simulation(reqs, prof, SLO, pd(1, 1), SimConfig(pod_startup_s=120.0))
    sim.run_until(10.0)
    sim.apply(pd(1, 3))
    assert states(sim, "decode") == ["ready", "starting", "starting"]
    assert sim.observe(10.0).ready.decode == 1
    sim.run_until(129.999)
    assert states(sim, "decode") == ["ready", "starting", "starting"]
    sim.run_until(130.0)
    assert states(sim, "decode") == ["ready", "ready", "ready"]
    assert sim.observe(60.0).ready.decode == 3
    res = sim.finish()
    assert res.gpu_timeline[:3] == [(0.0, 2, 2), (10.0, 4, 2), (130.0, 4, 4)]
    assert res.gpu_seconds == pytest.approx(2 * res.end_s + 2 * (res.end_s - 10.0))


def test_new_decode_instances_get_work_only_once_ready() -> None:
    prof = make_profile()
    sim = Simulation([], prof, SLO, pd(1, 0), SimConfig(pod_startup_s=50.0))
    sim.apply(pd(1, 1))
    sim2 = Simulation([Request(1.0, 500, 10)], prof, SLO, pd(1, 0), SimConfig(pod_startup_s=50.0))
    sim2.apply(pd(1, 1))
    (rec,) = sim2.finish().records
    # no instance may decode it until the decode instance is ready at 50 s: it waits at the router (the
    # policy raises NoInstanceError), then prefills and decodes
    assert rec.path == "disaggregated"
    assert rec.arrival_s + rec.ttft_s == pytest.approx(50.0 + prof.ttft(500, 1))
    assert sim.finish().records == []


def test_scale_in_drains_the_least_loaded_instance_without_losing_a_request() -> None:
    prof = make_profile()
    # one long request per decode instance; the second instance also gets a short one
    reqs = [Request(0.0, 500, 2000), Request(0.2, 500, 3000), Request(0.4, 500, 500)]
    sim = Simulation(reqs, prof, SLO, pd(2, 2), SimConfig(pod_startup_s=0.0))
    sim.run_until(1.0)
    loads = {s.iid: s.running + s.waiting for s in sim.instances() if s.role == "decode"}
    assert sorted(loads.values()) == [1, 2]
    sim.apply(pd(2, 1))
    draining = [s.iid for s in sim.instances() if s.state == "draining"]
    assert draining == [min(loads, key=lambda i: loads[i])]  # the least-loaded one
    assert sim.observe(1.0).ready.decode == 1
    res = sim.finish()
    assert all(math.isfinite(r.finish_s) for r in res.records)
    # the draining instance left when its own request finished, not before
    drained_at = next(t for t, g, _ in res.gpu_timeline if g == 3)
    assert drained_at == pytest.approx(max(r.finish_s for r in res.records if r.decode_instance == draining[0]))
    assert res.gpu_seconds == pytest.approx(3 * res.end_s + drained_at)
    assert res.gpu_seconds == pytest.approx(integral(res.gpu_timeline, res.end_s))


def test_scale_in_cancels_a_starting_instance_before_draining_a_ready_one() -> None:
    prof = make_profile()
    sim = Simulation([Request(0.0, 500, 100)], prof, SLO, pd(1, 1), SimConfig(pod_startup_s=100.0))
    sim.run_until(5.0)
    sim.apply(pd(1, 2))
    sim.run_until(20.0)
    sim.apply(pd(1, 1))
    assert states(sim, "decode") == ["ready"]
    res = sim.finish()
    assert res.gpu_timeline[:3] == [(0.0, 2, 2), (5.0, 3, 2), (20.0, 2, 2)]


def test_scale_out_prefers_undraining_a_draining_instance_to_starting_a_new_one() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 2000), Request(0.1, 500, 2000)]
    sim = Simulation(reqs, prof, SLO, pd(1, 2), SimConfig(pod_startup_s=60.0))
    sim.run_until(1.0)
    sim.apply(pd(1, 1))
    assert states(sim, "decode") == ["ready", "draining"]
    sim.run_until(2.0)
    sim.apply(pd(1, 2))
    assert states(sim, "decode") == ["ready", "ready"]
    assert len(sim.instances()) == 3


def test_changing_the_decode_tp_drains_the_old_instances_and_starts_new_ones() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 500), Request(30.0, 500, 10)]
    sim = Simulation(reqs, prof, SLO, pd(1, 1), SimConfig(pod_startup_s=10.0))
    sim.run_until(1.0)
    sim.apply(pd(1, 1, tp_d=2))
    assert [(s.tp, s.state) for s in sim.instances() if s.role == "decode"] == [(1, "draining"), (2, "starting")]
    res = sim.finish()
    assert all(math.isfinite(r.finish_s) for r in res.records)
    assert res.gpu_timeline[1] == (1.0, 4, 2)
    assert res.gpu_timeline[-1][1] == 3  # P (1 GPU) + the TP=2 decode instance


def test_a_drain_timeout_redispatches_what_is_left_and_still_loses_nothing() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 20_000), Request(0.1, 500, 20_000)]
    cfg = SimConfig(pod_startup_s=0.0, drain_timeout_s=5.0)
    sim = Simulation(reqs, prof, SLO, pd(1, 2), cfg)
    sim.run_until(1.0)
    sim.apply(pd(1, 1))
    sim.run_until(6.5)
    assert states(sim, "decode") == ["ready"]  # removed at the timeout
    (dec,) = [s for s in sim.instances() if s.role == "decode"]
    assert dec.running == 2  # the evicted request is recomputed beside the other one
    res = sim.finish()
    assert all(math.isfinite(r.finish_s) for r in res.records)
    assert res.gpu_seconds == pytest.approx(2 * res.end_s + 6.0)


def test_switching_to_a_unified_pool_moves_queued_prompts_to_it() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 10), Request(1.0, 500, 10), Request(100.0, 500, 10)]
    sim = Simulation(reqs, prof, SLO, pd(1, 0), SimConfig(pod_startup_s=5.0))
    sim.run_until(2.0)
    assert sim.observe(2.0).prefill_queue == 2  # no instance may decode them: they wait at the router
    sim.apply(ClusterTarget(unified=PoolSize(1, 1)))
    res = sim.finish()
    assert [r.path for r in res.records] == ["unified", "unified", "unified"]
    assert all(math.isfinite(r.finish_s) for r in res.records)
    assert res.records[0].ttft_s >= 7.0  # waited for the unified instance's start-up


def test_observe_counts_arrivals_at_admission_during_a_backlog() -> None:
    prof = make_profile()
    reqs = [Request(0.1 * i, 1000 + i, 50 + i) for i in range(100)]  # 10/s, each prefill takes ~0.11 s
    sim = Simulation(reqs, prof, SLO, pd(1, 1), SimConfig())
    sim.run_until(10.0)
    obs = sim.observe(10.0)
    assert obs.arrivals == 100
    assert obs.rate_rps == pytest.approx(10.0)
    assert obs.mean_isl == pytest.approx(np.mean([r.isl for r in reqs]))
    assert obs.mean_osl == pytest.approx(np.mean([r.osl for r in reqs]))
    assert obs.isl_quantiles == pytest.approx(tuple(np.quantile([r.isl for r in reqs], QUANTILE_LEVELS)))
    assert obs.isl_sq_mean == pytest.approx(np.mean([r.isl**2 for r in reqs]))
    assert obs.arrival_cv2 == pytest.approx(0.0, abs=1e-9)  # evenly spaced
    assert obs.prefill_queue > 0  # the burst is still queued at prefill...
    assert obs.completed < obs.arrivals  # ...and completions lag it: demand is not read from them
    assert obs.concurrency > obs.completed / 10.0
    assert obs.ttft_attainment == 1.0 and math.isnan(obs.tpot_attainment) is (obs.completed == 0)
    assert obs.kv_utilisation > 0.0
    later = sim.observe(5.0)
    assert later.arrivals == 49  # (5, 10]: the arrival at exactly 5.0 s belongs to the previous window


def test_observe_windows_report_attainment_percentiles_and_time_averaged_concurrency() -> None:
    prof = make_profile()
    reqs = [Request(1.0, 500, 11), Request(2.0, 500, 11)]
    sim = Simulation(reqs, prof, SLO, pd(1, 1), SimConfig())
    res_sim = sim
    res_sim.run_until(60.0)
    obs = res_sim.observe(60.0)
    records = res_sim.finish().records
    assert obs.arrivals == 2 and obs.completed == 2
    assert obs.arrival_cv2 == 1.0  # fewer than three arrivals
    assert obs.ttft_attainment == 1.0 and obs.slo_attainment == 1.0
    ttfts = [r.ttft_s for r in records]
    assert obs.ttft_p_s == pytest.approx(np.percentile(ttfts, 90))
    in_system = sum(r.finish_s - r.arrival_s for r in records)
    assert obs.concurrency == pytest.approx(in_system / 60.0)
    quiet = res_sim.observe(1.0)
    assert quiet.arrivals == 0 and quiet.mean_isl == 0.0 and math.isnan(quiet.ttft_p_s)


def test_result_summary_reports_every_headline_figure() -> None:
    prof = make_profile()
    res: SimResult = Simulation([Request(0.0, 500, 11), Request(3.0, 1500, 5)], prof, SLO, pd(1, 1)).finish()
    s = res.summary(SLO)
    assert set(s) == {
        "slo_attainment", "goodput_tokens_per_s", "throughput_tokens_per_s", "gpu_hours", "ttft_p_s",
        "tpot_p_s", "ttft_attainment", "tpot_attainment", "requests",
    }
    assert s["throughput_tokens_per_s"] == pytest.approx(16 / 3.0)
    assert s["ttft_p_s"] == pytest.approx(np.percentile([r.ttft_s for r in res.records], 90))


def test_routing_changes_apply_to_requests_arriving_afterwards() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 150, 5), Request(10.0, 150, 5)]
    sim = Simulation(reqs, prof, SLO, pd(1, 1), SimConfig())
    sim.run_until(5.0)
    local = RoutingParams(ultra_short_tokens=200)
    sim.apply(ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 1), routing=local))
    first, second = sim.finish().records
    assert (first.path, second.path) == ("disaggregated", "local")


def test_the_clock_only_moves_forward_and_finish_returns_one_result() -> None:
    prof = make_profile()
    sim = Simulation([Request(0.0, 500, 10)], prof, SLO, pd(1, 1))
    sim.run_until(5.0)
    assert sim.now == 5.0
    with pytest.raises(ValueError):
        sim.run_until(4.0)
    with pytest.raises(ValueError):
        sim.observe(0.0)
    first = sim.finish()
    assert sim.finish() is first
    assert first.end_s == 5.0  # the caller had already run past the last completion
