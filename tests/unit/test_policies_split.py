"""Libra Alg. 1: split point by bounded binary search over the execution predictor (§4.1, Insight 1, Fig. 5)."""

from __future__ import annotations

import pytest

from fulcrum.ratio.profiles import builtin_profile
from fulcrum.routing.base import InstanceView, NoInstanceError, RequestInfo, RouteDecision
from fulcrum.routing.split import SplitPolicy, search_split_point
from fulcrum.routing.predictor import InstancePredictor, MicroRequest, predictor_step_cost, split_micro_requests

PROFILE = builtin_profile("splitwise-llama2-70b-h100")  # measured Llama-2-70B on H100 (Splitwise)
COSTS = predictor_step_cost(PROFILE, 2)


def req(p: int, d: int, rid: str = "r") -> RequestInfo:
    return RequestInfo(rid, prompt_tokens=p, max_tokens=max(d, 1), predicted_output_tokens=d)


def pair(**kw: object) -> list[InstanceView]:
    return [InstanceView("a", tp=2, **kw), InstanceView("b", tp=2, **kw)]  # type: ignore[arg-type]


def test_idle_pair_settles_past_the_prompt_boundary_for_a_1024_1024_request():
    """Libra Fig. 5: s = P (pure disaggregation) leaves the prefill side nearly idle; the search moves the
    split into the decode phase until both sides take about as long."""
    pol = SplitPolicy(profile=PROFILE)
    d = pol.route(req(1024, 1024), pair(), 0.0)
    assert d.kind == "split" and d.split_token > 1024 and d.handoff_after == d.split_token - 1024
    assert d.phi == pytest.approx(d.split_token / 2048)
    # balance at the chosen point vs at s = P, on fresh predictors
    def gap(s: int) -> float:
        a, b = InstancePredictor(COSTS), InstancePredictor(COSTS)
        alpha, beta = split_micro_requests(1024, 1024, s)
        assert alpha is not None and beta is not None
        return abs(a.probe(alpha, 0.0).finish_s - b.probe(beta, 0.0).finish_s)

    assert gap(d.split_token) < 0.02 * gap(1024)
    assert d.reason.split(":")[0] in ("balanced", "bounded") and "after 6 probes" in d.reason


def test_pipelined_stream_keeps_both_stages_busy_where_pure_disaggregation_starves_one():
    """Insight 1 on a Fig. 5-style pipeline: GPU-1 always runs α, GPU-2 always β, one 1024/1024 request every
    second. The searched split settles past P and balances the two stages; s = P does not."""
    g1, g2 = InstancePredictor(COSTS), InstancePredictor(COSTS)
    f1, f2 = InstancePredictor(COSTS), InstancePredictor(COSTS)
    splits = []
    for i in range(200):
        now = float(i)
        r = search_split_point(1024, 1024, g1, g2, now)
        splits.append(r.split_token)
        alpha, beta = split_micro_requests(1024, 1024, r.split_token)
        assert alpha is not None and beta is not None
        g1.commit(str(i), alpha, now)
        g2.commit(str(i), beta, now)
        fa, fb = split_micro_requests(1024, 1024, 1024)
        assert fa is not None and fb is not None
        f1.commit(str(i), fa, now)
        f2.commit(str(i), fb, now)
    now = 200.0
    assert min(splits[-50:]) > 1024 + 256  # settled well inside the decode phase
    assert abs(g1.busy_s(now) - g2.busy_s(now)) < 0.1 * max(g1.busy_s(now), g2.busy_s(now))
    assert f1.busy_s(now) < 0.05 * f2.busy_s(now)  # s = P: GPU-1 idles while GPU-2 queues
    assert max(g1.busy_s(now), g2.busy_s(now)) < 0.75 * f2.busy_s(now)


