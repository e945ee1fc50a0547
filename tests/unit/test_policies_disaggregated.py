"""DOPD routing (§V-B/§V-E): ultra-short prompts local, prefix-cache- and load-aware decode choice; and the
length-aware prefill grouper of DOPD Alg. 1."""

from __future__ import annotations

import pytest

from fulcrum.routing.batcher import PrefillBatcher
from fulcrum.routing.base import InstanceView, NoInstanceError, RequestInfo
from fulcrum.routing.disaggregated import DisaggregatedPolicy, prefix_hit_tokens


def req(p: int, hashes: tuple[int, ...] = (), rid: str = "r", d: int = 100) -> RequestInfo:
    return RequestInfo(rid, prompt_tokens=p, max_tokens=512, predicted_output_tokens=d, prefix_hashes=hashes)


FLEET = [
    InstanceView("p1", role="prefill", queued_prefill_tokens=4000),
    InstanceView("p2", role="prefill", queued_prefill_tokens=500),
    InstanceView("d1", role="decode", running_tokens=30_000),
    InstanceView("d2", role="decode", running_tokens=10_000),
]


def test_long_prompt_is_disaggregated_from_least_queued_prefill_to_least_loaded_decode():
    d = DisaggregatedPolicy(ultra_short_tokens=64).route(req(1000), FLEET, 0.0)
    assert (d.kind, d.first, d.second) == ("disaggregated", "p2", "d2")
    assert d.split_token == 1000 and d.handoff_after == 0 and d.phi == pytest.approx(1000 / 1100)


def test_ultra_short_prompt_runs_whole_on_a_decode_instance():
    d = DisaggregatedPolicy(ultra_short_tokens=64).route(req(64), FLEET, 0.0)
    assert d.kind == "colocated" and d.first == "d2" and d.second is None
    assert d.reason.startswith("ultra-short")
    # one token longer: disaggregated again
    assert DisaggregatedPolicy(ultra_short_tokens=64).route(req(65), FLEET, 0.0).kind == "disaggregated"


def test_decode_instance_with_the_cached_prefix_wins_over_a_slightly_less_loaded_one():
    hashes = tuple(range(100, 164))  # 64 blocks × 16 tokens = the whole 1024-token prompt
    fleet = [
        InstanceView("p", role="prefill"),
        InstanceView("cold", role="decode", running_tokens=10_000),
        InstanceView("warm", role="decode", running_tokens=10_500, prefix_hashes=frozenset(hashes)),
    ]
    d = DisaggregatedPolicy().route(req(1024, hashes), fleet, 0.0)
    assert d.second == "warm"  # 10500 + 0 missed < 10000 + 1024 missed


def test_load_outweighs_the_cache_when_the_warm_instance_is_much_busier():
    hashes = tuple(range(100, 164))
    fleet = [
        InstanceView("p", role="prefill"),
        InstanceView("cold", role="decode", running_tokens=10_000),
        InstanceView("warm", role="decode", running_tokens=20_000, prefix_hashes=frozenset(hashes)),
    ]
    assert DisaggregatedPolicy().route(req(1024, hashes), fleet, 0.0).second == "cold"
    # ...unless a missed prompt token is made to weigh more than ten tokens of load
    assert DisaggregatedPolicy(miss_weight=11.0).route(req(1024, hashes), fleet, 0.0).second == "warm"


def test_prefix_hits_count_only_leading_blocks():
    inst = InstanceView("x", prefix_hashes=frozenset({1, 2, 4}))
    assert prefix_hit_tokens(req(100, (1, 2, 3, 4)), inst, 16) == 32  # block 3 missing: block 4 is unusable
    assert prefix_hit_tokens(req(20, (1, 2)), inst, 16) == 20  # capped at the prompt
    assert prefix_hit_tokens(req(100, (9, 1)), inst, 16) == 0


def test_costs_are_compared_as_capacity_fractions_when_every_candidate_reports_capacity():
    fleet = [
        InstanceView("p", role="prefill"),
        InstanceView("small", role="decode", running_tokens=10_000, kv_capacity_tokens=20_000),
        InstanceView("big", role="decode", running_tokens=30_000, kv_capacity_tokens=200_000),
    ]
    assert DisaggregatedPolicy().route(req(1000), fleet, 0.0).second == "big"


def test_prefill_choice_accounts_for_prefix_already_cached_on_the_prefill_instance():
    hashes = tuple(range(64))
    fleet = [
        InstanceView("p_cold", role="prefill", queued_prefill_tokens=0),
        InstanceView("p_warm", role="prefill", queued_prefill_tokens=512, prefix_hashes=frozenset(hashes)),
        InstanceView("d", role="decode"),
    ]
    assert DisaggregatedPolicy().route(req(1024, hashes), fleet, 0.0).first == "p_warm"


def test_unified_instances_split_across_two_different_instances_or_colocate_when_alone():
    pol = DisaggregatedPolicy()
    d = pol.route(req(1000), [InstanceView("u1"), InstanceView("u2")], 0.0)
    assert d.kind == "disaggregated" and d.first != d.second
    solo = pol.route(req(1000), [InstanceView("u1")], 0.0)
    assert solo.kind == "colocated" and solo.first == "u1"


