"""Decode rescheduling in the live router (router config ``rescheduling``): a running request moves between FAKE
engines (tests/fakes/fake_engine.py) by a recompute migration, and the client sees one unbroken answer with the
tokens and usage of an unmigrated run."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings, fake_chat_ids, fake_encode, fake_next_token  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.rebalancing.decode_rescheduling import DecodeInstanceLoad  # noqa: E402
from fulcrum.router.config import ReschedulingSection  # noqa: E402
from fulcrum.routing.base import NO_CAPABILITIES, InstanceView, NoInstanceError, RequestInfo, RouteDecision  # noqa: E402
from fulcrum.routing.remaining_length import RemainingLengthPredictor  # noqa: E402
from fulcrum.router.rescheduler import Rescheduler  # noqa: E402

pytestmark = pytest.mark.asyncio

SLOW = FakeEngineSettings(token_delay_s=0.01)
NEVER = {"enabled": True, "interval_s": 3600}  # the loop's first period runs at start (nothing to do), then sleeps


class PinnedTestPolicy:
    """TEST DOUBLE policy: every request colocated on ``target`` (to overload one instance on purpose)."""

    name = "pinned-test-double"
    capabilities = NO_CAPABILITIES

    def __init__(self, target: str) -> None:
        self.target = target

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        if not any(v.id == self.target and v.available for v in instances):
            raise NoInstanceError("pinned instance unavailable")
        return RouteDecision("colocated", self.target, split_token=req.prompt_tokens + req.max_tokens, reason="pinned")

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        return None

    def on_finish(self, request_id: str, now: float) -> None:
        return None


def greedy(ids: list[int], n: int) -> str:
    seq = list(ids)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return bytes(seq[len(ids):]).decode()


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def counter(h, name: str, **labels: str) -> float:
    return h.state.metrics.registry.get_sample_value(name, labels) or 0.0


async def tracked_after(h, tokens: int):
    """The one tracked request once it has relayed ``tokens`` tokens."""
    rs = h.state.rescheduler
    await wait_for(lambda: len(rs.requests) == 1 and next(iter(rs.requests.values())).generated >= tokens)
    return next(iter(rs.requests.values()))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_forced_migration_mid_answer_gives_the_tokens_and_usage_of_an_unmigrated_run(router_harness, endpoint, stream):
    # 50 ms a token: the migration asked after token 10 must land before the 40th; at 10 ms a token that left 0.3 s,
    # which a busy 2-core machine's event loop sometimes overran (the answer ended unmigrated)
    h = await router_harness(n=2, settings=FakeEngineSettings(token_delay_s=0.05), policy=PinnedTestPolicy("e0"),
                             config={"rescheduling": NEVER})
    n = 40
    if endpoint == "completions":
        prompt = "migrate me while I am decoding"
        ids = fake_encode(prompt)
        path, body = "/v1/completions", {"prompt": prompt}
    else:
        msgs = [{"role": "user", "content": "migrate this chat"}]
        ids = fake_chat_ids(msgs)
        path, body = "/v1/chat/completions", {"messages": msgs}
    body.update(max_tokens=n, stream=stream, ignore_eos=True)
    if stream:
        body["stream_options"] = {"include_usage": True}
    task = asyncio.create_task(h.client.post(path, json=body))
    tr = await tracked_after(h, 10)
    assert h.state.rescheduler.request_migration(tr.request_id, "e1", "forced")
    resp = await task
    assert resp.status == 200
    if stream:
        text, usage, chunks, done_once = parse_stream(await resp.read())
        assert done_once
        assert len({c["id"] for c in chunks}) == 1  # one answer, one id, across both engines
    else:
        data = await resp.json()
        text, usage = answer_text(data), data["usage"]
        assert data["choices"][0]["finish_reason"] == "length"
    assert text == greedy(ids, n)
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
    e0, e1 = h.engines
    assert e0.aborted == 1 and e1.finished == 1  # A was cut, B finished the request
    cont = e1.requests[0]
    k = len(cont["prompt"]) - len(ids)
    assert 10 <= k < n and cont["prompt"][: len(ids)] == ids and cont["max_tokens"] == n - k
    assert counter(h, "fulcrum_router_migrations_total", reason="forced") == 1
    assert counter(h, "fulcrum_router_migrated_tokens_total") == len(ids) + k
    assert counter(h, "fulcrum_router_migration_seconds_count") == 1
    await wait_for(lambda: h.router_inflight() == 0 and h.engines_active() == 0)
    assert h.router_tokens() == (0, 0)
    assert not h.state.rescheduler.requests


async def test_the_loop_migrates_running_requests_off_an_overloaded_instance(router_harness):
    cfg = {"rescheduling": {"enabled": True, "interval_s": 0.05, "request_cooldown_s": 60, "instance_cooldown_s": 0.2}}
    h = await router_harness(n=2, settings=SLOW, policy=PinnedTestPolicy("e0"), config=cfg)
    prompts = [f"overload number {i}" for i in range(4)]
    tasks = [asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": p, "max_tokens": 80, "stream": True, "ignore_eos": True})) for p in prompts]
    await wait_for(lambda: counter(h, "fulcrum_router_migrations_total", reason="load") >= 1)
    texts = [parse_stream(await (await t).read())[0] for t in tasks]
    assert texts == [greedy(fake_encode(p), 80) for p in prompts]  # every stream intact
    moved = h.state.rescheduler.migrations
    assert moved and all(m.source == "e0" and m.target == "e1" and m.variance_after < m.variance_before for m in moved)
    assert len(moved) <= 2  # 4 equal requests: at most 2 moves balance them; the rest is hysteresis
    assert h.engines[1].requests  # the target really continued them


async def test_a_migration_whose_target_fails_resumes_on_the_source_and_the_stream_survives(router_harness):
    h = await router_harness(n=2, settings=SLOW, policy=PinnedTestPolicy("e0"), config={"rescheduling": NEVER})
    h.engine("e1").mode = "error500"
    prompt = "the target is broken"
    task = asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 30, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}))
    tr = await tracked_after(h, 5)
    h.state.rescheduler.request_migration(tr.request_id, "e1", "forced")
    text, usage, _, done_once = parse_stream(await (await task).read())
    assert done_once and text == greedy(fake_encode(prompt), 30)
    assert usage["completion_tokens"] == 30
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="source") == 1
    e0 = h.engine("e0")
    assert e0.aborted == 1 and e0.finished == 1 and len(e0.requests) == 2  # cut, then resumed by the continuation


async def test_a_migration_target_the_registry_dropped_resumes_on_the_source(router_harness, monkeypatch):
    # the target left the registry between the move's decision and its leg: acquire raises "no longer
    # registered" (an UpstreamFailure), which must resume the request, not end it (acquire ran outside the try)
    from fulcrum.router.upstream import UpstreamFailure

    h = await router_harness(n=2, settings=SLOW, policy=PinnedTestPolicy("e0"), config={"rescheduling": NEVER})
    pool = h.state.pool
    real_acquire = pool.acquire

    def acquire(iid, *args, **kwargs):
        if iid == "e1":
            raise UpstreamFailure(iid, "connect", f"{iid} is no longer registered", instance_fault=False)
        return real_acquire(iid, *args, **kwargs)

    monkeypatch.setattr(pool, "acquire", acquire)
    prompt = "the target is gone"
    task = asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 30, "stream": True, "ignore_eos": True}))
    tr = await tracked_after(h, 5)
    h.state.rescheduler.request_migration(tr.request_id, "e1", "forced")
    text, _, _, done_once = parse_stream(await (await task).read())
    assert done_once and text == greedy(fake_encode(prompt), 30)
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="source") == 1
    assert not h.engine("e1").requests
    await wait_for(lambda: h.router_inflight() == 0 and h.engines_active() == 0)


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_silent_mid_answer_past_idle_s_is_cut_and_the_request_resumes_elsewhere(
        router_harness, stream: bool) -> None:
    # idle_s bounds the silence between tokens (first_token_s only the wait for the first, here 20 times longer):
    # e0 goes quiet after a few tokens; a tracked request resumes on e1 with its tokens so far, and the client
    # gets one whole answer (before, the first engine's failure after its first token ended the request)
    timeouts = {"connect_s": 1.0, "first_token_s": 5.0, "idle_s": 0.25, "request_s": 10.0, "health_s": 1.0}
    h = await router_harness(n=2, settings=SLOW, policy=PinnedTestPolicy("e0"),
                             config={"rescheduling": NEVER, "timeouts": timeouts})
    prompt = "e0 goes quiet"
    task = asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 30, "stream": stream, "ignore_eos": True}))
    await tracked_after(h, 5)
    h.engine("e0").settings = dataclasses.replace(SLOW, token_delay_s=2.0)  # its own settings: e1 stays quick
    resp = await task
    if stream:
        text, _, chunks, done_once = parse_stream(await resp.read())
        assert done_once and not any("error" in c for c in chunks)
    else:
        text = answer_text(await resp.json())
    assert text == greedy(fake_encode(prompt), 30)
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="timeout") == 1
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="other") == 1
    e1 = h.engine("e1")
    assert e1.finished == 1 and len(e1.requests[0]["prompt"]) > len(fake_encode(prompt))  # the continuation


async def test_a_failed_target_is_replaced_by_another_healthy_instance_when_there_is_one(router_harness):
    h = await router_harness(n=3, settings=SLOW, policy=PinnedTestPolicy("e0"), config={"rescheduling": NEVER})
    h.engine("e1").mode = "error500"
    prompt = "three engines"
    task = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30, "ignore_eos": True}))
    tr = await tracked_after(h, 5)
    h.state.rescheduler.request_migration(tr.request_id, "e1", "forced")
    data = await (await task).json()
    assert answer_text(data) == greedy(fake_encode(prompt), 30) and data["usage"]["completion_tokens"] == 30
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="other") == 1
    assert h.engine("e2").finished == 1


async def test_requests_that_cannot_continue_elsewhere_run_as_before_and_are_not_tracked(router_harness):
    h = await router_harness(n=2, settings=SLOW, policy=PinnedTestPolicy("e0"), config={"rescheduling": NEVER})
    task = asyncio.create_task(h.client.post("/v1/completions", json={
        "prompt": "stop strings pin a request", "max_tokens": 20, "stop": ["zzz"], "stream": True}))
    await wait_for(lambda: h.engines_active() == 1)
    assert not h.state.rescheduler.requests
    assert (await task).status == 200
    assert "return_token_ids" not in h.engine("e0").requests[0]


async def test_the_planner_sees_untracked_work_as_a_pinned_load_and_never_moves_it():
    rs = Rescheduler(RemainingLengthPredictor(), clock=lambda: 0.0)
    rs.track("r1", "m", "a", 1000, 4000)  # nothing observed yet: N̂ = the cap, past the horizon
    views = [InstanceView("a", running_tokens=5000), InstanceView("b")]
    loads, pinned = rs.loads(views, ReschedulingSection(), 0.0)
    by_id: dict[str, DecodeInstanceLoad] = {x.id: x for x in loads}
    assert by_id["a"].tokens == 5000 and by_id["b"].tokens == 0
    assert "_untracked:a" in pinned and "r1" not in pinned
    # b_t of the recompute filter counts every request in flight, not the one entry the untracked rest makes
    busy = [InstanceView("a", running_tokens=5000, inflight=7), InstanceView("b", inflight=3)]
    batches = {x.id: x.batch_size for x in rs.loads(busy, ReschedulingSection(), 0.0)[0]}
    assert batches == {"a": 7, "b": 3}
    assert {x.id: x.batch_size for x in loads} == {"a": 2, "b": 0}  # inflight unknown: what is listed
    plan = rs.step(views, ReschedulingSection(), 0.0)
    assert plan is not None and plan.request_id == "r1" and plan.target == "b"
    assert rs.requests["r1"].target == "b"
    assert rs.step(views, ReschedulingSection(), 0.5) is None  # already marked: pinned until it moved