def test_a_busier_second_instance_moves_the_split_later():
    def split_with_backlog(n: int) -> int:
        a, b = InstancePredictor(COSTS), InstancePredictor(COSTS)
        for i in range(n):
            b.commit(str(i), MicroRequest(0, 1000, 300), 0.0)
        return search_split_point(1024, 1024, a, b, 0.0, max_probes=12).split_token

    splits = [split_with_backlog(n) for n in (0, 8, 64)]
    assert splits[0] < splits[1] < splits[2] <= 2048


def test_cold_start_without_timing_data_is_pure_disaggregation():
    pol = SplitPolicy()  # no profile
    d = pol.route(req(1000, 250), pair(), 0.0)
    assert (d.kind, d.split_token, d.handoff_after) == ("disaggregated", 1000, 0)
    assert d.phi == pytest.approx(1000 / 1250) and d.reason.startswith("cold-start")
    assert pol.reasons["cold-start"] == 1
    # DOPD's published profile (prefill TP=1, decode TP=2: the default of an LLMServe) is data enough
    dopd = SplitPolicy(profile=builtin_profile("dopd-llama70b-fp8-h100")).route(req(1024, 1024), pair(), 0.0)
    assert dopd.kind == "split" and dopd.split_token > 1024


def test_long_prompt_with_one_output_token_wants_to_split_inside_the_prompt():
    # T_A(s=P) = the whole prefill, T_B(s=P) = one decode step: balance lies inside the prompt
    unsafe = SplitPolicy(profile=PROFILE).route(req(8000, 1), pair(), 0.0)
    assert unsafe.kind == "disaggregated" and unsafe.split_token == 8000
    assert unsafe.reason.startswith("safe-split")
    safe = SplitPolicy(profile=PROFILE).route(req(8000, 1), pair(supports_partial_prefix=True), 0.0)
    assert safe.kind == "split" and 0 < safe.split_token < 8000 and safe.handoff_after == 0
    # both halves of the prompt take about as long
    a, b = split_micro_requests(8000, 1, safe.split_token)
    assert a is not None and b is not None
    ta = InstancePredictor(COSTS).probe(a, 0.0).finish_s
    tb = InstancePredictor(COSTS).probe(b, 0.0).finish_s
    assert abs(ta - tb) < 0.1 * max(ta, tb)


def test_partial_prefix_needs_support_on_both_instances():
    insts = [InstanceView("a", tp=2, supports_partial_prefix=True), InstanceView("b", tp=2)]
    d = SplitPolicy(profile=PROFILE).route(req(8000, 1), insts, 0.0)
    assert d.split_token == 8000 and d.reason.startswith("safe-split")


def test_a_prefill_instance_never_decodes_and_without_partial_prefixes_the_split_stays_at_the_prompt():
    insts = [InstanceView("p", role="prefill", tp=2), InstanceView("d", role="decode", tp=2)]
    d = SplitPolicy(profile=PROFILE).route(req(1024, 1024), insts, 0.0)
    assert (d.kind, d.first, d.second, d.split_token) == ("disaggregated", "p", "d", 1024)
    assert d.handoff_after == 0


def test_a_busy_prefill_instance_hands_part_of_the_prompt_to_the_decode_instance():
    # Libra §4.1 between a P and a D instance: B prefills the prompt's tail when A is the bottleneck
    insts = [InstanceView("p", role="prefill", tp=2, supports_partial_prefix=True),
             InstanceView("d", role="decode", tp=2, supports_partial_prefix=True)]
    policy = SplitPolicy(profile=PROFILE)
    policy.route(req(10, 1, rid="seen"), insts, 0.0)  # the policy learns the instances' views
    for i in range(6):  # load the prefill instance's virtual queue with long prompts
        r = req(8000, 1, rid=f"busy{i}")
        policy.on_start(r, RouteDecision("disaggregated", "p", "d", split_token=8000), 0.0)
    d = policy.route(req(4096, 8), insts, 0.0)
    assert d.kind == "split" and (d.first, d.second) == ("p", "d")
    assert 0 < d.split_token < 4096 and d.handoff_after == 0


