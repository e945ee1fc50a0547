"""How the simulated cluster serves requests: latencies from the profile, queueing, KV memory, request paths."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from fulcrum.api.llmserve import SLOSpec
from fulcrum.ratio.profile import PerformanceProfile, profile_from_dict
from fulcrum.simulator import SimConfig, Simulation
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams
from fulcrum.workload import Request
from fulcrum.routing.least_loaded import LeastLoadedPolicy

SLO = SLOSpec(ttft_ms=2000, tpot_ms=80, percentile=90)
KV_BYTES = 1024  # per token


def make_profile(kv_tokens: int = 1_000_000, max_batch: int = 64) -> PerformanceProfile:
    """A toy profile: prefill and decode at TP 1, KV capacity exactly ``kv_tokens`` at TP 1."""
    return profile_from_dict(
        {
            "name": "toy",
            "model": "toy",
            "gpu": {"type": "T", "memoryGiB": 64, "hbmBandwidthGBps": 1000},
            "weightBytes": 64 * 2**30 - kv_tokens * KV_BYTES,
            "kvBytesPerToken": KV_BYTES,
            "activationReserveGiB": 0,
            "cudaGraphMaxBatch": max_batch,
            "prefill": [{"tp": 1, "isl": [100, 1000, 2000], "ttftMs": [20, 110, 230]}],
            "decode": [{"tp": 1, "batch": [1, 64], "context": [100, 4000], "tpotMs": [[10, 14], [20, 30]]}],
        }
    )


def pd(p: int, d: int, **routing: object) -> ClusterTarget:
    routing_params = RoutingParams(**routing)  # type: ignore[arg-type]
    return ClusterTarget(prefill=PoolSize(p, 1), decode=PoolSize(d, 1), routing=routing_params)


def test_a_lone_request_sees_its_prefill_time_as_ttft_and_the_profile_step_time_as_tpot() -> None:
    prof = make_profile()
    cfg = SimConfig()
    res = Simulation([Request(0.0, 500, 11)], prof, SLO, pd(1, 1), cfg).finish()
    (rec,) = res.records
    transfer = prof.kv_transfer_seconds(500, cfg.kv_link_gbps) + cfg.kv_transfer_overhead_s
    # batch of one; its context grows from 501 tokens by one per step
    step = sum(prof.tpot(1, 501 + k, 1) for k in range(10)) / 10
    assert rec.path == "disaggregated"
    assert rec.ttft_s == pytest.approx(prof.ttft(500, 1), rel=1e-12)
    # 10 decode steps after the first token; the KV transfer delays the second token
    assert rec.finish_s == pytest.approx(rec.ttft_s + transfer + 10 * step, rel=1e-12)
    assert rec.tpot_s == pytest.approx(step + transfer / 10, rel=1e-12)


def test_a_prompt_the_context_cannot_hold_is_rejected_and_an_output_stops_at_the_context_end() -> None:
    # max_model_len 1,024: the router answers a prompt of 1,024 tokens or more with 400 (context_length_exceeded);
    # vLLM's default max_tokens stops a 1,000-token prompt's output at 24 tokens
    cfg = SimConfig(max_model_len=1024)
    reqs = [Request(0.0, 1024, 50), Request(0.5, 1000, 100), Request(1.0, 200, 30)]
    sim = Simulation(reqs, make_profile(), SLO, pd(1, 1), cfg)
    sim.run_until(2.0)
    assert sim.observe(2.0).arrivals == 2  # the router's metrics see the admitted requests only
    rejected, capped, whole = sim.finish().records
    assert rejected.path == "rejected" and rejected.prefill_instance == -1
    assert math.isinf(rejected.ttft_s) and math.isinf(rejected.finish_s)
    assert capped.osl == 24 and math.isfinite(capped.finish_s)
    assert whole.osl == 30 and whole.path == "disaggregated"


def test_one_event_per_step_follows_the_growing_context_and_spans_stay_within_it() -> None:
    prof = make_profile()
    cfg = SimConfig(max_span_steps=1, kv_transfer_overhead_s=0.0)
    (rec,) = Simulation([Request(0.0, 500, 301)], prof, SLO, pd(1, 1), cfg).finish().records
    transfer = prof.kv_transfer_seconds(500, cfg.kv_link_gbps)
    exact = sum(prof.tpot(1, 501 + k, 1) for k in range(300))
    assert rec.finish_s - rec.ttft_s == pytest.approx(transfer + exact, rel=1e-9)
    cfg_span = SimConfig(kv_transfer_overhead_s=0.0)
    (span,) = Simulation([Request(0.0, 500, 301)], prof, SLO, pd(1, 1), cfg_span).finish().records
    # one span timed at its mean context: exact while the profile is linear in context
    assert span.tpot_s == pytest.approx(rec.tpot_s, rel=1e-9)


def test_a_burst_queues_at_prefill_and_more_prefill_instances_shorten_the_queue() -> None:
    prof = make_profile()
    burst = [Request(0.0, 1000, 5) for _ in range(20)]
    one_at_a_time = {"max_prefill_batch_tokens": 1000}
    one = Simulation(burst, prof, SLO, pd(1, 1, **one_at_a_time)).finish().records
    four = Simulation(burst, prof, SLO, pd(4, 1, **one_at_a_time)).finish().records
    t = prof.ttft(1000, 1)
    assert sorted(r.ttft_s for r in one) == pytest.approx([k * t for k in range(1, 21)], rel=1e-9)
    assert max(r.ttft_s for r in four) == pytest.approx(5 * t, rel=1e-9)
    assert sum(r.ttft_s for r in four) < sum(r.ttft_s for r in one) / 3


def test_kv_capacity_bounds_the_decode_batch_and_the_rest_wait_in_the_decode_queue() -> None:
    prof = make_profile(kv_tokens=5000)
    burst = [Request(0.0, 1000, 20) for _ in range(10)]
    sim = Simulation(burst, prof, SLO, pd(10, 1))
    sim.run_until(prof.ttft(1000, 1) + 0.05)  # all prefilled at once, transfers landed, one step run
    (dec,) = [s for s in sim.instances() if s.role == "decode"]
    assert (dec.running, dec.waiting) == (4, 6)  # 4 × 1001 tokens fit in 5000, a fifth does not
    assert dec.kv_tokens <= dec.kv_capacity_tokens
    assert sim.observe(1.0).decode_queue == 6
    records = sim.finish().records
    finishes = sorted({round(r.finish_s, 9) for r in records})
    assert len(finishes) == 3  # three waves: 4, 4, 2
    assert all(math.isfinite(r.finish_s) for r in records)


def test_growing_contexts_that_overflow_the_kv_cache_preempt_the_newest_request_which_recomputes_later() -> None:
    prof = make_profile(kv_tokens=5000)
    reqs = [Request(0.001 * i, 1000, 400) for i in range(4)]
    sim = Simulation(reqs, prof, SLO, pd(4, 1))
    peak = 0
    t = 0.0
    while t < 30.0:
        t += 0.05
        sim.run_until(t)
        for s in sim.instances():
            if s.role == "decode":
                assert s.kv_tokens <= s.kv_capacity_tokens
                peak = max(peak, s.running)
    records = sim.finish().records
    assert peak == 4
    assert all(math.isfinite(r.finish_s) for r in records)
    # the last admitted request was preempted (4 × 1001 + 4·250 > 5000) and finished well after the others
    by_finish = sorted(records, key=lambda r: r.finish_s)
    assert by_finish[-1].arrival_s == max(r.arrival_s for r in records)
    assert by_finish[-1].finish_s > by_finish[-2].finish_s + 100 * prof.tpot(1, 1000, 1)


def test_ultra_short_prompts_are_prefilled_locally_on_a_decode_instance_without_a_kv_transfer() -> None:
    prof = make_profile()
    cfg = SimConfig(kv_link_gbps=1e-4)  # a very slow link: a transfer would cost seconds
    reqs = [Request(0.0, 150, 11), Request(100.0, 500, 11)]
    local, remote = Simulation(reqs, prof, SLO, pd(1, 1, ultra_short_tokens=200), cfg).finish().records
    assert local.path == "local"
    assert local.ttft_s == pytest.approx(prof.ttft(150, 1), rel=1e-12)
    assert local.tpot_s == pytest.approx(sum(prof.tpot(1, 151 + k, 1) for k in range(10)) / 10, rel=1e-12)
    assert remote.path == "disaggregated"
    transfer = prof.kv_transfer_seconds(500, cfg.kv_link_gbps) + cfg.kv_transfer_overhead_s
    assert transfer > 1.0
    steps = sum(prof.tpot(1, 501 + k, 1) for k in range(10))
    assert remote.tpot_s == pytest.approx((steps + transfer) / 10, rel=1e-12)


def test_a_local_prefill_lengthens_the_step_of_the_requests_decoding_beside_it() -> None:
    prof = make_profile()
    cfg = SimConfig(max_span_steps=1, kv_transfer_overhead_s=0.0)
    alone = Simulation([Request(0.0, 500, 200)], prof, SLO, pd(1, 1, ultra_short_tokens=200), cfg).finish().records[0]
    mixed = Simulation(
        [Request(0.0, 500, 200), Request(1.0, 150, 2)], prof, SLO, pd(1, 1, ultra_short_tokens=200), cfg
    ).finish().records[0]
    assert mixed.tpot_s > alone.tpot_s


def test_length_aware_batching_groups_short_prompts_and_dispatches_long_ones_alone() -> None:
    # the router's DOPD Alg. 1 gate (fulcrum.routing.batcher via the policy's capabilities), per prefill instance
    prof = make_profile()
    routing = {"length_aware_batching": True, "long_request_tokens": 1000, "batch_timeout_s": 0.5}
    reqs = [Request(0.0, 100, 2), Request(0.01, 1500, 2), Request(0.02, 100, 2), Request(0.03, 100, 2)]
    short0, long_, short1, short2 = Simulation(reqs, prof, SLO, pd(1, 1, **routing)).finish().records
    # the instance was idle: Alg. 1's empty queue releases the first short prompt at once
    assert short0.ttft_s == pytest.approx(prof.ttft(100, 1), rel=1e-12)
    # the long prompt passed the gate at once, alone, and ran as soon as the instance was free
    assert long_.arrival_s + long_.ttft_s == pytest.approx(prof.ttft(100, 1) + prof.ttft(1500, 1), rel=1e-12)
    # the two short prompts behind it were grouped and went together when the oldest had waited 0.5 s
    together = 0.02 + 0.5 + prof.prefill_batch_time([100, 100], 1)
    for rec in (short1, short2):
        assert rec.arrival_s + rec.ttft_s == pytest.approx(together, rel=1e-12)
    # without grouping the first of them would have run right after the long prompt
    fcfs = Simulation(reqs, prof, SLO, pd(1, 1)).finish().records
    assert fcfs[2].arrival_s + fcfs[2].ttft_s < 0.5


def test_length_aware_batching_dispatches_a_group_as_soon_as_it_reaches_i_next() -> None:
    prof = make_profile()
    routing = {"length_aware_batching": True, "long_request_tokens": 1000, "batch_timeout_s": 10.0}
    reqs = [Request(0.0, 200, 2) for _ in range(10)]
    records = Simulation(reqs, prof, SLO, pd(1, 1, **routing)).finish().records
    first_tokens = sorted({round(r.arrival_s + r.ttft_s, 12) for r in records})
    # the first goes alone (idle instance); the next five reach i_next = 1000 tokens and go at once; the last
    # four (800 tokens) wait for the timeout
    alone = prof.ttft(200, 1)
    assert first_tokens == pytest.approx(
        [alone, alone + prof.prefill_batch_time([200] * 5, 1), 10.0 + prof.prefill_batch_time([200] * 4, 1)], rel=1e-9
    )


def test_a_unified_pool_serves_everything_with_chunked_prefill() -> None:
    prof = make_profile()
    target = ClusterTarget(unified=PoolSize(2, 1))
    reqs = [Request(0.0, 500, 11), Request(0.0, 5000, 3), Request(50.0, 100, 1)]
    a, b, c = Simulation(reqs, prof, SLO, target, policy=lambda _: LeastLoadedPolicy()).finish().records
    assert {a.path, b.path, c.path} == {"unified"}
    assert a.ttft_s == pytest.approx(prof.ttft(500, 1), rel=1e-12)
    assert a.tpot_s == pytest.approx(sum(prof.tpot(1, 501 + k, 1) for k in range(10)) / 10, rel=1e-12)
    # 5000 tokens in chunks of 2048, 2048, 904 cost the prefill of the whole prompt
    assert b.ttft_s == pytest.approx(prof.ttft(5000, 1), rel=1e-9)
    assert c.tpot_s == 0.0 and c.finish_s == pytest.approx(50.0 + prof.ttft(100, 1), rel=1e-12)


def _random_trace(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(20.0)
        out.append(Request(t, rng.randint(20, 3000), rng.randint(1, 300)))
    return out


def test_two_runs_of_the_same_inputs_give_identical_records() -> None:
    prof = make_profile(kv_tokens=40_000)
    reqs = _random_trace(7, 600)
    target = pd(2, 2, ultra_short_tokens=64, length_aware_batching=True, batch_timeout_s=0.05)
    cfg = SimConfig(pod_startup_s=5.0)

    def run() -> tuple[object, ...]:
        sim = Simulation(reqs, prof, SLO, target, cfg)
        sim.run_until(10.0)
        sim.apply(pd(3, 1, ultra_short_tokens=64))
        sim.run_until(20.0)
        sim.apply(ClusterTarget(unified=PoolSize(3, 1)))
        res = sim.finish()
        return (res.records, res.gpu_timeline, res.gpu_seconds, res.end_s)

    first, second = run(), run()
    assert first == second
    assert all(math.isfinite(r.finish_s) for r in first[0])  # type: ignore[attr-defined]


def test_pools_without_instances_end_at_the_grace_period_with_unserved_records() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 10), Request(5.0, 50, 10)]
    res = Simulation(reqs, prof, SLO, pd(0, 0, ultra_short_tokens=100), SimConfig(grace_s=60.0)).finish()
    assert res.end_s == 65.0
    assert res.gpu_seconds == 0.0
    assert all(math.isinf(r.ttft_s) and math.isinf(r.finish_s) and math.isinf(r.tpot_s) for r in res.records)
    s = res.summary(SLO)
    assert s["slo_attainment"] == 0.0 and s["goodput_tokens_per_s"] == 0.0 and s["ttft_p_s"] == math.inf


def test_without_decode_instances_requests_wait_at_the_router() -> None:
    # the policy finds no instance that may decode (NoInstanceError: the router's 503), so nothing starts
    prof = make_profile()
    sim = Simulation([Request(0.0, 500, 10)], prof, SLO, pd(1, 0), SimConfig(grace_s=30.0))
    sim.run_until(1.0)
    assert sim.observe(1.0).prefill_queue == 1
    res = sim.finish()
    (rec,) = res.records
    assert math.isinf(rec.ttft_s) and math.isinf(rec.finish_s) and math.isinf(rec.tpot_s)
    assert res.gpu_seconds == pytest.approx(30.0)


def test_summary_counts_goodput_of_requests_meeting_both_slos_over_the_trace_span() -> None:
    prof = make_profile()
    reqs = [Request(0.0, 500, 11), Request(10.0, 500, 31)]
    res = Simulation(reqs, prof, SLO, pd(1, 1)).finish()
    s = res.summary(SLO)
    assert s["requests"] == 2.0 and s["slo_attainment"] == 1.0
    assert s["goodput_tokens_per_s"] == pytest.approx(42 / 10.0)
    strict = SLOSpec(ttft_ms=1.0, tpot_ms=80, percentile=90)
    assert res.summary(strict)["slo_attainment"] == 0.0
    assert s["gpu_hours"] == pytest.approx(2 * res.end_s / 3600)


def test_a_tp_the_profile_does_not_measure_is_refused() -> None:
    from fulcrum.errors import ProfileError

    prof = make_profile()
    with pytest.raises(ProfileError):
        Simulation([Request(0.0, 10, 1)], prof, SLO, ClusterTarget(decode=PoolSize(1, 4)))


def test_on_the_azure_trace_spans_agree_with_one_event_per_step(shared_data: Path) -> None:
    from fulcrum.ratio.profiles import builtin_profile
    from fulcrum.traces import load_trace

    trace = load_trace(shared_data / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv", limit=3000)
    prof = builtin_profile("dopd-llama70b-fp8-h100")
    target = ClusterTarget(prefill=PoolSize(2, 1), decode=PoolSize(1, 2), routing=RoutingParams(ultra_short_tokens=128))
    fast = Simulation(trace.requests, prof, SLO, target).finish()
    exact = Simulation(trace.requests, prof, SLO, target, SimConfig(max_span_steps=1)).finish()
    assert fast.events * 1.5 < exact.events  # one event per step even on one decode instance costs more
    a, b = fast.summary(SLO), exact.summary(SLO)
    assert a["slo_attainment"] == pytest.approx(b["slo_attainment"], abs=0.005)
    assert a["tpot_p_s"] == pytest.approx(b["tpot_p_s"], rel=0.01)
    assert a["ttft_p_s"] == pytest.approx(b["ttft_p_s"], rel=0.02)
    assert {r.path for r in fast.records} == {"local", "disaggregated"}
