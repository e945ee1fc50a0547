"""Round-robin and least-loaded baselines, the shared role rules, and the policy registry."""

from __future__ import annotations

import pytest

from fulcrum.routing.base import InstanceView, NoInstanceError, Policy, RequestInfo
from fulcrum.routing.least_loaded import LeastLoadedPolicy, instance_load
from fulcrum.routing.registry import POLICIES, make_policy, policy_parameters
from fulcrum.routing.round_robin import RoundRobinPolicy, TieBreaker

REQ = RequestInfo("r", prompt_tokens=100, max_tokens=64, predicted_output_tokens=50)


def test_round_robin_cycles_through_instances_that_may_run_a_whole_request():
    insts = [InstanceView("p", role="prefill"), InstanceView("a"), InstanceView("d", role="decode"), InstanceView("x", draining=True)]
    pol = RoundRobinPolicy()
    firsts = [pol.route(REQ, insts, 0.0).first for _ in range(6)]
    assert firsts == ["a", "d", "a", "d", "a", "d"]


def test_round_robin_decisions_are_colocated_with_the_contracts_split_token():
    d = RoundRobinPolicy().route(REQ, [InstanceView("a")], 0.0)
    assert d.kind == "colocated" and d.second is None and d.split_token == 100 + 64 and d.phi is None


def test_baselines_raise_no_instance_when_nothing_can_take_a_whole_request():
    only_prefill = [InstanceView("p", role="prefill"), InstanceView("u", healthy=False)]
    for pol in (RoundRobinPolicy(), LeastLoadedPolicy()):
        with pytest.raises(NoInstanceError):
            pol.route(REQ, only_prefill, 0.0)


def test_least_loaded_picks_fewest_in_flight_requests():
    insts = [InstanceView("a", inflight=5), InstanceView("b", inflight=2), InstanceView("c", inflight=3)]
    assert LeastLoadedPolicy().route(REQ, insts, 0.0).first == "b"


def test_least_loaded_counts_queued_prompt_work_in_engine_passes():
    # equal in-flight counts: the instance with two full passes of queued prompt tokens loses to the one with none
    insts = [
        InstanceView("busy", inflight=2, queued_prefill_tokens=16384, max_num_batched_tokens=8192),
        InstanceView("idle", inflight=2, queued_prefill_tokens=0),
        InstanceView("more", inflight=3),
    ]
    assert instance_load(insts[0]) == pytest.approx(4.0)
    assert LeastLoadedPolicy().route(REQ, insts, 0.0).first == "idle"
    # ...but three queued passes weigh more than one extra request
    insts2 = [InstanceView("busy", inflight=2, queued_prefill_tokens=3 * 8192), InstanceView("more", inflight=3)]
    assert LeastLoadedPolicy().route(REQ, insts2, 0.0).first == "more"


def test_least_loaded_breaks_ties_round_robin():
    insts = [InstanceView("a", inflight=1), InstanceView("b", inflight=1), InstanceView("c", inflight=4)]
    pol = LeastLoadedPolicy()
    assert [pol.route(REQ, insts, 0.0).first for _ in range(4)] == ["a", "b", "a", "b"]


def test_tie_breaker_rotates_among_equal_minima_and_never_picks_a_larger_key():
    tb = TieBreaker()
    items = [InstanceView("a", inflight=1), InstanceView("b", inflight=1), InstanceView("c", inflight=1), InstanceView("z", inflight=9)]
    picks = [tb.pick(items, lambda i: i.inflight).id for _ in range(8)]
    assert set(picks) == {"a", "b", "c"}
    assert "z" not in picks


def test_every_policy_satisfies_the_protocol_and_ignores_notifications_safely():
    for name in POLICIES:
        pol = make_policy(name, {})
        assert isinstance(pol, Policy) and pol.name == name
        d = pol.route(REQ, [InstanceView("a"), InstanceView("b")], 0.0)
        pol.on_start(REQ, d, 0.0)
        pol.on_finish(REQ.request_id, 1.0)
        pol.on_finish("never-started", 1.0)


def test_registry_passes_parameters_to_the_constructor():
    pol = make_policy("disaggregated", {"ultra_short_tokens": 128, "miss_weight": 0.5})
    assert pol.ultra_short_tokens == 128 and pol.miss_weight == 0.5  # type: ignore[attr-defined]
    assert policy_parameters("split")["max_probes"] == 6


def test_registry_names_an_unknown_policy_and_an_unknown_parameter():
    with pytest.raises(ValueError, match="'nope'.*round_robin"):
        make_policy("nope", {})
    with pytest.raises(ValueError, match="'max_probe'.*split.*max_probes"):
        make_policy("split", {"max_probe": 3})
    with pytest.raises(ValueError, match="'x'.*round_robin.*none"):
        make_policy("round_robin", {"x": 1})


def test_registry_surfaces_invalid_values_as_value_errors():
    with pytest.raises(ValueError):
        make_policy("split", {"max_probes": 0})
    with pytest.raises(ValueError):
        make_policy("disaggregated", {"ultra_short_tokens": -1})


@pytest.mark.parametrize("name,params,param", [
    ("load_aware", {"load_threshold": "x"}, "load_threshold"),
    ("disaggregated", {"kv_block_tokens": "16"}, "kv_block_tokens"),
    ("disaggregated", {"miss_weight": 0.5, "ultra_short_tokens": None}, "ultra_short_tokens"),
    ("split", {"max_probes": "a"}, "max_probes"),
    ("split", {"epsilon_s": 0.01, "max_probes": 0}, "max_probes"),
])
def test_registry_names_the_policy_and_the_parameter_of_a_wrongly_typed_or_refused_value(name, params, param):
    with pytest.raises(ValueError) as info:
        make_policy(name, params)
    assert str(info.value).startswith(f"routing policy {name!r}: parameter {param!r} = {params[param]!r} is invalid: ")
    assert isinstance(info.value.__cause__, (TypeError, ValueError))


def test_a_rebuild_with_a_wrongly_typed_parameter_is_a_value_error_and_keeps_nothing_half_changed():
    from fulcrum.routing.disaggregated import DisaggregatedPolicy
    from fulcrum.routing.registry import reconfigured

    policy = DisaggregatedPolicy(ultra_short_tokens=64)
    with pytest.raises(ValueError, match="'disaggregated': parameter 'kv_block_tokens' = '16' is invalid"):
        reconfigured(policy, "disaggregated", {"kv_block_tokens": "16"})
    assert policy.ultra_short_tokens == 64 and policy.kv_block_tokens == 16
