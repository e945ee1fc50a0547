"""Router leftovers, wave 2, each reproduced on FAKE engines (tests/fakes/fake_engine.py) or on the pure planner
inputs: an engine's 429 relayed with its ``Retry-After``, a busy ``/tokenize`` that is not the prompt's fault, the
policies' per-instance state dropped when an instance leaves, and the untracked work that counts at t = H."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from aiohttp import web  # noqa: E402

from fakes.fake_engine import fake_encode  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fulcrum.rebalancing.decode_rescheduling import future_loads  # noqa: E402
from fulcrum.router.config import ReschedulingSection, parse_config  # noqa: E402
from fulcrum.router.rescheduler import Rescheduler  # noqa: E402
from fulcrum.router.upstream import busy_body, retry_after_of  # noqa: E402
from fulcrum.routing.base import InstanceView  # noqa: E402
from fulcrum.routing.registry import make_policy  # noqa: E402
from fulcrum.routing.remaining_length import RemainingLengthPredictor  # noqa: E402
from test_router_errors_and_retries import RESCHEDULING, _too_busy  # noqa: E402

pytestmark = pytest.mark.asyncio


async def wait_for(predicate, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------ 1. Retry-After on a 429
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("rescheduling", [False, True])
async def test_a_relayed_429_keeps_the_engines_retry_after(router_harness, monkeypatch, stream, rescheduling):
    h = await router_harness(n=2, config=RESCHEDULING if rescheduling else {})
    _too_busy(h, monkeypatch, {"e0", "e1"})  # both answer 429 with Retry-After: 3
    r = await h.client.post("/v1/completions", json={"prompt": "all busy", "max_tokens": 4, "stream": stream})
    assert r.status == 429
    assert r.headers.get("Retry-After") == "3"
    assert (await r.json())["error"]["message"] == "too many requests"


async def test_a_prefill_legs_relayed_429_keeps_the_engines_retry_after(router_harness, monkeypatch):
    h = await router_harness(n=2, policy=FakePolicy("disaggregated"), config={"max_retries": 0})
    _too_busy(h, monkeypatch, {"e0", "e1"})
    r = await h.client.post("/v1/completions", json={"prompt": "prefill busy", "max_tokens": 4})
    assert r.status == 429 and r.headers.get("Retry-After") == "3"


async def test_a_429_without_retry_after_is_relayed_without_one(router_harness, monkeypatch):
    h = await router_harness(n=1)
    eng = h.engine("e0")

    async def too_many(request):
        return web.json_response({"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                            "code": 429}}, status=429)

    monkeypatch.setattr(eng, "_serve", lambda request, chat: too_many(request))
    r = await h.client.post("/v1/completions", json={"prompt": "busy", "max_tokens": 4})
    assert r.status == 429 and "Retry-After" not in r.headers


@pytest.mark.parametrize("value,kept", [("3", "3"), (" 120 ", "120"), ("Sun, 06 Nov 1994 08:49:37 GMT", None),
                                         ("soon", False), ("-1", False), ("1.5", False), ("", False),
                                         ("99999999999", False), ("\u0663", False)])
async def test_only_a_valid_retry_after_rides_on_the_body(value, kept):
    out = busy_body(b'{"error": {}}', value)
    assert out == b'{"error": {}}'
    want = value if kept is None else (kept or None)
    assert retry_after_of(out) == want
    assert (type(out) is bytes) == (want is None)


async def test_answers_other_than_429_come_back_as_plain_bytes(router_harness):
    h = await router_harness(n=1)
    status, raw, _ = await h.state.pool.fetch("e0", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and type(raw) is bytes and retry_after_of(raw) is None


# ------------------------------------------------------------------------------------ 2. a busy /tokenize
def _busy_tokenizer(h, monkeypatch, busy: set[str]) -> dict[str, int]:
    """The engines in ``busy`` answer ``/tokenize`` 429 (their generation endpoints still serve); returns the
    count of ``/tokenize`` calls per engine."""
    calls = {e.engine_id: 0 for e in h.engines}
    for eng in h.engines:
        original = eng._body

        async def body(request, _eng=eng, _orig=original):
            if request.path == "/tokenize":
                calls[_eng.engine_id] += 1
                if _eng.engine_id in busy:
                    return web.json_response({"error": {"message": "too many requests", "type": "rate_limit_error",
                                                        "param": None, "code": 429}}, status=429)
            return await _orig(request)

        monkeypatch.setattr(eng, "_body", body)
    return calls


async def test_a_busy_tokenizer_is_not_the_prompts_fault_and_the_next_instance_counts_it(router_harness, monkeypatch):
    h = await router_harness(n=2)
    calls = _busy_tokenizer(h, monkeypatch, {"e0"})
    prompt = "a prompt of 31 bytes, say hello"
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status == 200
    if calls["e0"] == 1:  # the side-call rotation asked e0 first: then e1, whose count is exact
        assert calls["e1"] == 1
    _, d = h.policy.started[-1]
    assert d.split_token - 4 == len(fake_encode(prompt))  # the exact count (split_token = P + max_tokens)


async def test_a_busy_tokenizer_everywhere_falls_back_to_the_estimate(router_harness, monkeypatch):
    h = await router_harness(n=2)
    calls = _busy_tokenizer(h, monkeypatch, {"e0", "e1"})
    prompt = "a prompt of 31 bytes, say hello"
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status == 200 and len((await r.json())["choices"][0]["text"]) == 4
    assert calls == {"e0": 1, "e1": 1}
    _, d = h.policy.started[-1]
    assert d.split_token - 4 == -(-len(prompt.encode()) // 4)  # the byte estimate: 8 tokens, not 31
    assert h.state.pool.state("e0").available(h.state.clock())  # busy is not broken: not ejected


# ------------------------------------------------------------------------------------ 3. an instance leaves
async def _drop_e1(h) -> None:
    cfg = dict(h.config)
    cfg["instances"] = [i for i in cfg["instances"] if i["id"] != "e1"]
    h.state.apply_config(parse_config(cfg))
    await wait_for(lambda: "e1" not in h.state.pool)


@pytest.mark.parametrize("name", ["load_aware", "disaggregated"])
async def test_an_instance_that_leaves_leaves_no_prefix_index_behind(router_harness, name):
    h = await router_harness(n=2, policy=make_policy(name, {}))
    index = h.policy.index
    index.record("e0", [1, 2, 3])
    index.record("e1", [1, 2, 3])
    await _drop_e1(h)
    assert index.leading("e1", [1, 2, 3]) == 0 and "e1" not in index._held
    assert index.leading("e0", [1, 2, 3]) == 3  # the instances that stay keep theirs


async def test_an_instance_that_leaves_leaves_no_virtual_queue_behind(router_harness):
    h = await router_harness(n=2, policy=make_policy("split", {"profile": "splitwise-llama2-70b-h100"}))
    pred = h.policy.predictor
    pred.instance("e0", 1, 2048, 256)
    pred.instance("e1", 1, 2048, 256)
    await _drop_e1(h)
    assert pred.get("e1") is None and pred.get("e0") is not None


async def test_an_instance_that_returns_after_leaving_is_routed_as_new(router_harness):
    h = await router_harness(n=2, policy=make_policy("load_aware", {}))
    h.policy.index.record("e1", [7])
    full = parse_config(h.config)
    await _drop_e1(h)
    h.state.apply_config(full)
    await wait_for(lambda: "e1" in h.state.pool)
    assert h.policy.index.leading("e1", [7]) == 0
    r = await h.client.post("/v1/completions", json={"prompt": "back again", "max_tokens": 2})
    assert r.status == 200


# ------------------------------------------------------------------------------------ 4. untracked work at t = H
async def test_untracked_work_still_counts_at_the_last_horizon_point():
    rs = Rescheduler(RemainingLengthPredictor(), clock=lambda: 0.0)
    section = ReschedulingSection()
    loads, _ = rs.loads([InstanceView("a", running_tokens=5000), InstanceView("b")], section, 0.0)
    cfg = section.planner()
    at = future_loads(loads, cfg)  # (instances, points + 1); the last column is t = H
    a = next(i for i, x in enumerate(loads) if x.id == "a")
    assert cfg.times()[-1] == section.horizon_steps
    assert at[a, -1] == 5000 + section.horizon_steps  # N(r) + t at t = H, as ARES eq. (4)'s sum to H counts it
    untracked = next(r for r in loads[a].requests if r.id == "_untracked:a")
    assert untracked.predicted_remaining == section.horizon_steps + 1  # as the replay's current_only
