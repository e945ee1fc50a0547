"""``fulcrum replay --routing``: the simulator runs the router's own policies (fulcrum.routing), each of the five,
and Libra's split policy's micro-requests and BanaServe's load-aware dispatch really execute in it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from fulcrum.api.llmserve import LLMServeSpec, SLOSpec, load_llmserve
from fulcrum.ratio.profiles import builtin_profile
from fulcrum.replay.driver import ReplayOptions, run_policy
from fulcrum.replay.routing import ROUTING_POLICIES, parse_routing, path_counts, routing_factory
from fulcrum.routing.disaggregated import DisaggregatedPolicy
from fulcrum.routing.load_aware import LoadAwarePolicy
from fulcrum.routing.split import SplitPolicy
from fulcrum.simulator import SimConfig, Simulation
from fulcrum.target import ClusterTarget, PoolSize, RoutingParams
from fulcrum.traces import load_trace
from fulcrum.workload import Request

REPO = Path(__file__).resolve().parents[2]
DISAGG = REPO / "examples" / "llmserve-disaggregated-70b-h100.yaml"
UNIFIED = REPO / "examples" / "llmserve-unified-70b-a100.yaml"
AUTO = REPO / "examples" / "llmserve-auto.yaml"
_SLO = SLOSpec(ttft_ms=2000, tpot_ms=100, percentile=90)


@pytest.fixture(scope="module")
def window() -> tuple[Request, ...]:
    """The first 5 minutes of the bundled Azure conversation trace."""
    return load_trace("azure-conv-2023", duration_s=300.0).requests


def test_the_five_routing_policies_are_the_routers() -> None:
    assert set(ROUTING_POLICIES) == {"round_robin", "least_loaded", "disaggregated", "split", "load_aware"}
    assert parse_routing("split, load_aware,split") == ["split", "load_aware"]
    with pytest.raises(ValueError, match="unknown routing policy 'libra'"):
        parse_routing("disaggregated,libra")
    with pytest.raises(ValueError):
        parse_routing(" , ")


@pytest.mark.parametrize("spec_file", [DISAGG, UNIFIED], ids=["disaggregated-spec", "unified-spec"])
@pytest.mark.parametrize("routing", ROUTING_POLICIES)
def test_a_replay_runs_under_each_routing_policy(window: tuple[Request, ...], spec_file: Path, routing: str) -> None:
    spec = load_llmserve(spec_file).spec
    assert spec.profile.name is not None
    run = run_policy("static", window, spec, builtin_profile(spec.profile.name), ReplayOptions(routing=routing))
    assert len(run.records) == len(window)
    fits = [q for q in window if q.isl < spec.engine.max_model_len]  # longer prompts: rejected, as by the router
    served = [r for r in run.records if math.isfinite(r.finish_s)]
    assert len(served) == len(fits), routing  # every request that fits routed and finished
    paths = path_counts([r for r in run.records if r.path != "rejected"])
    if spec.mode.value == "Unified" and routing in ("round_robin", "least_loaded", "load_aware"):
        assert set(paths) == {"unified"}  # colocated on the unified instances
    if spec.mode.value == "Disaggregated" and routing == "disaggregated":
        assert set(paths) <= {"disaggregated", "local"}


def test_split_runs_libra_micro_requests_on_a_pool_of_kv_both_instances(window: tuple[Request, ...]) -> None:
    # Libra §4.1: A prefills and decodes k tokens, hands the KV off, B decodes the rest
    spec: LLMServeSpec = load_llmserve(UNIFIED).spec
    assert spec.profile.name is not None
    profile = builtin_profile(spec.profile.name)
    run = run_policy("static", window, spec, profile, ReplayOptions(routing="split"))
    split = [r for r in run.records if r.path == "split"]
    assert len(split) > len(window) // 2
    moved = [r for r in split if r.prefill_instance != r.decode_instance]
    assert moved and all(math.isfinite(r.finish_s) for r in split)  # finished on B after the handoff


def test_a_split_inside_the_prompt_runs_the_head_on_the_prefill_instance_and_the_rest_on_the_decode_instance() -> None:
    # Libra §4.1 between a P and a D instance, s < P: B loads the head's KV and prefills the tail
    profile = builtin_profile("splitwise-llama2-70b-h100")
    target = ClusterTarget(prefill=PoolSize(1, 2), decode=PoolSize(1, 2))
    # a backlog of long prompts on the P instance; the first ones finish and teach the length predictor
    reqs = [Request(0.01 * i, 8000, 2) for i in range(12)] + [Request(4.0, 4096, 8)]
    made: list[SplitPolicy] = []

    def split(_: RoutingParams) -> SplitPolicy:
        made.append(SplitPolicy(profile=profile))
        return made[-1]

    res = Simulation(reqs, profile, _SLO, target, SimConfig(partial_prefix=True), policy=split).finish()
    last = res.records[-1]
    assert last.path == "split" and math.isfinite(last.finish_s)
    assert (last.prefill_instance, last.decode_instance) == (0, 1)  # the head on P, the tail and decode on D
    assert made[0].reasons["balanced"] + made[0].reasons["bounded"] >= 1
    # without partial prefixes the same decision is the nearest safe split: pure disaggregation
    safe = Simulation(reqs, profile, _SLO, target, SimConfig(partial_prefix=False),
                      policy=lambda _: SplitPolicy(profile=profile)).finish()
    assert {r.path for r in safe.records} == {"disaggregated"}


def test_load_aware_spreads_by_utilisation_and_disaggregates_in_a_disaggregated_spec(window: tuple[Request, ...]) -> None:
    spec = load_llmserve(DISAGG).spec
    assert spec.profile.name is not None
    profile = builtin_profile(spec.profile.name)
    policy = routing_factory("load_aware", spec, profile)(RoutingParams())
    assert isinstance(policy, LoadAwarePolicy) and policy.disaggregate
    target = ClusterTarget(prefill=PoolSize(2, 1), decode=PoolSize(3, 2))
    res = Simulation(window[:600], profile, spec.slo, target, policy=routing_factory("load_aware", spec, profile)).finish()
    assert {r.path for r in res.records} == {"disaggregated"}
    assert {r.prefill_instance for r in res.records} == {0, 1}
    assert {r.decode_instance for r in res.records} == {2, 3, 4}


def test_load_aware_follows_an_auto_specs_pools(window: tuple[Request, ...]) -> None:
    """Auto mode: the operator leaves ``disaggregate`` unset, so the policy disaggregates on Disaggregated pools
    and colocates on a Unified pool; a fixed colocation sent every request to the decode pool (router.md)."""
    spec = load_llmserve(AUTO).spec
    assert spec.profile.name is not None
    profile = builtin_profile(spec.profile.name)
    factory = routing_factory("load_aware", spec, profile)
    assert factory(RoutingParams()).disaggregate is None  # type: ignore[attr-defined]
    disagg = Simulation(window[:300], profile, spec.slo, ClusterTarget(prefill=PoolSize(2, 2), decode=PoolSize(2, 2)),
                        policy=factory).finish()
    assert {r.path for r in disagg.records} == {"disaggregated"}
    assert {r.prefill_instance for r in disagg.records} == {0, 1}
    unified = Simulation(window[:300], profile, spec.slo, ClusterTarget(unified=PoolSize(3, 2)), policy=factory).finish()
    assert {r.path for r in unified.records} == {"unified"}


def test_the_simulator_stays_deterministic_under_every_policy(window: tuple[Request, ...]) -> None:
    spec = load_llmserve(DISAGG).spec
    assert spec.profile.name is not None
    profile = builtin_profile(spec.profile.name)
    target = ClusterTarget(prefill=PoolSize(2, 1), decode=PoolSize(2, 2),
                           routing=RoutingParams(ultra_short_tokens=64, length_aware_batching=True, batch_timeout_s=0.05))
    for name in ROUTING_POLICIES:
        runs = [Simulation(window[:400], profile, spec.slo, target, policy=routing_factory(name, spec, profile)).finish()
                for _ in range(2)]
        assert runs[0].records == runs[1].records, name


def test_the_simulator_changes_the_policy_only_when_the_routers_policy_config_changes(
        window: tuple[Request, ...]) -> None:
    # As RouterState.apply_config: a plan that moves only routing parameters the policy does not take (the split
    # policy takes none of RoutingParams) keeps the policy and its learned state; a changed parameter the policy
    # takes (the disaggregated policy's ultra-short threshold) is applied to the same policy, in place.
    for name, spec_file, changed, kept in (
        ("split", UNIFIED, None, RoutingParams(ultra_short_tokens=94, prefill_share=0.9)),
        ("disaggregated", DISAGG, RoutingParams(ultra_short_tokens=94), RoutingParams(prefill_share=0.9)),
    ):
        spec = load_llmserve(spec_file).spec
        assert spec.profile.name is not None
        profile = builtin_profile(spec.profile.name)
        factory = routing_factory(name, spec, profile)
        assert factory.config(RoutingParams()) == factory.config(kept)
        target = (ClusterTarget(unified=PoolSize(2, 4)) if name == "split"
                  else ClusterTarget(prefill=PoolSize(1, 1), decode=PoolSize(1, 2)))
        sim = Simulation(window[:50], profile, spec.slo, target, policy=factory)
        sim.run_until(30.0)
        first = sim._policy
        assert isinstance(first, SplitPolicy if name == "split" else DisaggregatedPolicy)
        sim.apply(dataclasses.replace(target, routing=kept))
        assert sim._policy is first, name
        if changed is not None:
            sim.apply(dataclasses.replace(target, routing=changed))
            assert sim._policy is first and sim._policy.ultra_short_tokens == 94
        sim.finish()
