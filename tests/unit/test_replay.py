"""The replay driver end to end: planners against the simulated cluster on real and synthetic traces.

``fulcrum.replay.driver.run_policy`` runs the operator's loop (observe → step → apply every interval) against
the simulator and scores the run; these tests check what it promises (determinism, one record per request,
warm-up, forecasts) and that Fulcrum's planner does its job on a step change of the load.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from fulcrum.api.llmserve import LLMServeSpec, ReplicaOwner, load_llmserve, parse_llmserve
from fulcrum.ratio.profile import PerformanceProfile
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.replay.driver import ReplayOptions, run_policy, scale_arrivals, warmup_seconds
from fulcrum.scaling.registry import PLANNERS, make_planner
from fulcrum.replay.result import PolicyRun
from fulcrum.traces import load_trace
from fulcrum.workload import Request

REPO = Path(__file__).resolve().parents[2]
DISAGG_SPEC = REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml"
WINDOW_S = 600.0  # a short window of the bundled trace: 10 ticks of 60 s, ~3,000 requests


@pytest.fixture(scope="module")
def spec() -> LLMServeSpec:
    """DOPD's setting (Llama-70B-FP8 on H100, TTFT 2 s / TPOT 80 ms at P90, TP_p = 1, TP_d = 2, start-up 180 s)."""
    return load_llmserve(DISAGG_SPEC).spec


@pytest.fixture(scope="module")
def profile(spec: LLMServeSpec) -> PerformanceProfile:
    assert spec.profile.name is not None
    return builtin_profile(spec.profile.name)


@pytest.fixture(scope="module")
def window() -> tuple[Request, ...]:
    """The first 10 minutes of the bundled Azure conversation trace."""
    return load_trace("azure-conv-2023", duration_s=WINDOW_S).requests


