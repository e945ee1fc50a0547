"""Fuzzing the router's HTTP surface (hypothesis): over 10,000 generated requests, valid and not, through the
router to FAKE engines, with routing kinds drawn too (colocated, disaggregated, split after k tokens).

Every answer must be a 2xx or 4xx with a well-formed body (JSON error shape, or a stream ending in [DONE]);
never a 5xx. After every batch the router has nothing in flight and the engines run nothing: no leaked
upstream work. The router serves one event loop in-process (aiohttp's test server), so the run is fast.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

pytest.importorskip("aiohttp")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fakes.fake_engine import FakeEngineSettings  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.router_harness import RouterHarness  # noqa: E402
from fakes.sse_client import parse_stream  # noqa: E402

BATCH = 12
EXAMPLES = 850  # 850 batches x 12 requests = 10,200 requests

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
odd_int = st.one_of(st.integers(-5, 300), st.integers(-(2**63), 2**63), st.just(0))
token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=40)
prompt = st.one_of(st.text(max_size=60), token_ids, st.lists(st.text(max_size=10), min_size=1, max_size=2),
                   st.lists(token_ids, min_size=1, max_size=2), json_value)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.one_of(st.text(max_size=40), st.none(),
                                                      st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2))})
messages = st.one_of(st.lists(message, min_size=1, max_size=3), json_value)
options = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(1, 24), odd_int, json_value),
    "max_completion_tokens": st.one_of(st.integers(1, 24), odd_int),
    "stream": st.one_of(st.booleans(), json_value),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_value),
    "temperature": st.one_of(st.floats(0, 2), json_value),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "n": st.one_of(st.integers(1, 2), odd_int),
    "model": st.one_of(st.just("fake-model"), st.text(max_size=8)),
    "logprobs": st.one_of(st.integers(0, 2), st.booleans()),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 4),
    "top_k": json_value,
    "kv_transfer_params": json_value,
})
valid_completion = st.builds(lambda p, o: {"prompt": p, **o, "max_tokens": o.get("max_tokens", 8) if isinstance(o.get("max_tokens"), int) and 0 < o["max_tokens"] < 25 else 8},
                             st.one_of(st.text(min_size=1, max_size=60), token_ids), options)
any_completion = st.builds(lambda p, o: {"prompt": p, **o}, prompt, options)
any_chat = st.builds(lambda m, o: {"messages": m, **o}, messages, options)
raw_body = st.one_of(st.binary(max_size=80), st.text(max_size=80).map(str.encode),
                     json_value.map(lambda v: json.dumps(v).encode()))

request = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_completion.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/completions"), any_completion.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/chat/completions"), any_chat.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/nope"]), raw_body),
)
routing = st.tuples(st.sampled_from(["colocated", "disaggregated", "split"]), st.integers(0, 20))


def check_answer(status: int, ctype: str, raw: bytes) -> None:
    assert status < 500, (status, raw[:300])
    if status == 404 and not raw.startswith(b"{"):
        return  # aiohttp's own 404 for an unknown path
    if ctype.startswith("text/event-stream"):
        assert status == 200
        _, _, chunks, done_once = parse_stream(raw)
        assert done_once, raw[-200:]
        assert not any("error" in c for c in chunks), raw[:300]
        return
    data = json.loads(raw)
    if status >= 400:
        assert set(data["error"]) == {"message", "type", "param", "code"}, data
    else:
        assert data["choices"] and "usage" in data


@pytest.mark.slow
def test_ten_thousand_generated_requests_give_no_5xx_no_crash_and_no_leaked_work():
    loop = asyncio.new_event_loop()
    harness = RouterHarness()
    loop.run_until_complete(harness.start(n=3, settings=FakeEngineSettings(max_model_len=256),
                                          policy=FakePolicy("colocated")))
    client = harness.client
    assert client is not None
    sent = {"requests": 0, "by_status": {}}

    async def one(path: str, raw: bytes) -> None:
        async with client.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
            body = await r.read()
            check_answer(r.status, r.headers.get("Content-Type", ""), body)
            sent["by_status"][r.status] = sent["by_status"].get(r.status, 0) + 1

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(request, min_size=BATCH, max_size=BATCH), route=routing)
    def fuzz(batch: list[tuple[str, bytes]], route: tuple[str, int]) -> None:
        harness.policy.kind, harness.policy.k = route
        async def run_batch() -> None:
            await asyncio.gather(*(one(p, b) for p, b in batch))

        loop.run_until_complete(run_batch())
        sent["requests"] += len(batch)
        assert harness.router_inflight() == 0 and harness.router_tokens() == (0, 0)
        assert harness.engines_active() == 0
        assert not any(e.crashed or e.kv_mismatches for e in harness.engines)

    try:
        fuzz()
        r = loop.run_until_complete(client.get("/health"))
        assert r.status == 200
        ok = sum(v for k, v in sent["by_status"].items() if k == 200)
        assert sent["requests"] >= 10_000, sent
        # the fuzz reached the engines a good share of the time, not only the validator
        assert ok >= 0.2 * sent["requests"], sent
        assert not math.isnan(ok)
    finally:
        loop.run_until_complete(harness.close())
        loop.close()
    print(f"fuzz: {sent['requests']} requests, statuses {dict(sorted(sent['by_status'].items()))}")
