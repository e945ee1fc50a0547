"""Router leftovers of session 23, each reproduced on FAKE engines (tests/fakes/fake_engine.py): unknown paths and
wrong methods in OpenAI's error shape, prompts the engine would refuse as empty, a malformed engine answer on the
decode-rescheduling leg (and a broken stream there counted once), and an engine's 429 retried on another instance."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from aiohttp import web  # noqa: E402

from fakes.fake_engine import FakeEngineSettings, fake_encode, fake_next_token  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from test_router_rescheduling import PinnedTestPolicy, tracked_after  # noqa: E402

pytestmark = pytest.mark.asyncio


def _openai_error(data: object) -> dict:
    assert isinstance(data, dict) and set(data) == {"error"}
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def counter(h, name: str, **labels: str) -> float:
    return h.state.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------------ unknown paths, wrong methods
@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/")])
async def test_an_unknown_path_is_a_404_in_openais_error_shape(router_harness, method, path):
    h = await router_harness()
    r = await h.client.request(method, path)
    assert r.status == 404 and r.content_type == "application/json"
    err = _openai_error(await r.json())
    assert err["type"] == "invalid_request_error" and path in err["message"]


@pytest.mark.parametrize("method,path,allowed", [("GET", "/v1/completions", "POST"),
                                                 ("GET", "/v1/chat/completions", "POST"),
                                                 ("POST", "/metrics", "GET"), ("DELETE", "/health", "GET")])
async def test_a_wrong_method_is_a_405_in_openais_error_shape_keeping_its_allow_header(router_harness, method, path,
                                                                                       allowed):
    h = await router_harness()
    r = await h.client.request(method, path)
    assert r.status == 405 and r.content_type == "application/json"
    assert allowed in r.headers["Allow"]
    err = _openai_error(await r.json())
    assert err["type"] == "invalid_request_error" and method in err["message"] and allowed in err["message"]


async def test_the_known_routes_still_answer_as_before_next_to_the_error_middleware(router_harness):
    h = await router_harness()
    assert (await h.client.get("/health")).status == 200
    assert (await h.client.get("/ready")).status == 200
    m = await h.client.get("/metrics")
    assert m.status == 200 and m.content_type == "text/plain"
    r = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status == 200 and len(answer_text(await r.json())) == 3


# ------------------------------------------------------------------------------------ empty prompts
@pytest.mark.parametrize("prompt", ["", [""]])
async def test_a_text_prompt_the_tokenizer_makes_empty_is_a_400_and_never_reaches_the_engine(router_harness, prompt):
    # vLLM refuses a prompt of zero tokens ("The decoder prompt cannot be empty"); the fake tokenizer has no BOS, so
    # "" is zero tokens, as on GPT-2 or Qwen (a BOS-adding tokenizer makes "" one token, and vLLM serves it)
    h = await router_harness()
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert r.status == 400
    err = _openai_error(await r.json())
    assert err["param"] == "prompt" and "prompt must not be empty" in err["message"]
    assert all(not e.requests for e in h.engines)
    assert counter(h, "fulcrum_router_responses_total", endpoint="completions", status="400") == 1


@pytest.mark.parametrize("prompt", [[], [[]]])
async def test_an_empty_token_id_list_is_still_a_400(router_harness, prompt):
    h = await router_harness()
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert r.status == 400 and "prompt must not be empty" in _openai_error(await r.json())["message"]


async def test_an_empty_text_prompt_that_tokenizes_to_something_is_served(router_harness):
    # e.g. a tokenizer that adds BOS: vLLM serves "", so the router must not refuse it by its text alone
    h = await router_harness()
    real_post_json = h.state.pool.post_json

    async def post_json(iid, path, body, *args, **kwargs):
        if path == "/tokenize" and body.get("prompt") == "":
            return 200, b"", {"tokens": [1], "count": 1, "max_model_len": 4096}
        return await real_post_json(iid, path, body, *args, **kwargs)

    h.state.pool.post_json = post_json
    r = await h.client.post("/v1/completions", json={"prompt": "", "max_tokens": 3})
    assert r.status == 200


async def test_a_chat_message_with_empty_content_is_served(router_harness):
    # OpenAI and vLLM accept empty content: the template still makes a prompt
    h = await router_harness()
    r = await h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}],
                                                         "max_tokens": 3})
    assert r.status == 200


async def test_an_empty_text_prompt_is_forwarded_when_the_router_only_estimates_lengths(router_harness):
    # without the tokenizer the router cannot know the engine's count: the engine decides (its 400 is relayed)
    h = await router_harness(config={"token_count": "estimate"})
    r = await h.client.post("/v1/completions", json={"prompt": "", "max_tokens": 3})
    assert r.status in (200, 400)
    assert sum(len(e.requests) for e in h.engines) == 1


# ------------------------------------------------------------------------------------ the rescheduling leg's answers
class _CannedStream:
    """TEST DOUBLE of an engine's streamed 200 answer: the given SSE bytes, one piece per read."""

    status = 200

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        self.content = self

    async def iter_any(self):
        for p in self._pieces:
            yield p

    async def read(self) -> bytes:
        return b"".join(self._pieces)

    def close(self) -> None:
        return None


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _greedy_events(prompt_ids: list[int], n: int) -> tuple[list[bytes], list[int]]:
    """n well-formed completion chunks with token ids, as the fake engine generates them greedily."""
    seq, out = list(prompt_ids), []
    for _ in range(n):
        tok = fake_next_token(seq)
        seq.append(tok)
        out.append(_event({"id": "cmpl-x", "object": "text_completion", "choices": [
            {"index": 0, "text": bytes([tok]).decode(), "token_ids": [tok], "finish_reason": None}]}))
    return out, seq[len(prompt_ids):]


