"""Role reassignment in the live router (router config ``roles``): ``both`` instances hold a prefill or decode duty
that follows the measured load, with FAKE engines (tests/fakes/fake_engine.py) behind the real ``disaggregated``
policy."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings  # noqa: E402
from fulcrum.router.config import RolesSection  # noqa: E402
from fulcrum.router.metrics import RouterMetrics  # noqa: E402
from fulcrum.routing.base import NO_CAPABILITIES, InstanceView  # noqa: E402
from fulcrum.routing.registry import make_policy  # noqa: E402
from fulcrum.router.roles import RoleBalancer, decode_utilisation, prefill_utilisation  # noqa: E402

pytestmark = pytest.mark.asyncio

FIELDS = {"role": "both", "max_concurrency": 8, "max_num_batched_tokens": 256, "kv_capacity_tokens": 20_000}
ROLES = {"enabled": True, "interval_s": 0.05, "cooldown_s": 0.1, "dwell_s": 0.5, "ttft_slo_s": 0.2}


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def duties(h) -> dict[str, str]:
    return dict(h.state.roles.duties)


def count(h, duty: str) -> int:
    return sum(1 for d in duties(h).values() if d == duty)


def changes(h, to: str) -> float:
    return h.state.metrics.registry.get_sample_value("fulcrum_router_role_changes_total", {"to_duty": to}) or 0.0


def prefill_legs(engine) -> int:
    return sum(1 for b in engine.requests if (b.get("kv_transfer_params") or {}).get("do_remote_decode"))


async def fire(h, n: int, prompt_tokens: int, max_tokens: int) -> list[asyncio.Task]:
    return [asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": f"{i:03d}" + "x" * (prompt_tokens - 3), "max_tokens": max_tokens, "ignore_eos": True}))
        for i in range(n)]


async def test_under_prefill_heavy_load_a_both_instance_takes_prefill_duty_and_returns_under_decode_heavy_load(router_harness):
    h = await router_harness(n=3, settings=FakeEngineSettings(prefill_delay_s=0.3, token_delay_s=0.01),
                             policy=make_policy("disaggregated", {}), config={"roles": ROLES}, instance_fields=FIELDS)
    assert duties(h) == {"e0": "decode", "e1": "prefill", "e2": "decode"}  # fewer-duty first, ties to decode
    # prefill-heavy: long prompts, 2 output tokens; the one prefill instance queues up
    tasks = await fire(h, 12, 600, 2)
    await wait_for(lambda: count(h, "prefill") == 2)
    assert changes(h, "prefill") == 1
    flipped = next(i for i in ("e0", "e2") if duties(h)[i] == "prefill")
    later = await fire(h, 6, 600, 2)  # arriving now, new prefills go to the emptier prefill-duty instance
    for r in await asyncio.gather(*tasks, *later):
        assert r.status == 200
    assert prefill_legs(h.engine(flipped)) >= 3
    # decode-heavy: short prompts, long outputs on the single decode instance; one prefill instance returns
    tasks = await fire(h, 10, 8, 150)
    await wait_for(lambda: count(h, "decode") == 2)
    assert changes(h, "decode") >= 1
    for r in await asyncio.gather(*tasks):
        assert r.status == 200
    gauge = h.state.metrics.registry.get_sample_value
    assert all(gauge("fulcrum_router_instance_duty", {"instance": i, "duty": d}) == 1.0 for i, d in duties(h).items())


async def test_under_steady_load_duties_do_not_ping_pong(router_harness):
    h = await router_harness(n=4, settings=FakeEngineSettings(prefill_delay_s=0.05, token_delay_s=0.01),
                             policy=make_policy("disaggregated", {}), config={"roles": ROLES}, instance_fields=FIELDS)
    flips: list[str] = []
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:  # a steady stream of mixed requests for 2 s, 20 dwell times
        for r in await asyncio.gather(*(await fire(h, 4, 200, 20))):
            assert r.status == 200
    flips = [c.instance for c in h.state.roles.changes]
    assert len(flips) <= 1, h.state.roles.changes
    assert count(h, "prefill") >= 1 and count(h, "decode") >= 1


async def test_without_roles_both_instances_are_shown_to_the_policy_as_both(router_harness):
    h = await router_harness(n=2, policy=make_policy("disaggregated", {}), instance_fields={"role": "both"})
    assert {v.role for v in h.state.views()} == {"both"}
    r = await h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status == 200


async def test_the_bounds_and_the_dwell_time_hold_in_the_balancer():
    rb = RoleBalancer(RouterMetrics())
    sec = RolesSection(enabled=True, cooldown_s=0.0, dwell_s=10.0, ttft_slo_s=1.0, min_decode=1)
    hot_prefill = InstanceView("a", role="both", queued_prefill_tokens=10_000, max_num_batched_tokens=1000)
    views = [hot_prefill, InstanceView("b", role="both"), InstanceView("c", role="both")]
    rb.sync(views)
    assert rb.duties == {"a": "decode", "b": "prefill", "c": "decode"}
    views = [InstanceView("a", role="both"), InstanceView("b", role="both", queued_prefill_tokens=10_000,
                                                          max_num_batched_tokens=1000), InstanceView("c", role="both")]
    change = rb.step(views, {"b": 5.0}, sec, now=0.0)
    assert change is not None and change.to_duty == "prefill" and change.instance in ("a", "c")
    assert rb.step(views, {"b": 5.0}, sec, now=1.0) is None  # one decode instance left: min_decode holds
    assert [v.role for v in rb.apply(views)].count("prefill") == 2


async def test_utilisation_is_compute_plus_memory_on_the_zero_to_two_scale():
    v = InstanceView("a", queued_prefill_tokens=512, max_num_batched_tokens=1024)
    assert prefill_utilisation(v, 1.0, 2.0) == pytest.approx(1.0)
    assert prefill_utilisation(v, 10.0, 2.0) == pytest.approx(1.5)
    d = InstanceView("b", inflight=4, max_num_seqs=8, running_tokens=3000, kv_capacity_tokens=4000)
    assert decode_utilisation(d) == pytest.approx(0.5 + 0.75)
    assert decode_utilisation(InstanceView("c", inflight=16, max_num_seqs=8)) == pytest.approx(1.0)


async def test_a_decode_instance_is_fully_busy_at_its_slo_batch_not_at_max_num_seqs():
    """rebalancing.duties module doc: past the batch at which TPOT reaches the SLO every request misses, however
    far max_num_seqs (the CUDA-graph cap) is."""
    d = InstanceView("d", inflight=88, max_num_seqs=256, running_tokens=0, kv_capacity_tokens=575_000)
    assert decode_utilisation(d) == pytest.approx(88 / 256)
    assert decode_utilisation(d, 88) == pytest.approx(1.0)
    assert decode_utilisation(d, 176) == pytest.approx(0.5)
    assert decode_utilisation(d, 1000) == pytest.approx(88 / 256)  # never past the engine's own limit


async def test_the_balancer_counts_decode_load_against_the_configured_slo_batch():
    """A prefill queue half a step deep against decode instances at their SLO batch: over max_num_seqs decode
    looks idle and loses an instance; over the plan's SLO batch (roles.decode_slo_batch) it holds."""
    views = [InstanceView("p", role="both", queued_prefill_tokens=1000, max_num_batched_tokens=1000),
             InstanceView("d1", role="both", inflight=88), InstanceView("d2", role="both", inflight=88)]
    for slo_batch, flips in ((None, True), (88, False)):
        rb = RoleBalancer(RouterMetrics())
        rb.book.duties.update({"p": "prefill", "d1": "decode", "d2": "decode"})
        sec = RolesSection(enabled=True, cooldown_s=0.0, ttft_slo_s=2.0, min_decode=1, decode_slo_batch=slo_batch)
        change = rb.step(views, {"p": 0.8}, sec, now=0.0)  # prefill U = 1.0 + 0.4
        assert (change is not None) is flips, slo_batch


