"""BanaServe Alg. 2: least compute+memory utilisation, lowest queue once even the least loaded is past δ_L."""

from __future__ import annotations

import math

import pytest

from fulcrum.router.policies.base import InstanceView, NoInstanceError, RequestInfo
from fulcrum.router.policies.load_aware import LoadAwarePolicy, utilisation

REQ = RequestInfo("r", prompt_tokens=1000, max_tokens=256, predicted_output_tokens=200)


def test_utilisation_is_compute_plus_memory_from_the_metrics():
    assert utilisation(InstanceView("a", compute_utilisation=0.3, memory_utilisation=0.5)) == pytest.approx(0.8)
    assert utilisation(InstanceView("a", compute_utilisation=1.7, memory_utilisation=-0.2)) == pytest.approx(1.0)


def test_utilisation_falls_back_to_the_routers_accounting_when_metrics_are_missing():
    inst = InstanceView("a", inflight=64, max_num_seqs=256, running_tokens=50_000, kv_capacity_tokens=100_000)
    assert utilisation(inst) == pytest.approx(0.25 + 0.5)
    no_cap = InstanceView("b", inflight=128, max_num_seqs=256, memory_utilisation=math.nan)
    assert utilisation(no_cap) == pytest.approx(0.5 + 0.5)
    mixed = InstanceView("c", inflight=128, max_num_seqs=256, compute_utilisation=0.9)
    assert utilisation(mixed) == pytest.approx(0.9 + 0.5)


def test_least_utilised_instance_wins_below_the_threshold():
    insts = [
        InstanceView("hot", compute_utilisation=0.9, memory_utilisation=0.7),
        InstanceView("cool", compute_utilisation=0.2, memory_utilisation=0.6, queued_prefill_tokens=9000),
        InstanceView("warm", compute_utilisation=0.5, memory_utilisation=0.5),
    ]
    d = LoadAwarePolicy().route(REQ, insts, 0.0)
    assert d.kind == "colocated" and d.first == "cool" and d.reason.startswith("least-loaded")


def test_shortest_queue_wins_once_every_instance_is_past_the_threshold():
    insts = [
        InstanceView("a", compute_utilisation=0.85, memory_utilisation=0.80, queued_prefill_tokens=6000),
        InstanceView("b", compute_utilisation=0.95, memory_utilisation=0.95, queued_prefill_tokens=100),
        InstanceView("c", compute_utilisation=0.90, memory_utilisation=0.90, queued_prefill_tokens=3000),
    ]
    d = LoadAwarePolicy(load_threshold=1.6).route(REQ, insts, 0.0)
    assert d.first == "b" and d.reason.startswith("lowest-queue")
    # with a higher threshold the least utilised one is still taken
    assert LoadAwarePolicy(load_threshold=1.7).route(REQ, insts, 0.0).first == "a"


def test_dispatched_requests_raise_the_estimated_load_until_the_metrics_catch_up():
    insts = [
        InstanceView("a", compute_utilisation=0.10, memory_utilisation=0.10, max_num_seqs=4, kv_capacity_tokens=10_000),
        InstanceView("b", compute_utilisation=0.20, memory_utilisation=0.10, max_num_seqs=4, kv_capacity_tokens=10_000),
    ]
    pol = LoadAwarePolicy(estimate_ttl_s=5.0)
    # each request adds 1/4 compute + 1200/10000 memory = 0.37 to its instance (Alg. 2 line 15)
    assert pol.route(REQ, insts, 0.0).first == "a"
    assert pol.load(insts[0], 0.0) == pytest.approx(0.2 + 0.37)
    assert pol.route(REQ, insts, 0.1).first == "b"  # stale metrics alone would send it to "a" again
    assert pol.route(REQ, insts, 0.2).first == "a"
    # after the TTL the estimates are gone and the (unchanged) metrics decide again
    assert pol.load(insts[0], 6.0) == pytest.approx(0.2)


def test_ties_go_to_the_shorter_queue_then_round_robin():
    insts = [InstanceView("a", queued_prefill_tokens=10), InstanceView("b"), InstanceView("c")]
    pol = LoadAwarePolicy(estimate_ttl_s=0.0)
    assert [pol.route(REQ, insts, float(t)).first for t in range(4)] == ["b", "c", "b", "c"]


def test_disaggregate_mode_picks_prefill_and_decode_instances_by_the_same_rule():
    insts = [
        InstanceView("p1", role="prefill", compute_utilisation=0.8, memory_utilisation=0.1),
        InstanceView("p2", role="prefill", compute_utilisation=0.3, memory_utilisation=0.1),
        InstanceView("d1", role="decode", compute_utilisation=0.3, memory_utilisation=0.9),
        InstanceView("d2", role="decode", compute_utilisation=0.4, memory_utilisation=0.4),
    ]
    d = LoadAwarePolicy(disaggregate=True).route(REQ, insts, 0.0)
    assert (d.kind, d.first, d.second, d.split_token) == ("disaggregated", "p2", "d2", 1000)


def test_load_aware_never_routes_to_unavailable_or_prefill_only_instances_when_colocating():
    insts = [InstanceView("p", role="prefill"), InstanceView("sick", healthy=False), InstanceView("ok", compute_utilisation=0.99, memory_utilisation=0.99)]
    assert LoadAwarePolicy().route(REQ, insts, 0.0).first == "ok"
    with pytest.raises(NoInstanceError):
        LoadAwarePolicy().route(REQ, insts[:2], 0.0)