def _serve_first_call_with(h, monkeypatch, pieces: list[bytes]) -> list[str]:
    """The first engine call the router opens gets ``pieces``; later calls reach the fake engines. Returns the
    instances called, in order."""
    transport = h.state.pool.transport  # the seam below the pool: the pool's own accounting still runs
    real_open = transport.open
    called: list[str] = []

    @asynccontextmanager
    async def open_(iid, base, path, body, deadline):
        called.append(iid)
        if len(called) == 1:
            yield _CannedStream(pieces)
            return
        async with real_open(iid, base, path, body, deadline) as resp:
            yield resp

    monkeypatch.setattr(transport, "open", open_)
    return called


RESCHEDULING = {"rescheduling": {"enabled": True, "interval_s": 3600}}


@pytest.mark.parametrize("bad", [
    {"choices": [1]},
    {"choices": "none"},
    {"choices": [{"index": 0, "text": 5, "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "a", "token_ids": ["97"], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "a", "token_ids": [-1], "finish_reason": None}]},
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_first_answer_on_the_rescheduling_leg_is_a_broken_instance_and_the_request_is_retried(
        router_harness, monkeypatch, bad, stream):
    h = await router_harness(n=2, config=RESCHEDULING)
    called = _serve_first_call_with(h, monkeypatch, [_event(bad), b"data: [DONE]\n\n"])
    prompt = "malformed"
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                                                     "stream": stream})
    assert r.status == 200
    text = parse_stream(await r.read())[0] if stream else answer_text(await r.json())
    _, want = _greedy_events(fake_encode(prompt), 8)
    assert text == bytes(want).decode()
    assert len(called) == 2 and called[0] != called[1]
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="broken") == 1
    assert not h.state.pool.state(called[0]).available(h.state.clock())  # ejected, as on the split path
    assert counter(h, "fulcrum_router_retries_total", stage="before-stream") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_answer_mid_way_on_the_rescheduling_leg_resumes_the_request_elsewhere(
        router_harness, monkeypatch, stream):
    h = await router_harness(n=2, config=RESCHEDULING)
    prompt = "cut by a bad chunk"
    good, _ = _greedy_events(fake_encode(prompt), 5)
    bad = _event({"choices": [{"index": 0, "text": "z", "token_ids": ["oops"], "finish_reason": None}]})
    called = _serve_first_call_with(h, monkeypatch, [*good, bad, b"data: [DONE]\n\n"])
    r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "ignore_eos": True,
                                                     "stream": stream})
    assert r.status == 200
    if stream:
        text, _, chunks, done_once = parse_stream(await r.read())
        assert done_once and not any("error" in c for c in chunks)
    else:
        text = answer_text(await r.json())
    _, want = _greedy_events(fake_encode(prompt), 20)
    assert text == bytes(want).decode()
    assert len(called) == 2 and called[0] != called[1]
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="broken") == 1
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="other") == 1
    resumed = h.engine(called[1]).requests[0]["prompt"]
    assert resumed == fake_encode(prompt) + want[:5]  # the continuation: P + the 5 tokens relayed before


# ------------------------------------------------------------------------------------ an engine's 429
def _too_busy(h, monkeypatch, busy: set[str]) -> None:
    """The engines in ``busy`` answer every generation call 429 (too many requests, with ``Retry-After: 3``), as
    a rate-limiting proxy in front of vLLM does; each call is counted in the engine's ``requests``."""
    for iid in busy:
        eng = h.engine(iid)

        async def too_many(request, _eng=eng):
            _eng.requests.append({})
            return web.json_response({"error": {"message": "too many requests", "type": "rate_limit_error",
                                                 "param": None, "code": 429}}, status=429, headers={"Retry-After": "3"})

        monkeypatch.setattr(eng, "_serve", lambda request, chat, _f=too_many: _f(request))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("rescheduling", [False, True])