def test_without_prefill_instances_the_decode_instance_prefills_locally_and_without_decoders_none_fits():
    pol = DisaggregatedPolicy()
    d = pol.route(req(1000), [InstanceView("d", role="decode"), InstanceView("p", role="prefill", healthy=False)], 0.0)
    assert d.kind == "colocated" and d.first == "d" and d.reason.startswith("no-prefill-instance")
    with pytest.raises(NoInstanceError):
        pol.route(req(1000), [InstanceView("p", role="prefill")], 0.0)


def test_draining_instances_get_nothing():
    fleet = [InstanceView("p", role="prefill"), InstanceView("d_drain", role="decode", draining=True), InstanceView("d", role="decode", running_tokens=99_999)]
    assert DisaggregatedPolicy().route(req(1000), fleet, 0.0).second == "d"


# -- DOPD Alg. 1 prefill grouping -----------------------------------------------------------------------------


def test_long_prompt_is_released_alone_at_once_and_leaves_the_open_group_alone():
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=0.05)
    assert b.add(req(300, rid="s1"), 0.0) == []
    out = b.add(req(1500, rid="L"), 0.01)
    assert [(x.cause, [r.request_id for r in x.items]) for x in out] == [("long", ["L"])]
    assert b.pending == 1 and b.pending_tokens == 300


def test_short_prompts_are_grouped_until_their_total_reaches_i_next():
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=10.0)
    assert b.add(req(400, rid="a"), 0.0) == []
    assert b.add(req(500, rid="b"), 0.1) == []
    out = b.add(req(200, rid="c"), 0.2)
    assert len(out) == 1 and out[0].cause == "full" and out[0].tokens == 1100
    assert [r.request_id for r in out[0].items] == ["a", "b", "c"]
    assert (out[0].opened_at, out[0].released_at) == (0.0, 0.2)
    assert b.pending == 0 and b.next_deadline() is None


def test_group_times_out_from_its_first_member_and_the_deadline_says_when():
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=0.05)
    b.add(req(100, rid="a"), 1.00)
    b.add(req(100, rid="b"), 1.03)
    assert b.next_deadline() == pytest.approx(1.05)
    assert b.poll(1.049) == []
    out = b.poll(1.05)
    assert len(out) == 1 and out[0].cause == "timeout" and len(out[0].items) == 2
    # a new group starts its own timer
    b.add(req(100, rid="c"), 2.0)
    assert b.next_deadline() == pytest.approx(2.05)


def test_add_releases_a_timed_out_group_before_taking_the_next_prompt():
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=0.05)
    b.add(req(100, rid="a"), 0.0)
    out = b.add(req(100, rid="b"), 0.2)
    assert [x.cause for x in out] == ["timeout"] and [r.request_id for r in out[0].items] == ["a"]
    assert b.pending == 1 and b.next_deadline() == pytest.approx(0.25)


def test_zero_timeout_releases_every_short_prompt_at_once_and_flush_empties_the_group():
    b0: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=0.0)
    assert [len(x.items) for x in b0.add(req(10), 0.0)] == [1]
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=1000, batch_timeout_s=1.0)
    b.add(req(10), 0.0)
    out = b.flush(0.001)
    assert [x.cause for x in out] == ["flush"] and b.flush(0.002) == []


def test_token_cap_releases_the_group_before_it_would_overflow():
    b: PrefillBatcher[RequestInfo] = PrefillBatcher(long_request_tokens=4096, batch_timeout_s=1.0, max_batch_tokens=1000)
    b.add(req(600, rid="a"), 0.0)
    out = b.add(req(600, rid="b"), 0.1)
    assert [x.cause for x in out] == ["budget"] and out[0].tokens == 600 and b.pending_tokens == 600


def test_batcher_rejects_bad_settings_and_policy_builds_one_from_its_parameters():
    with pytest.raises(ValueError):
        PrefillBatcher(long_request_tokens=0)
    with pytest.raises(ValueError):
        PrefillBatcher(batch_timeout_s=-1.0)
    with pytest.raises(ValueError):
        DisaggregatedPolicy(batch_timeout_s=-1.0)
    b = DisaggregatedPolicy(long_request_tokens=777, batch_timeout_s=0.02).new_batcher()
    assert (b.long_request_tokens, b.batch_timeout_s) == (777, 0.02)
    # the typed capability the router and the simulator read: a batcher factory only while grouping is on
    make = DisaggregatedPolicy(long_request_tokens=777, batch_timeout_s=0.02).capabilities.prefill_batcher
    assert make is not None and make().long_request_tokens == 777
    assert DisaggregatedPolicy(batch_timeout_s=0.0).capabilities.prefill_batcher is None


