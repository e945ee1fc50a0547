"""Router config ``draining: [ids]``: listed instances get no new requests from any policy, in-flight ones finish,
and a reload of the config file applies a new list live. Engines are FAKE (tests/fakes/fake_engine.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings, fake_encode, fake_next_token  # noqa: E402
from fakes.sse_client import parse_stream  # noqa: E402
from fulcrum.router.config import InstanceConfig  # noqa: E402
from fulcrum.routing.registry import make_policy  # noqa: E402

pytestmark = pytest.mark.asyncio


def expected(prompt: str, n: int) -> str:
    seq = fake_encode(prompt)
    p = len(seq)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return bytes(seq[p:]).decode()


def generation_requests(engine) -> int:
    return len(engine.requests)


async def wait_for(predicate, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_draining_instance_gets_no_new_requests_while_its_in_flight_stream_completes(router_harness, tmp_path):
    path = tmp_path / "router.yaml"  # absent at start: the watcher picks it up when the "operator" writes it
    h = await router_harness(n=2, policy=make_policy("round_robin", {}), settings=FakeEngineSettings(token_delay_s=0.02),
                             config={"reload_interval_s": 0.05}, config_path=path)
    stream_prompt = "a long answer streams while its instance drains"
    stream = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": stream_prompt, "max_tokens": 40, "stream": True}))
    await wait_for(lambda: h.engines_active() == 1)
    busy = next(e for e in h.engines if e.active)
    other = next(e for e in h.engines if e is not busy)

    path.write_text(yaml.safe_dump({**h.config, "draining": [busy.engine_id]}))
    await wait_for(lambda: h.state.config.draining == (busy.engine_id,))
    assert busy.active  # still streaming: draining does not touch in-flight work

    for i in range(8):
        r = await h.client.post("/v1/completions", json={"prompt": f"new request {i}", "max_tokens": 2})
        assert r.status == 200
    assert generation_requests(busy) == 1  # only the stream it already had
    assert generation_requests(other) == 8

    resp = await stream
    assert resp.status == 200
    text, usage, _, done_once = parse_stream(await resp.read())
    assert done_once and text == expected(stream_prompt, 40) and busy.finished == 1 and busy.aborted == 0

    # the operator takes it off the list (scale-in cancelled): it gets work again, live
    path.write_text(yaml.safe_dump({**h.config, "draining": []}))
    await wait_for(lambda: h.state.config.draining == ())
    for i in range(4):
        assert (await h.client.post("/v1/completions", json={"prompt": f"again {i}", "max_tokens": 2})).status == 200
    assert generation_requests(busy) == 3


@pytest.mark.parametrize("policy,params", [
    ("round_robin", {}), ("least_loaded", {}), ("disaggregated", {}), ("split", {}),
    ("load_aware", {}), ("load_aware", {"disaggregate": True}),
])
async def test_no_policy_sends_new_work_to_a_draining_instance(router_harness, policy, params):
    h = await router_harness(n=3, policy=make_policy(policy, params), config={"draining": ["e1"]})
    for i in range(9):
        r = await h.client.post("/v1/completions", json={"prompt": f"request {i} of a few", "max_tokens": 3})
        assert r.status == 200, await r.text()
    assert generation_requests(h.engine("e1")) == 0
    assert generation_requests(h.engine("e0")) + generation_requests(h.engine("e2")) >= 9


async def test_when_every_instance_drains_requests_get_503_and_readiness_drops(router_harness):
    h = await router_harness(n=2, policy=make_policy("least_loaded", {}), config={"draining": ["e0", "e1"]})
    r = await h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status == 503
    body = await r.json()
    assert body["error"]["type"] == "service_unavailable" and "no healthy instance" in body["error"]["message"]
    assert (await h.client.get("/ready")).status == 503
    text = await (await h.client.get("/metrics")).text()
    assert 'fulcrum_router_instance_draining{instance="e0",role="both"} 1.0' in text


async def test_a_draining_id_that_registers_later_is_drained_on_arrival(router_harness):
    h = await router_harness(n=2, policy=make_policy("round_robin", {}), config={"draining": ["late"]})
    st = h.state
    late = InstanceConfig(id="late", url=h.engines[0].url)
    st.apply_config(st.config.model_copy(update={"instances": (*st.config.instances, late)}))
    await wait_for(lambda: "late" in st.pool.ids())
    assert st.pool.state("late").draining and not st.pool.state("e0").draining
    for i in range(4):
        assert (await h.client.post("/v1/completions", json={"prompt": f"r{i}", "max_tokens": 2})).status == 200
    assert st.pool.state("late").inflight == 0 and len(h.engines[0].requests) == 2  # e0's own turns only