def test_prefill_only_first_instance_may_still_take_less_of_the_prompt_but_never_decode():
    insts = [InstanceView("p", role="prefill", tp=2, supports_partial_prefix=True), InstanceView("u", tp=2, supports_partial_prefix=True)]
    d = SplitPolicy(profile=PROFILE).route(req(1024, 1024), insts, 0.0)
    assert d.first == "p" and d.split_token <= 1024 and d.handoff_after == 0


def test_single_instance_colocates_and_no_decoder_raises():
    d = SplitPolicy(profile=PROFILE).route(req(1024, 1024), [InstanceView("solo", tp=2)], 0.0)
    assert d.kind == "colocated" and d.first == "solo" and d.split_token == 1024 + 1024
    with pytest.raises(NoInstanceError):
        SplitPolicy(profile=PROFILE).route(req(10, 10), [InstanceView("p", role="prefill", tp=2)], 0.0)


def test_on_start_commits_the_pair_and_the_next_request_goes_to_idle_instances():
    pol = SplitPolicy(profile=PROFILE)
    fleet = [InstanceView(x, tp=2) for x in "abcd"]
    r1 = req(1024, 1024, "r1")
    d1 = pol.route(r1, fleet, 0.0)
    pol.on_start(r1, d1, 0.0)
    used = {d1.first, d1.second}
    for i in used:
        pred = pol.predictor.get(i)
        assert pred is not None and pred.busy_s(0.0) > 0 and "r1" in pred
    r2 = req(1024, 1024, "r2")
    d2 = pol.route(r2, fleet, 0.01)
    assert {d2.first, d2.second}.isdisjoint(used)
    pol.on_finish("r1", 0.5)
    for i in used:
        pred = pol.predictor.get(i)
        assert pred is not None and "r1" not in pred and pred.busy_s(0.5) == 0.0


def test_stream_over_four_instances_spreads_and_balances_the_predicted_load():
    pol = SplitPolicy(profile=PROFILE)
    fleet = [InstanceView(x, tp=2) for x in "abcd"]
    kinds = set()
    for i in range(120):
        r = req(512 + 37 * (i % 20), 200 + 41 * (i % 13), f"r{i}")
        d = pol.route(r, fleet, i * 0.25)
        pol.on_start(r, d, i * 0.25)
        kinds.add(d.kind)
    busy = []
    for x in "abcd":
        pred = pol.predictor.get(x)
        assert pred is not None
        busy.append(pred.busy_s(30.0))
    assert min(busy) > 0.8 * max(busy)
    assert "split" in kinds


def test_handoff_is_moved_off_a_kv_block_boundary():
    base = SplitPolicy(profile=PROFILE).route(req(1024, 1024), pair(), 0.0)
    k = base.handoff_after
    block = 1024 + k - 1  # a block size at which P + k − 1 falls exactly on a boundary
    nudged = SplitPolicy(profile=PROFILE, kv_block_tokens=block).route(req(1024, 1024), pair(), 0.0)
    assert nudged.split_token == base.split_token + 1 and "block boundary" in nudged.reason


def test_search_respects_its_probe_budget_and_bounds():
    a, b = InstancePredictor(COSTS), InstancePredictor(COSTS)
    r = search_split_point(1024, 1024, a, b, 0.0, max_probes=1)
    assert r.probes == 1 and r.split_token == 1024  # the first probe is pure disaggregation
    r = search_split_point(1024, 1024, a, b, 0.0, max_probes=30, epsilon_s=0.0)
    assert r.probes == 30
    with pytest.raises(ValueError):
        search_split_point(1024, 1024, a, b, 0.0, lo=0.6, hi=0.5)
    with pytest.raises(ValueError):
        SplitPolicy(max_probes=0)


def test_profile_parameter_accepts_a_name_a_mapping_or_an_object():
    for prof in ("splitwise-llama2-70b-h100", PROFILE.to_dict(), PROFILE):
        d = SplitPolicy(profile=prof).route(req(1024, 1024), pair(), 0.0)
        assert d.kind == "split"
    with pytest.raises(TypeError):
        SplitPolicy(profile=42)  # type: ignore[arg-type]