def test_a_repeated_prefix_returns_to_the_instances_the_policy_sent_it_to() -> None:
    # two equal decode instances report no cache: the policy's own index of routed prompts makes the difference
    fleet = [InstanceView("p1", role="prefill"), InstanceView("p2", role="prefill"),
             InstanceView("d1", role="decode", running_tokens=5_000), InstanceView("d2", role="decode", running_tokens=5_000)]
    policy = DisaggregatedPolicy(kv_block_tokens=16)
    assert policy.capabilities.prefix_block_tokens == 16
    shared = tuple(range(100, 160))  # a 960-token system prompt
    first = policy.route(req(1000, shared + (1, 2), rid="a"), fleet, 0.0)
    policy.on_start(req(1000, shared + (1, 2), rid="a"), first, 0.0)
    follow = [policy.route(req(1000, shared + (k, k + 1), rid=f"b{k}"), fleet, 0.0) for k in range(3, 9)]
    assert {d.second for d in follow} == {first.second}  # the warm decode instance every time
    assert {d.first for d in follow} == {first.first}  # and the warm prefill instance
    # a different prompt sees no hit and breaks ties as before
    cold = req(1000, tuple(range(900, 962)), rid="c")
    assert prefix_hit_tokens(cold, fleet[2], 16, policy.index) == 0
    assert prefix_hit_tokens(req(1000, shared, rid="s"), InstanceView(first.second, role="decode"), 16, policy.index) == 960


def test_reconfigure_applies_new_thresholds_in_place_and_keeps_the_prefix_index() -> None:
    fleet = [InstanceView("p1", role="prefill"), InstanceView("d1", role="decode"), InstanceView("d2", role="decode")]
    policy = DisaggregatedPolicy(ultra_short_tokens=64, kv_block_tokens=16)
    shared = tuple(range(100, 160))
    first = policy.route(req(1000, shared, rid="a"), fleet, 0.0)
    policy.on_start(req(1000, shared, rid="a"), first, 0.0)
    caps = policy.capabilities
    # a new ultra-short threshold, as the next plan writes it: same grouping, so the same capabilities object
    assert policy.reconfigure({"ultra_short_tokens": 128, "kv_block_tokens": 16}) is True
    assert policy.ultra_short_tokens == 128 and policy.capabilities is caps
    assert policy.route(req(100), fleet, 0.0).kind == "colocated"  # 100 ≤ 128 now
    assert policy.index.leading(first.second, shared) == len(shared)  # what it routed is still known
    # new DOPD Alg. 1 grouping: new capabilities (the caller starts new gates) with the new batcher settings
    assert policy.reconfigure({"kv_block_tokens": 16, "long_request_tokens": 900, "batch_timeout_s": 0.05}) is True
    assert policy.capabilities is not caps and policy.ultra_short_tokens == 0  # left out: its default
    make = policy.capabilities.prefill_batcher
    assert make is not None and make().long_request_tokens == 900
    # another block size: the index would mean other blocks, so the caller must build a new policy
    assert policy.reconfigure({"kv_block_tokens": 32}) is False and policy.kv_block_tokens == 16
    # a value the constructor rejects changes nothing
    with pytest.raises(ValueError):
        policy.reconfigure({"ultra_short_tokens": -1})
    with pytest.raises(TypeError):
        policy.reconfigure({"nope": 1})
    assert policy.ultra_short_tokens == 0 and policy.long_request_tokens == 900


def test_reconfigured_keeps_a_policy_that_takes_the_parameters_and_builds_one_otherwise() -> None:
    from fulcrum.routing.registry import reconfigured
    from fulcrum.routing.round_robin import RoundRobinPolicy

    policy = DisaggregatedPolicy(ultra_short_tokens=64)
    assert reconfigured(policy, "disaggregated", {"ultra_short_tokens": 32}) is policy and policy.ultra_short_tokens == 32
    other = reconfigured(policy, "disaggregated", {"kv_block_tokens": 32})
    assert other is not policy and isinstance(other, DisaggregatedPolicy) and other.kv_block_tokens == 32
    assert isinstance(reconfigured(policy, "round_robin", {}), RoundRobinPolicy)
    rr = RoundRobinPolicy()
    assert reconfigured(rr, "round_robin", {}) is not rr  # no reconfigure: a new one, as before
    with pytest.raises(ValueError, match="unknown parameter"):
        reconfigured(policy, "disaggregated", {"nope": 1})
    assert policy.ultra_short_tokens == 32


def test_a_miss_weight_that_is_not_a_finite_number_is_refused():
    """NaN passed the ``miss_weight < 0`` check and made every decode cost NaN: every request went to the first
    decode instance, however loaded (1,000,000 KV tokens against 0); +inf made every cost infinite and the
    choice round-robin. Both are refused, naming the parameter, as for any router config value."""
    from fulcrum.routing.registry import make_policy

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="miss_weight"):
            DisaggregatedPolicy(miss_weight=bad)
        with pytest.raises(ValueError, match="'miss_weight'"):
            make_policy("disaggregated", {"miss_weight": bad})
    fleet = [InstanceView("p", role="prefill"), InstanceView("b", role="decode", running_tokens=1_000_000),
             InstanceView("c", role="decode")]
    assert DisaggregatedPolicy(miss_weight=0.0).route(req(100), fleet, 0.0).second == "c"