async def test_an_engines_429_before_anything_was_streamed_is_retried_on_another_instance(
        router_harness, monkeypatch, stream, rescheduling):
    h = await router_harness(n=2, config=RESCHEDULING if rescheduling else {})
    _too_busy(h, monkeypatch, {"e0"})
    r = await h.client.post("/v1/completions", json={"prompt": "busy", "max_tokens": 4, "stream": stream})
    assert r.status == 200  # the round-robin fake policy tries e0 first
    text = parse_stream(await r.read())[0] if stream else answer_text(await r.json())
    assert len(text) == 4
    assert len(h.engine("e0").requests) == 1 and len(h.engine("e1").requests) == 1
    assert counter(h, "fulcrum_router_retries_total", stage="before-stream") == 1
    assert h.state.pool.state("e0").available(h.state.clock())  # busy is not broken: not ejected
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="status") == 0


async def test_an_engines_429_is_relayed_when_no_other_instance_can_take_the_request(router_harness, monkeypatch):
    h = await router_harness(n=2)
    _too_busy(h, monkeypatch, {"e0", "e1"})
    r = await h.client.post("/v1/completions", json={"prompt": "all busy", "max_tokens": 4})
    assert r.status == 429
    assert (await r.json())["error"]["message"] == "too many requests"
    assert len(h.engine("e0").requests) == 1 and len(h.engine("e1").requests) == 1
    assert counter(h, "fulcrum_router_responses_total", endpoint="completions", status="429") == 1


async def test_an_engines_429_retries_stay_within_max_retries(router_harness, monkeypatch):
    h = await router_harness(n=3, config={"max_retries": 1})
    _too_busy(h, monkeypatch, {"e0", "e1", "e2"})
    r = await h.client.post("/v1/completions", json={"prompt": "all busy", "max_tokens": 4})
    assert r.status == 429
    assert sum(len(e.requests) for e in h.engines) == 2  # the first try and one retry
    assert counter(h, "fulcrum_router_retries_total", stage="before-stream") == 1


async def test_a_prefill_legs_429_is_retried_without_both_instances_of_the_handoff(router_harness, monkeypatch):
    h = await router_harness(n=3, policy=FakePolicy("disaggregated"))
    _too_busy(h, monkeypatch, {"e0"})
    r = await h.client.post("/v1/completions", json={"prompt": "prefill busy", "max_tokens": 4})
    assert r.status == 200 and len(answer_text(await r.json())) == 4
    # A (e0) answered 429 to the prefill leg; the retry leaves out A and B (e1), so e2 serves it alone
    assert len(h.engine("e0").requests) == 1 and not h.engine("e1").requests and len(h.engine("e2").requests) == 1


@pytest.mark.parametrize("pieces", [
    [b"data: {not json\n\n", b"data: [DONE]\n\n"],  # an event that is not JSON
    [],  # the stream ended before [DONE]
])
async def test_a_broken_stream_on_the_rescheduling_leg_is_counted_once(router_harness, monkeypatch, pieces):
    # the pool records a failure raised inside its open() already; the leg recorded it a second time
    h = await router_harness(n=2, config=RESCHEDULING)
    called = _serve_first_call_with(h, monkeypatch, pieces)
    r = await h.client.post("/v1/completions", json={"prompt": "broken", "max_tokens": 4})
    assert r.status == 200 and len(answer_text(await r.json())) == 4
    assert len(called) == 2
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="broken") == 1


async def test_a_migration_targets_429_resumes_elsewhere_without_counting_against_the_target(router_harness,
                                                                                          monkeypatch):
    h = await router_harness(n=2, settings=FakeEngineSettings(token_delay_s=0.01), policy=PinnedTestPolicy("e0"),
                             config=RESCHEDULING)
    _too_busy(h, monkeypatch, {"e1"})
    prompt = "the target is busy"
    task = asyncio.create_task(h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30,
                                                                      "ignore_eos": True}))
    tr = await tracked_after(h, 5)
    h.state.rescheduler.request_migration(tr.request_id, "e1", "forced")
    r = await task
    _, want = _greedy_events(fake_encode(prompt), 30)
    assert r.status == 200 and answer_text(await r.json()) == bytes(want).decode()
    assert counter(h, "fulcrum_router_migration_fallbacks_total", to="source") == 1
    assert counter(h, "fulcrum_router_upstream_errors_total", cause="status") == 0  # busy is not broken
    assert h.state.pool.state("e1").consecutive_failures == 0
