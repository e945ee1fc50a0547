"""BanaServe Alg. 2: least compute+memory utilisation, lowest queue once even the least loaded is past δ_L."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fulcrum.routing.base import InstanceView, NoInstanceError, RequestInfo, RouteDecision
from fulcrum.routing.load_aware import LoadAwarePolicy, utilisation
from fulcrum.routing.prefix import PrefixIndex, prompt_block_hashes, pull_costs

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
    d = LoadAwarePolicy(disaggregate=False).route(REQ, insts, 0.0)
    assert (d.kind, d.first) == ("colocated", "ok")
    with pytest.raises(NoInstanceError):
        LoadAwarePolicy(disaggregate=False).route(REQ, insts[:2], 0.0)


def test_by_default_it_disaggregates_exactly_while_a_prefill_instance_is_available():
    """An Auto LLMServe's pools move between the modes, and a Unified pool under role reassignment shows its
    prefill-duty instances as "prefill": the default follows the roles on offer (module doc)."""
    pol = LoadAwarePolicy(estimate_ttl_s=0.0)
    assert pol.disaggregate is None
    disagg = [InstanceView("p1", role="prefill"), InstanceView("d1", role="decode"), InstanceView("d2", role="decode")]
    d = pol.route(REQ, disagg, 0.0)
    assert (d.kind, d.first) == ("disaggregated", "p1") and d.second in {"d1", "d2"}
    # a unified pool with no prefill duty, or whose prefill instance drains (an Auto cut-over): colocated
    both = [InstanceView("u1", role="both"), InstanceView("u2", role="both", compute_utilisation=0.5)]
    assert pol.route(REQ, both, 0.0).kind == "colocated"
    draining = [dataclasses.replace(disagg[0], draining=True), *disagg[1:]]
    d = pol.route(REQ, draining, 0.0)
    assert d.kind == "colocated" and d.first in {"d1", "d2"}
    # role reassignment: a prefill-duty "both" instance takes the prefill leg, a decode-duty one the decode leg
    duties = [InstanceView("u1", role="prefill"), InstanceView("u2", role="decode")]
    d = pol.route(REQ, duties, 0.0)
    assert (d.kind, d.first, d.second) == ("disaggregated", "u1", "u2")


# ------------------------------------------------------------------ BanaServe §4.2: prefix pulls over the KV connector
def test_block_hashes_are_chained_so_equal_hashes_mean_equal_prefixes():
    a = prompt_block_hashes(list(range(40)), 16)
    b = prompt_block_hashes(list(range(32)) + [99] * 8, 16)
    c = prompt_block_hashes([0] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b == c  # the 8-token tail is not a full block
    d = prompt_block_hashes([7] + list(range(1, 40)), 16)
    assert d[0] != a[0] and d[1] != a[1]  # a change in block 0 changes every later hash
    with pytest.raises(ValueError):
        prompt_block_hashes([1], 0)


def test_the_prefix_index_forgets_the_least_recently_used_blocks_first():
    idx = PrefixIndex(max_blocks=3)
    idx.record("a", (1, 2, 3))
    idx.record("a", (1,))  # refreshes 1
    idx.record("a", (4,))  # evicts 2
    assert idx.leading("a", (1, 2, 3)) == 1 and idx.leading("a", (4,)) == 1
    idx.record("b", (1, 2))
    assert idx.best_holder((1, 2, 3), ["a", "b"]) == ("b", 2)


def test_a_pull_pays_on_a_fast_link_and_not_on_a_slow_one():
    pull, recompute = pull_costs(4096, 131_072, 25.0, 0.005, 10_000)
    assert pull == pytest.approx(4096 * 131_072 / 25e9 + 0.005) and recompute == pytest.approx(0.4096)
    assert pull < recompute
    slow_pull, _ = pull_costs(4096, 131_072, 0.1, 0.005, 10_000)
    assert slow_pull > recompute


def prefix_request(rid: str, ids: list[int]) -> RequestInfo:
    return RequestInfo(rid, len(ids), 64, 32, prefix_hashes=prompt_block_hashes(ids, 16))


def test_a_cached_prefix_does_not_pin_the_request_and_a_pull_from_its_holder_is_planned():
    pol = LoadAwarePolicy(prefix_pull=True, min_pull_tokens=32, estimate_ttl_s=0.0)
    shared = list(range(100, 164))  # 4 blocks
    first = prefix_request("r1", shared + [1, 2, 3])
    d1 = pol.route(first, [InstanceView("a"), InstanceView("b", inflight=50)], 0.0)
    pol.on_start(first, d1, 0.0)
    assert d1.first == "a" and pol.take_prefix_pull("r1") is None  # nobody held anything yet
    second = prefix_request("r2", shared + [4, 5, 6, 7])
    d2 = pol.route(second, [InstanceView("a", inflight=50), InstanceView("b")], 1.0)
    assert d2.first == "b"  # by load only: the holder "a" is busier
    plan = pol.take_prefix_pull("r2")
    assert plan is not None and (plan.holder, plan.target, plan.tokens, plan.local_tokens) == ("a", "b", 64, 0)
    assert pol.take_prefix_pull("r2") is None  # handed over once


def test_no_pull_is_planned_when_the_chosen_instance_holds_the_prefix_or_it_is_short():
    pol = LoadAwarePolicy(prefix_pull=True, min_pull_tokens=32, estimate_ttl_s=0.0)
    shared = list(range(100, 164))
    r = prefix_request("r1", shared + [1])
    pol.on_start(r, RouteDecision("colocated", "a"), 0.0)
    pol.on_start(r, RouteDecision("colocated", "b"), 0.0)
    pol.route(prefix_request("r2", shared + [2]), [InstanceView("a", inflight=9), InstanceView("b")], 0.0)
    assert pol.take_prefix_pull("r2") is None  # b holds it too
    short = LoadAwarePolicy(prefix_pull=True, min_pull_tokens=128, estimate_ttl_s=0.0)
    short.on_start(r, RouteDecision("colocated", "a"), 0.0)
    short.route(prefix_request("r3", shared + [3]), [InstanceView("a", inflight=9), InstanceView("b")], 0.0)
    assert short.take_prefix_pull("r3") is None  # 64 tokens < min_pull_tokens
    off = LoadAwarePolicy(estimate_ttl_s=0.0)
    off.on_start(r, RouteDecision("colocated", "a"), 0.0)
    off.route(prefix_request("r4", shared + [4]), [InstanceView("a", inflight=9), InstanceView("b")], 0.0)
    assert off.take_prefix_pull("r4") is None


# ------------------------------------------------------------------ the router executing pulls, FAKE engines
def greedy(ids: list[int], n: int) -> str:
    from fakes.fake_engine import fake_next_token

    seq = list(ids)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return bytes(seq[len(ids):]).decode()


async def _two_requests(h, shared: str) -> tuple[dict, dict]:
    """A long stream with ``shared`` + one suffix keeps e0 busy; then ``shared`` + another suffix is asked."""
    import asyncio

    stream = asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": shared + " first", "max_tokens": 60, "stream": True, "ignore_eos": True}))
    while not h.engine("e0").active:
        await asyncio.sleep(0.005)
    r = await h.client.post("/v1/completions", json={"prompt": shared + " second", "max_tokens": 12, "ignore_eos": True})
    assert r.status == 200
    second = await r.json()
    await (await stream).read()
    return second, h.state.metrics


def pulls(h, outcome: str) -> float:
    return h.state.metrics.registry.get_sample_value("fulcrum_router_prefix_pulls_total", {"outcome": outcome}) or 0.0


SHARED = "system: you are a careful assistant who answers in full sentences. " * 3
POLICY = {"name": "load_aware", "params": {"prefix_pull": True, "min_pull_tokens": 32, "kv_block_tokens": 16}}


@pytest.mark.asyncio
async def test_the_router_pulls_a_cached_prefix_from_its_holder_where_the_engines_take_partial_prefixes(router_harness):
    from fakes.fake_engine import FakeEngineSettings, fake_encode
    from fulcrum.routing.registry import make_policy

    h = await router_harness(n=2, settings=FakeEngineSettings(token_delay_s=0.01, bidirectional_kv_xfer=True),
                             policy=make_policy("load_aware", POLICY["params"]),
                             config={"policy": POLICY, "kv_connector": {"partial_prefix": True}})
    second, _ = await _two_requests(h, SHARED)
    ids = fake_encode(SHARED + " second")
    assert second["choices"][0]["text"] == greedy(ids, 12) and "kv_transfer_params" not in second
    assert second["usage"]["prompt_tokens"] == len(ids)
    e0, e1 = h.engines
    prefix_legs = [b for b in e0.requests if b.get("max_tokens") == 1]
    assert len(prefix_legs) == 1 and prefix_legs[0]["prompt"] == ids[: len(prefix_legs[0]["prompt"])]
    assert len(prefix_legs[0]["prompt"]) % 16 == 0 and len(prefix_legs[0]["prompt"]) >= len(fake_encode(SHARED)) - 16
    assert e1.partial_loads == 1 and e1.kv_mismatches == 0
    assert pulls(h, "pulled") == 1


@pytest.mark.asyncio
async def test_without_partial_prefix_support_the_router_recomputes_and_counts_why(router_harness):
    from fakes.fake_engine import FakeEngineSettings, fake_encode
    from fulcrum.routing.registry import make_policy

    h = await router_harness(n=2, settings=FakeEngineSettings(token_delay_s=0.01),
                             policy=make_policy("load_aware", POLICY["params"]), config={"policy": POLICY})
    second, _ = await _two_requests(h, SHARED)
    assert second["choices"][0]["text"] == greedy(fake_encode(SHARED + " second"), 12)
    assert not [b for b in h.engine("e0").requests if b.get("max_tokens") == 1]  # the holder was not asked
    assert h.engine("e1").partial_loads == 0 and not h.engine("e1").crashed
    assert pulls(h, "recompute-unsupported") == 1 and pulls(h, "pulled") == 0


@pytest.mark.asyncio
async def test_a_slow_link_makes_recomputing_the_prefix_the_cheaper_choice(router_harness):
    from fakes.fake_engine import FakeEngineSettings
    from fulcrum.routing.registry import make_policy

    h = await router_harness(n=2, settings=FakeEngineSettings(token_delay_s=0.01, bidirectional_kv_xfer=True),
                             policy=make_policy("load_aware", POLICY["params"]),
                             config={"policy": POLICY, "kv_connector": {"partial_prefix": True, "link_gbps": 0.0001}})
    await _two_requests(h, SHARED)
    assert pulls(h, "recompute-cheaper") == 1 and h.engine("e1").partial_loads == 0


def test_the_operator_forces_disaggregation_only_for_a_disaggregated_spec():
    from fulcrum.routing.registry import make_policy, policy_params
    from fulcrum.target import RoutingParams

    assert policy_params("load_aware", RoutingParams(), disaggregated=True, kv_block_tokens=16) == {"disaggregate": True}
    unset = policy_params("load_aware", RoutingParams(), disaggregated=False, kv_block_tokens=16)
    assert unset == {}
    policy = make_policy("load_aware", unset)
    assert isinstance(policy, LoadAwarePolicy) and policy.disaggregate is None
