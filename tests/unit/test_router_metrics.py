"""The router's fulcrum_router_* metrics after real traffic through FAKE engines."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fakes.fake_engine import FakeEngineSettings  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402

pytestmark = pytest.mark.asyncio


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_traffic_shows_up_in_every_router_metric(router_harness):
    h = await router_harness(policy=FakePolicy("split", 3, pair=("e0", "e1")),
                             settings=FakeEngineSettings(token_delay_s=0.001))
    for stream in (False, True):
        r = await h.client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 10, "stream": stream})
        assert r.status == 200
        await r.read()
    h.policy.kind = "disaggregated"
    await (await h.client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 10, "stream": True})).read()
    h.policy.kind = "colocated"
    await (await h.client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 10})).read()
    await (await h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})).read()
    text = (await (await h.client.get("/metrics")).read()).decode()
    s = samples(text)
    assert s[("fulcrum_router_requests_admitted_total", (("endpoint", "completions"),))] == 4
    assert s[("fulcrum_router_responses_total", (("endpoint", "completions"), ("status", "400")))] == 1
    assert s[("fulcrum_router_input_tokens_count", ())] == 4 and s[("fulcrum_router_input_tokens_sum", ())] == 16
    assert s[("fulcrum_router_output_tokens_sum", ())] == 40
    assert s[("fulcrum_router_predicted_output_tokens_count", ())] == 4
    assert s[("fulcrum_router_ttft_seconds_count", ())] == 2  # the two streams
    assert s[("fulcrum_router_itl_seconds_count", ())] > 0 and s[("fulcrum_router_tpot_seconds_count", ())] == 2
    assert s[("fulcrum_router_e2e_seconds_count", ())] == 4
    for kind, n in (("split", 2), ("disaggregated", 1), ("colocated", 1)):
        assert s[("fulcrum_router_routed_requests_total", (("kind", kind),))] == n
    assert s[("fulcrum_router_policy_decisions_total", (("kind", "split"), ("policy", "fake"), ("reason", "fake")))] == 2
    assert s[("fulcrum_router_split_ratio_count", ())] == 2
    assert s[("fulcrum_router_handoff_seconds_count", (("kind", "split"),))] == 1  # streamed split
    assert s[("fulcrum_router_handoff_seconds_count", (("kind", "disaggregated"),))] == 1
    assert s[("fulcrum_router_kv_transfer_seconds_count", (("kind", "split"),))] == 1
    for name in ("inflight", "queued_prefill_tokens", "running_tokens"):
        assert s[(f"fulcrum_router_instance_{name}", (("instance", "e0"), ("role", "both")))] == 0
    assert s[("fulcrum_router_instance_healthy", (("instance", "e1"), ("role", "both")))] == 1


async def test_per_instance_load_is_visible_while_requests_run(router_harness):
    import asyncio

    h = await router_harness(n=1, settings=FakeEngineSettings(token_delay_s=0.05))
    task = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": [1] * 20, "max_tokens": 40}))
    for _ in range(100):
        await asyncio.sleep(0.02)
        if h.engines[0].active:
            break
    s = samples(h.state.metrics.exposition().decode())
    assert s[("fulcrum_router_instance_inflight", (("instance", "e0"), ("role", "both")))] == 1
    assert s[("fulcrum_router_instance_queued_prefill_tokens", (("instance", "e0"), ("role", "both")))] == 20
    r = await task
    assert r.status == 200
    s = samples(h.state.metrics.exposition().decode())
    assert s[("fulcrum_router_instance_inflight", (("instance", "e0"), ("role", "both")))] == 0


async def test_ejections_are_counted_by_instance_and_cause(router_harness):
    h = await router_harness()
    await h.engine("e0").stop()
    for _ in range(2):
        await (await h.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})).read()
    s = samples(h.state.metrics.exposition().decode())
    assert s[("fulcrum_router_ejections_total", (("cause", "connect"), ("instance", "e0")))] == 1
    assert s[("fulcrum_router_retries_total", (("stage", "before-stream"),))] == 1


async def test_the_router_learns_output_lengths_per_served_model(router_harness):
    """Libra §4.1's output-length estimate is per model: what one model generated does not move another's."""
    h = await router_harness()
    for _ in range(3):
        r = await h.client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 7})
        assert r.status == 200
    learned = h.state.predictor.for_model("fake-model")
    assert learned.estimate(len("hello there")) == 7
    assert h.state.predictor.for_model("another-model").estimate(len("hello there")) is None