@pytest.fixture(scope="module")
def window_runs(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> dict[str, PolicyRun]:
    """Every planner of ``PLANNERS`` replayed once on ``window``."""
    return {name: run_policy(name, window, spec, profile) for name in PLANNERS}


def step_trace(seed: int = 7) -> list[Request]:
    """Poisson arrivals at 2 req/s for 10 minutes, then 8 req/s for 10 minutes; ISL 500–1500, OSL 50–250 tokens."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(2.0 if t < 600.0 else 8.0)
        if t >= 1200.0:
            return out
        out.append(Request(t, rng.randint(500, 1500), rng.randint(50, 250)))


# ---------------------------------------------------------------------------------------------- determinism
def test_two_replays_of_the_same_trace_give_identical_results(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...], window_runs: dict[str, PolicyRun]
) -> None:
    again = run_policy("fulcrum", window, spec, profile)
    first = window_runs["fulcrum"]
    assert again.summary == first.summary
    assert again.records == first.records
    assert again.timeline == first.timeline
    assert again.decisions == first.decisions
    assert math.isfinite(first.summary.slo_attainment)


# ---------------------------------------------------------------------------------------------- every policy
@pytest.mark.parametrize("name", list(PLANNERS))
def test_every_policy_replays_the_window_and_records_every_request(
    name: str,
    window: tuple[Request, ...],
    window_runs: dict[str, PolicyRun],
    spec: LLMServeSpec,
    profile: PerformanceProfile,
) -> None:
    run = window_runs[name]
    assert run.policy == name
    assert len(run.records) == len(window)
    assert [(r.arrival_s, r.isl, r.osl) for r in run.records] == [(q.arrival_s, q.isl, q.osl) for q in window]
    warm = warmup_seconds(spec, ReplayOptions())
    assert run.summary.requests == sum(1 for q in window if q.arrival_s >= warm)
    s = run.summary
    for value in (s.slo_attainment, s.goodput_tokens_per_s, s.gpu_hours, s.throughput_tokens_per_s):
        assert math.isfinite(value)
    assert 0.0 <= s.slo_attainment <= 1.0
    assert s.gpu_hours > 0
    # one timeline point per tick of the planner, up to the tick after the last arrival
    tick = make_planner(name, spec, profile).tick_s
    assert len(run.timeline) == math.ceil(window[-1].arrival_s / tick) + 1
    assert all(p.gpus >= 1 for p in run.timeline if p.time_s <= window[-1].arrival_s)


def test_forecasts_are_recorded_for_fulcrum_and_dopd_but_not_for_static(window_runs: dict[str, PolicyRun]) -> None:
    for name in ("fulcrum", "dopd"):
        points = window_runs[name].forecasts
        assert points, name
        assert {p.series for p in points} == {"rate", "isl", "osl"}
        assert all(p.made_at_s < p.time_s for p in points)
        rate = [p for p in points if p.series == "rate"]
        assert all(math.isfinite(p.mean) and p.lower <= p.mean <= p.upper for p in rate)
    assert window_runs["static"].forecasts == []


# ---------------------------------------------------------------------------------------------- load step
def test_fulcrum_scales_out_when_the_rate_quadruples_and_beats_static_on_slo_attainment(
    spec: LLMServeSpec, profile: PerformanceProfile
) -> None:
    trace = step_trace()
    fulcrum = run_policy("fulcrum", trace, spec, profile)
    static = run_policy("static", trace, spec, profile)

    def prefill(run: PolicyRun, lo: float, hi: float) -> list[int]:
        return [p.prefill for p in run.timeline if lo < p.time_s <= hi]

    # 2 req/s of ~1,000-token prompts keep one TP=1 prefill instance a third busy (t_p ≈ 0.17 s); 8 req/s need more
    before, after = prefill(fulcrum, 0.0, 600.0), prefill(fulcrum, 600.0, 1200.0)
    assert max(after) > max(before)
    assert max(after) >= 2
    first_out = next(p.time_s for p in fulcrum.timeline if p.time_s > 600.0 and p.prefill > max(before))
    assert first_out <= 600.0 + 2 * spec.scaling.interval_seconds  # it reacts within two ticks of the step
    assert {p.prefill for p in static.timeline} == {spec.scaling.initial_prefill}
    assert fulcrum.summary.slo_attainment > static.summary.slo_attainment + 0.2
    assert fulcrum.summary.requests == static.summary.requests


def test_a_steady_load_met_with_room_to_spare_spends_the_error_budget(
    spec: LLMServeSpec, profile: PerformanceProfile
) -> None:
    # the synthetic trace's steady half (5 req/s): two prefill instances meet every request, one meets ~96%;
    # once the attainment leaves the P90 budget unspent, Fulcrum plans at P80 / ρ ≤ 1.0 and holds fewer GPUs
    # than the static 2P+1D while still meeting the SLO percentile
    trace = load_trace("synthetic-burst-steady", start_s=1800.0).requests
    fulcrum = run_policy("fulcrum", trace, spec, profile)
    # the 2P+1D deployment as static-best runs it: the static policy on the spec's counts
    two_one = spec.model_copy(update={"scaling": spec.scaling.model_copy(update={"initial_prefill": 2,
                                                                                 "initial_decode": 1})})
    both = run_policy("static", trace, two_one, profile)
    assert both.summary.slo_attainment > 0.99
    assert spec.slo.percentile / 100.0 <= fulcrum.summary.slo_attainment < both.summary.slo_attainment
    assert fulcrum.summary.gpu_hours < both.summary.gpu_hours
    assert any("error budget: planned at P80" in d["reason"] and d["prefill"] == 1 for d in fulcrum.decisions)


def second_burst_attainment(spec: LLMServeSpec, seed: int | None = None) -> float:
    """Fulcrum's SLO attainment over the second burst (600–780 s) of ``synthetic-burst-steady`` at ``seed``: the
    trace bursts every 8 minutes, from 120 s; asserts the burst holds over a thousand requests."""
    assert spec.profile.name is not None
    trace = load_trace("synthetic-burst-steady", duration_s=900.0, seed=seed).requests
    run = run_policy("fulcrum", trace, spec, builtin_profile(spec.profile.name))
    second = [r for r in run.records if 600.0 <= r.arrival_s < 780.0]
    assert len(second) > 1000
    return sum(r.ttft_s * 1e3 <= spec.slo.ttft_ms and r.tpot_s * 1e3 <= spec.slo.tpot_ms for r in second) / len(second)


@pytest.mark.xfail(strict=True, reason=(
    "known defect (docs/replay-log.md, thirteenth session): after one burst met in full, the headroom level falls to "
    "the median within eight intervals and the 300-s scale-in window is shorter than the 5-minute lull, so the "
    "planner drops a prefill instance at 600 s, just before the second burst"))
def test_a_periodic_burst_met_in_full_does_not_license_a_scale_in_before_the_next_one() -> None:
    # the Auto example started at 2P+2D (not its 1P+1D): the first burst (120–300 s) is met in full, which is what
    # lets the level fall
    auto = load_llmserve(REPO / "examples" / "llmserve-auto.yaml").spec
    auto = auto.model_copy(update={"scaling": auto.scaling.model_copy(update={"initial_prefill": 2,
                                                                              "initial_decode": 2})})
    assert second_burst_attainment(auto) >= auto.slo.percentile / 100.0


@pytest.mark.xfail(strict=True, reason=(
    "known defect (docs/replay-log.md, fifteenth session): in the lull after the first burst the max_headroom cap "
    "(2 × the highest rate of the last three intervals) cuts the P90 plan of about 7.5 req/s to 2.93, and the "
    "unified pool goes 8 → 5 at 600 s, as the second burst begins"))
def test_the_headroom_cap_does_not_drop_a_burst_seen_in_the_lull_before_the_next_one() -> None:
    spec = load_llmserve(REPO / "examples" / "llmserve-unified-70b-a100.yaml").spec
    assert second_burst_attainment(spec, seed=4) >= spec.slo.percentile / 100.0


# ---------------------------------------------------------------------------------------------- warm-up
def test_the_warmup_leaves_early_requests_out_of_scoring_but_not_out_of_the_records(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    scored_all = run_policy("static", window, spec, profile, ReplayOptions(warmup_s=0.0))
    late = run_policy("static", window, spec, profile, ReplayOptions(warmup_s=300.0))
    assert scored_all.summary.requests == len(window)
    assert late.summary.requests == sum(1 for q in window if q.arrival_s >= 300.0) < len(window)
    assert late.records == scored_all.records  # the warm-up changes the scoring, not the simulation
    assert late.summary.gpu_hours < scored_all.summary.gpu_hours


def test_the_default_warmup_is_pod_startup_plus_two_intervals(spec: LLMServeSpec) -> None:
    sc = spec.scaling
    assert warmup_seconds(spec, ReplayOptions()) == sc.pod_startup_seconds + 2 * sc.interval_seconds
    assert warmup_seconds(spec, ReplayOptions(warmup_s=42.0)) == 42.0
    assert warmup_seconds(spec, ReplayOptions(warmup_s=-5.0)) == 0.0  # documented: negative scores everything


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_warmup_that_is_not_finite_is_a_value_error(spec: LLMServeSpec, bad: float) -> None:
    # max(nan, 0.0) is nan: every score would read nan, so the library refuses it rather than clamping
    with pytest.raises(ValueError, match="warmup_s must be a finite number of seconds"):
        warmup_seconds(spec, ReplayOptions(warmup_s=bad))


# ---------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_scale_arrivals_rejects_a_time_scale_that_is_not_finite_and_positive(scale: float) -> None:
    with pytest.raises(ValueError, match="time scale"):
        scale_arrivals([Request(1.0, 10, 10)], scale)


def test_scale_arrivals_multiplies_arrival_times_and_keeps_lengths() -> None:
    reqs = [Request(0.0, 10, 5), Request(2.0, 20, 6), Request(4.0, 30, 7)]
    half = scale_arrivals(reqs, 0.5)
    assert [r.arrival_s for r in half] == [0.0, 1.0, 2.0]
    assert [(r.isl, r.osl) for r in half] == [(10, 5), (20, 6), (30, 7)]
    assert scale_arrivals(reqs, 1.0) == reqs


def test_run_policy_rejects_an_empty_trace_and_an_unknown_policy(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    with pytest.raises(ValueError, match="no requests"):
        run_policy("fulcrum", [], spec, profile)
    with pytest.raises(ValueError, match="unknown planner 'nope'"):
        run_policy("nope", window, spec, profile)


# ---------------------------------------------------------------------------------------------- unified mode
@pytest.mark.parametrize("name", ["fulcrum", "static"])
def test_a_unified_mode_spec_replays_with_unified_instances_only(name: str, window: tuple[Request, ...]) -> None:
    spec = parse_llmserve(
        {
            "spec": {
                "model": {"name": "meta-llama/Llama-2-70b-chat-hf"},
                "engine": {"maxModelLen": 4096},
                "slo": {"ttftMs": 2000, "tpotMs": 100, "percentile": 90},
                "mode": "Unified",
                "scaling": {"maxGPUs": 64, "initialUnified": 2},
                "profile": {"name": "splitwise-llama2-70b-h100"},
            }
        }
    ).spec
    run = run_policy(name, window, spec, builtin_profile("splitwise-llama2-70b-h100"))
    assert all(p.prefill == 0 and p.decode == 0 and p.unified >= 1 for p in run.timeline)
    # the spec's default router policy (disaggregated) runs as the router runs it: over kv_both instances it
    # prefills on one and decodes on another, or colocates (single instance, ultra-short prompts)
    assert {r.path for r in run.records} <= {"unified", "disaggregated", "rejected"}
    # prompts of the model's context (4,096 tokens) or more are rejected as the router rejects them, never served
    assert {r.arrival_s for r in run.records if r.path == "rejected"} == {q.arrival_s for q in window if q.isl >= 4096}
    assert all(r.prefill_instance >= 0 for r in run.records if r.path != "rejected")
    assert len(run.records) == len(window)
    if name == "fulcrum":  # the planner resizes the unified pool with the load
        assert len({p.unified for p in run.timeline}) > 1


def test_static_best_is_the_cheapest_static_deployment_reaching_the_target(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    from fulcrum.replay.static_best import static_best

    best = static_best(window, spec, profile, 0.95, ReplayOptions(warmup_s=0.0))
    assert best.reached and best.run.summary.slo_attainment >= 0.95 and best.run.policy == "static-best"
    assert best.gpus <= spec.scaling.max_gpus
    # every probe cheaper than the answer missed the target, and the answer is among the probes
    assert (best.label, best.gpus, best.run.summary.slo_attainment) in best.probes
    assert all(att < 0.95 for _, gpus, att in best.probes if gpus < best.gpus)
    p, d = (int(x[:-1]) for x in best.label.split("+"))
    assert any(label == f"{p - 1}P+{d}D" for label, _, _ in best.probes) or p == 1
    # unreachable target: the highest attainment found, flagged as not reached
    worst = static_best(window, spec, profile, 1.01, ReplayOptions(warmup_s=0.0))
    assert not worst.reached and worst.run.summary.slo_attainment == max(a for _, _, a in worst.probes)


def test_a_replay_of_an_externally_owned_spec_keeps_the_external_total_like_the_operator(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    external = spec.model_copy(update={"scaling": spec.scaling.model_copy(update={
        "replica_owner": ReplicaOwner.EXTERNAL, "replicas": 4})})
    run = run_policy("fulcrum", window, external, profile)
    assert run.timeline and all(p.prefill + p.decode == 4 and p.prefill >= 1 and p.decode >= 1 for p in run.timeline)
    assert all("external replica owner: 4 instances" in d["reason"] for d in run.decisions)


def test_an_externally_owned_total_over_max_gpus_starts_cut_to_the_budget_like_the_operator(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    # 8 instances split 4P+4D at TP 1/2 would be 12 GPUs; maxGPUs 8 holds 4P+2D (initial_target does the same)
    external = spec.model_copy(update={"scaling": spec.scaling.model_copy(update={
        "replica_owner": ReplicaOwner.EXTERNAL, "replicas": 8, "max_gpus": 8, "min_gpus": 1})})
    assert (external.scaling.tp_prefill, external.scaling.tp_decode) == (1, 2)
    run = run_policy("static", window, external, profile)
    assert run.timeline and (run.timeline[0].prefill, run.timeline[0].decode) == (4, 2)
    assert all(p.gpus <= 8 and p.ready_gpus <= 8 for p in run.timeline)  # ready 12 at 60 s when the start was uncut


# ---------------------------------------------------------------------------------------------- planner failures
class _FailingAfter:
    """Fake planner for this test: Fulcrum's own, except that every step from ``at_s`` on raises PlanningError."""

    def __init__(self, inner: object, at_s: float) -> None:
        self._inner, self._at_s = inner, at_s
        self.name = "fulcrum"

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def step(self, obs: object, current: object) -> object:
        from fulcrum.errors import PlanningError

        if obs.time_s >= self._at_s:  # type: ignore[attr-defined]
            raise PlanningError("no KV memory for one request (the fake's failure)")
        return self._inner.step(obs, current)  # type: ignore[attr-defined]


def test_a_planner_failure_in_a_replay_holds_the_pools_and_is_reported_not_silent(
    spec: LLMServeSpec, profile: PerformanceProfile, window: tuple[Request, ...]
) -> None:
    from fulcrum.replay.driver import run_planner
    from fulcrum.replay.table import infeasible_lines, summary_json

    run = run_planner(_FailingAfter(make_planner("fulcrum", spec, profile), 300.0), window, spec, profile,  # type: ignore[arg-type]
                      ReplayOptions(progress=False))
    assert run.held and run.held[0][0] == 300.0
    assert all(t >= 300.0 and msg.startswith("planning failed: no KV memory") for t, msg in run.held)
    assert len(run.held) == sum(1 for p in run.timeline if p.time_s >= 300.0) and run.ticks == len(run.timeline)
    held_from = [(p.prefill, p.decode, p.unified) for p in run.timeline if p.time_s >= 300.0]
    assert len(set(held_from)) == 1  # the pools in force at the failure, kept to the end
    [line] = infeasible_lines([run])
    assert line.startswith(f"warning: fulcrum: the pools were held in {len(run.held)} of {run.ticks} intervals, "
                           "first at t = 300 s: planning failed: no KV memory")
    held = summary_json([run], trace_name="t", slo=spec.slo)["policies"]["fulcrum"]["held"]
    assert held == {"intervals": len(run.held), "total_intervals": run.ticks, "first_time_s": 300.0,
                    "first_reason": run.held[0][1]}
    ok = run_policy("fulcrum", window, spec, profile, ReplayOptions(progress=False))
    assert ok.held == () and infeasible_lines([ok]) == []
