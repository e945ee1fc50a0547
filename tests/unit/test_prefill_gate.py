"""DOPD Alg. 1 in the router's request path: the prefill gate groups short prompts per prefill instance, lets long
ones and prompts for an idle instance through at once, and releases a group when it is full or has waited
``batch_timeout_s``; through the router on FAKE engines, grouped prefills still give the colocated tokens."""

from __future__ import annotations

import asyncio

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings  # noqa: E402
from fulcrum.routing.batcher import PrefillBatcher  # noqa: E402
from fulcrum.routing.disaggregated import DisaggregatedPolicy  # noqa: E402
from fulcrum.router.prefill_gate import PrefillGate  # noqa: E402

pytestmark = pytest.mark.asyncio


def gate(long: int = 100, timeout_s: float = 30.0, max_tokens: int | None = None, released: list | None = None):
    return PrefillGate(lambda: PrefillBatcher(long_request_tokens=long, batch_timeout_s=timeout_s,
                                              max_batch_tokens=max_tokens),
                       on_release=released.append if released is not None else None)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_long_prompt_passes_at_once_and_short_ones_wait_until_their_group_is_full() -> None:
    released: list = []
    g = gate(long=100, released=released)
    assert await g.admit("p0", 150, idle=False) == "long"
    first = asyncio.create_task(g.admit("p0", 40, idle=False))
    second = asyncio.create_task(g.admit("p0", 40, idle=False))
    await settle()
    assert not first.done() and not second.done() and g.pending("p0") == 2
    third = asyncio.create_task(g.admit("p0", 30, idle=False))  # 110 >= 100: the group is full
    assert await asyncio.gather(first, second, third) == ["full"] * 3
    assert [(len(b.items), b.tokens, b.cause) for b in released] == [(1, 150, "long"), (3, 110, "full")]
    assert g.pending("p0") == 0


async def test_a_group_that_does_not_fill_is_released_after_the_timeout() -> None:
    g = gate(long=1000, timeout_s=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    causes = await asyncio.gather(g.admit("p0", 10, idle=False), g.admit("p0", 20, idle=False))
    assert causes == ["timeout", "timeout"]
    assert loop.time() - started >= 0.05


async def test_an_idle_instance_takes_the_open_group_and_the_new_prompt_at_once() -> None:
    g = gate(long=1000)
    waiting = asyncio.create_task(g.admit("p0", 10, idle=False))
    await settle()
    assert not waiting.done()
    assert await g.admit("p0", 10, idle=True) == "flush"  # Alg. 1's empty queue: run the batch now
    assert await waiting == "flush"


async def test_groups_are_per_instance_and_the_budget_cap_releases_before_overflow() -> None:
    released: list = []
    g = gate(long=1000, max_tokens=50, released=released)
    a = asyncio.create_task(g.admit("p0", 40, idle=False))
    b = asyncio.create_task(g.admit("p1", 40, idle=False))
    await settle()
    assert g.pending("p0") == 1 and g.pending("p1") == 1  # two instances, two groups
    c = asyncio.create_task(g.admit("p0", 20, idle=False))  # 60 > 50: p0's open group goes first
    assert await a == "budget"
    await settle()
    assert not c.done() and not b.done()
    g.close()  # a replaced gate lets everything through
    assert await b == "flush" and await c == "flush"
    assert sorted(x.cause for x in released) == ["budget", "flush", "flush"]


async def test_a_cancelled_waiter_does_not_stop_its_group() -> None:
    g = gate(long=100)
    gone = asyncio.create_task(g.admit("p0", 60, idle=False))
    await settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    # its 60 tokens still count (DOPD's batch holds them): 60 + 50 fills the group
    assert await g.admit("p0", 50, idle=False) == "full"


async def test_the_router_groups_short_prefills_on_a_busy_prefill_instance_and_answers_as_colocated(
        router_harness) -> None:
    """e0 prefills (slowly), e1 decodes. The first request finds e0 idle and passes (flush); the next two arrive
    while e0 is busy, wait together at the gate and are released by the timeout as one group of two."""
    policy = DisaggregatedPolicy(long_request_tokens=4096, batch_timeout_s=1.0)
    h = await router_harness(policy=policy, settings=FakeEngineSettings(prefill_delay_s=3.0),
                             roles=["prefill", "decode"])
    body = {"prompt": "the quick brown fox jumps over", "max_tokens": 6, "temperature": 0}

    async def ask() -> str:
        r = await h.client.post("/v1/completions", json=body)
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]

    first = asyncio.create_task(ask())
    for _ in range(100):  # until e0 has the first prefill
        await asyncio.sleep(0.01)
        if h.engine("e0").requests:
            break
    later = [asyncio.create_task(ask()) for _ in range(2)]
    for _ in range(100):  # both reach the gate (well before its 1 s timeout) and wait there
        await asyncio.sleep(0.01)
        if h.state.prefill_gate.pending("e0") == 2:
            break
    assert len(h.engine("e0").requests) == 1 and h.state.prefill_gate.pending("e0") == 2  # held at the gate
    texts = await asyncio.gather(first, *later)
    assert len(set(texts)) == 1 and texts[0]
    assert len(h.engine("e0").requests) == 3 and all(r["max_tokens"] == 1 for r in h.engine("e0").requests)
    metrics = (await (await h.client.get("/metrics")).read()).decode()
    assert 'fulcrum_router_prefill_groups_total{cause="flush"} 1.0' in metrics
    assert 'fulcrum_router_prefill_groups_total{cause="timeout"} 1.0' in metrics
    assert "fulcrum_router_prefill_group_prompts_sum 3.0" in metrics
    assert h.router_inflight() == 0


async def test_without_a_timeout_the_router_has_no_gate(router_harness) -> None:
    h = await router_harness(policy=DisaggregatedPolicy(), roles=["prefill", "decode"])
    assert h.state.prefill_gate is None
    r = await h.client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3})
    assert r.status == 200


async def test_a_new_router_config_reconfigures_the_disaggregated_policy_in_place(router_harness) -> None:
    """The operator rewrites the policy section every time a plan moves its thresholds: the router keeps the
    policy (its prefix index) and its DOPD Alg. 1 gate unless the grouping changes."""
    from fulcrum.router.app import default_policy_factory
    from fulcrum.router.config import parse_config

    params = {"long_request_tokens": 4096, "batch_timeout_s": 1.0}
    h = await router_harness(policy=DisaggregatedPolicy(**params), roles=["prefill", "decode"],
                             config={"policy": {"name": "disaggregated", "params": params}})
    st = h.state
    st.policy_factory = default_policy_factory  # the router's own (the harness's hands out its fake)
    policy, gate = st.policy, st.prefill_gate
    assert isinstance(policy, DisaggregatedPolicy) and gate is not None
    st.apply_config(parse_config({**h.config, "policy": {"name": "disaggregated",
                                                        "params": {**params, "ultra_short_tokens": 96}}}))
    assert st.policy is policy and policy.ultra_short_tokens == 96 and st.prefill_gate is gate
    st.apply_config(parse_config({**h.config, "policy": {"name": "disaggregated",
                                                        "params": {**params, "batch_timeout_s": 0.5}}}))
    assert st.policy is policy and st.prefill_gate is not gate and policy.batch_timeout_s == 0.5
    # a value the policy rejects keeps the running one, unchanged
    st.apply_config(parse_config({**h.config, "policy": {"name": "disaggregated", "params": {"ultra_short_tokens": -5}}}))
    assert st.policy is policy and policy.ultra_short_tokens == 0 and policy.batch_timeout_s == 0.5
    r = await h.client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3})
    assert r.status == 200