class PinnedTestPolicy:
    """TEST DOUBLE policy: every request colocated on ``target``."""

    name = "pinned-test-double"
    capabilities = NO_CAPABILITIES

    def __init__(self, target: str) -> None:
        self.target = target

    def route(self, req, instances, now):
        from fulcrum.routing.base import RouteDecision

        return RouteDecision("colocated", self.target, split_token=req.prompt_tokens + req.max_tokens, reason="pinned")

    def on_start(self, req, decision, now) -> None:
        return None

    def on_finish(self, request_id, now) -> None:
        return None


async def test_with_migrate_on_flip_a_new_prefill_instance_hands_its_running_decodes_to_decode_instances(router_harness):
    from fakes.fake_engine import fake_encode, fake_next_token
    from fakes.sse_client import parse_stream

    cfg = {"roles": {**ROLES, "migrate_on_flip": True}, "rescheduling": {"enabled": True, "interval_s": 3600}}
    h = await router_harness(n=3, settings=FakeEngineSettings(token_delay_s=0.01), policy=PinnedTestPolicy("e0"),
                             config=cfg, instance_fields=FIELDS)
    prompts = ["first decode on e0", "second decode on e0"]
    tasks = [asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": p, "max_tokens": 120, "stream": True, "ignore_eos": True})) for p in prompts]
    await wait_for(lambda: len(h.state.rescheduler.requests) == 2)
    pool = h.state.pool
    # the router's own accounting says: e1 (prefill duty) has a deep queue, e2 (decode) is busier than e0
    queue = pool.acquire("e1", 10_000, 10_000)
    busy = [pool.acquire("e2", 0, 5_000) for _ in range(3)]
    for t in busy:
        t.first_token()  # running: their 5,000 KV tokens each count
    await wait_for(lambda: duties(h)["e0"] == "prefill")
    queue.release()
    for t in busy:
        t.release()
    for p, t in zip(prompts, tasks):
        seq = fake_encode(p)
        for _ in range(120):
            seq.append(fake_next_token(seq))
        assert parse_stream(await (await t).read())[0] == bytes(seq[len(fake_encode(p)):]).decode()
    moved = h.state.metrics.registry.get_sample_value("fulcrum_router_migrations_total", {"reason": "duty"})
    assert moved == 2 and len(h.engine("e2").requests) == 2  # both continued on the decode instance


async def test_roles_bounds_are_validated_in_the_config():
    from fulcrum.router.config import RouterConfigError, parse_config

    with pytest.raises(RouterConfigError, match="roles"):
        parse_config({"roles": {"enabled": True, "min_decode": 3, "max_decode": 2}})
