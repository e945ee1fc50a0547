"""The router's HTTP surface on FAKE engines: each endpoint, streaming relay, usage, and bad input answers."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")
pytest_asyncio = pytest.importorskip("pytest_asyncio")

from fakes.fake_engine import FakeEngineSettings, fake_chat_ids  # noqa: E402
from fakes.sse_client import answer_text, parse_stream  # noqa: E402

pytestmark = pytest.mark.asyncio


async def test_completions_are_relayed_with_the_engines_usage(router_harness):
    h = await router_harness()
    r = await h.client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 7})
    assert r.status == 200 and r.content_type == "application/json"
    data = await r.json()
    assert data["object"] == "text_completion" and len(answer_text(data)) == 7
    assert data["usage"] == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    assert "kv_transfer_params" not in h.engines[0].requests[0]


async def test_a_completions_request_without_max_tokens_gets_openais_default_of_16(router_harness):
    h = await router_harness()
    data = await (await h.client.post("/v1/completions", json={"prompt": "x"})).json()
    assert data["usage"]["completion_tokens"] == 16


async def test_chat_completions_are_relayed(router_harness):
    h = await router_harness()
    r = await h.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    data = await r.json()
    assert r.status == 200 and data["object"] == "chat.completion"
    assert len(data["choices"][0]["message"]["content"]) == 5


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "stream me", "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 12}),
])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_streams_are_relayed_whole_and_carry_usage_only_when_asked(router_harness, path, body, include_usage):
    h = await router_harness()
    req = dict(body, stream=True)
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    r = await h.client.post(path, json=req)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    text, usage, chunks, done_once = parse_stream(await r.read())
    assert done_once and len(text) == 12
    if include_usage:
        assert usage is not None and usage["completion_tokens"] == 12
    else:
        assert usage is None and all("usage" not in c or c["usage"] is None for c in chunks)
    # the router always asks the engine for usage (it needs the true output length)
    assert h.engines[0].requests[0]["stream_options"]["include_usage"] is True


async def test_unknown_fields_reach_the_engine_untouched(router_harness):
    h = await router_harness()
    await h.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "top_k": 5, "ignore_eos": True,
                                                 "structured_outputs": {"regex": "[a-z]+"}})
    sent = h.engines[0].requests[0]
    assert sent["top_k"] == 5 and sent["ignore_eos"] is True and sent["structured_outputs"] == {"regex": "[a-z]+"}


async def test_models_health_ready_and_metrics_answer(router_harness):
    h = await router_harness()
    models = await (await h.client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    health = await h.client.get("/health")
    assert health.status == 200 and (await health.json())["available"] == 2
    assert (await h.client.get("/ready")).status == 200
    m = await h.client.get("/metrics")
    assert m.status == 200 and b"fulcrum_router_instance_inflight" in await m.read()


async def test_models_come_from_the_engines_when_neither_the_config_nor_the_records_name_one(router_harness):
    h = await router_harness(config={"model": None})
    h.engines[0].healthy = False  # a dead engine is skipped: the next available one answers
    h.state.pool.eject(h.engines[0].engine_id, "health")
    models = await (await h.client.get("/v1/models")).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [
        ("fake-model", FakeEngineSettings().max_model_len)]
    for e in h.engines:  # and with no engine answering, an empty list rather than an error
        h.state.pool.eject(e.engine_id, "health")
    r = await h.client.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"] == []


async def test_models_skip_an_instance_the_registry_dropped_while_another_was_asked(router_harness):
    # the first engine's /v1/models answers nothing usable and, while it is asked, the registry drops the second:
    # the list is empty rather than a KeyError (a bare 500)
    h = await router_harness(n=2, config={"model": None})
    pool = h.state.pool
    first, second = pool.available_ids()
    real_get = pool.transport.get

    async def get(iid, base, path, deadline):
        if iid == first:
            pool.set_records([s.record for i, s in pool._states.items() if i != second])
            return 500, b"{}"
        return await real_get(iid, base, path, deadline)

    pool.transport.get = get
    r = await h.client.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"] == []


async def test_the_prompt_length_comes_from_the_engines_tokenizer(router_harness):
    h = await router_harness()
    messages = [{"role": "user", "content": "count me"}]
    await h.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    exact = len(fake_chat_ids(messages))  # the fake template around "count me"
    assert f"fulcrum_router_input_tokens_sum {float(exact)}" in h.state.metrics.exposition().decode()


async def test_the_estimate_mode_needs_no_tokenize_call(router_harness):
    h = await router_harness(config={"token_count": "estimate"})
    r = await h.client.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 2})
    assert r.status == 200
    assert "fulcrum_router_input_tokens_sum 2.0" in h.state.metrics.exposition().decode()


# ------------------------------------------------------------------------------------------- bad input
BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "a", "max_tokens": -3}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": "12"}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 1e9}', "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 99999999999}', "max_tokens"),
    (b'{"prompt": "a", "stream": "yes"}', "stream"),
    (b'{"prompt": "a", "temperature": -1}', "temperature"),
    (b'{"prompt": ["a", "b"]}', "batched prompts"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": [1, -2]}', "prompt"),
    (b'{"prompt": "a", "kv_transfer_params": {"do_remote_prefill": true}}', "kv_transfer_params"),
    (b'{"prompt": "a", "max_tokens": 5000}', "context"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature: must be a finite number"),
    (b'{"prompt": "a", "temperature": Infinity}', "temperature: must be a finite number, got inf"),
    (b'{"prompt": "a", "temperature": 1e999}', "temperature: must be a finite number, got inf"),
    (b'{"prompt": "a", "top_p": NaN}', "top_p: must be a finite number, got nan"),
    (b'{"prompt": "a", "logit_bias": {"50": -Infinity}}', "logit_bias.50: must be a finite number, got -inf"),
]


@pytest.mark.parametrize("raw,reason", BAD)
async def test_bad_completions_requests_get_400_with_a_reason(router_harness, raw, reason):
    h = await router_harness()
    r = await h.client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400, await r.text()
    err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and reason in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert h.engines_active() == 0 and all(e.started == 0 for e in h.engines)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": 3}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
])
async def test_bad_chat_requests_get_400(router_harness, body):
    h = await router_harness()
    r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_a_prompt_longer_than_the_context_gets_400_before_any_generation(router_harness):
    h = await router_harness(settings=FakeEngineSettings(max_model_len=64))
    r = await h.client.post("/v1/completions", json={"prompt": "y" * 100, "max_tokens": 1})
    err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "context_length_exceeded" and "100 tokens" in err["message"]
    r = await h.client.post("/v1/completions", json={"prompt": "y" * 60, "max_tokens": 10})
    assert r.status == 400 and "70" in (await r.json())["error"]["message"]
    assert all(e.started == 0 for e in h.engines)


async def test_a_request_for_another_model_gets_404(router_harness):
    h = await router_harness()
    r = await h.client.post("/v1/completions", json={"prompt": "a", "model": "gpt-9"})
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_no_healthy_instance_gets_503(router_harness):
    h = await router_harness(n=1)
    h.state.pool.eject("e0", "test")
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"
    assert (await h.client.get("/ready")).status == 503


async def test_an_engines_own_400_is_relayed_as_is(router_harness):
    h = await router_harness(config={"token_count": "estimate"}, settings=FakeEngineSettings(max_model_len=64))
    r = await h.client.post("/v1/completions", json={"prompt": [300, 1], "max_tokens": 2})
    assert r.status == 400 and "out of vocabulary" in (await r.json())["error"]["message"]


async def test_upstream_failure_on_every_instance_gets_502_with_the_engines_message(router_harness):
    h = await router_harness(config={"eject_after_failures": 5})
    for e in h.engines:
        e.mode = "error500"
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 502
    assert "fake engine failure" in (await r.json())["error"]["message"]


async def test_an_engine_answering_200_with_broken_json_is_a_502_not_a_500(router_harness):
    h = await router_harness(n=1)
    h.engines[0].mode = "bad_json"
    r = await h.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 502


async def test_the_tokenizer_rejecting_a_chat_prompt_is_the_clients_400(router_harness):
    h = await router_harness()
    for e in h.engines:
        e.tokenize_error = "unsupported content part"
    r = await h.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ok"}]})
    assert r.status == 400 and "unsupported content part" in (await r.json())["error"]["message"]
    assert all(e.started == 0 for e in h.engines)



async def test_a_number_that_is_not_finite_is_a_400_naming_its_field(router_harness):
    h = await router_harness()
    for raw, param in [(b'{"prompt": "a", "temperature": Infinity}', "temperature"),
                       (b'{"prompt": "a", "top_p": NaN}', "top_p"),
                       (b'{"prompt": "a", "max_tokens": 2, "x": [1.5, {"y": 1e999}]}', "x.1.y")]:
        r = await h.client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == param and "must be a finite number" in err["message"], raw
    r = await h.client.post("/v1/completions", data=b'{"prompt": "a", "max_tokens": 2, "temperature": 0.5, "top_p": 1e-3}',
                            headers={"Content-Type": "application/json"})
    assert r.status == 200
    assert all(e.started == 1 for e in h.engines[:1])


# ------------------------------------------------------------------------------------ invalid Unicode
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", rb'{"prompt": "a\udc80b", "max_tokens": 4}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["\ud800"], "max_tokens": 4}', "prompt.0"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud83d"}], "max_tokens": 4}',
     "messages.0.content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": '
                             rb'[{"type": "text", "text": "x\ud83d"}]}], "max_tokens": 4}', "messages.1.content.0.text"),
])
@pytest.mark.parametrize("token_count", ["estimate", "tokenize"])
async def test_a_prompt_with_a_lone_surrogate_is_a_400_naming_where(router_harness, path, raw, param, token_count):
    h = await router_harness(config={"token_count": token_count})
    r = await h.client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400, await r.text()
    err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"prompt contains a lone surrogate (invalid Unicode) at {param}, character ")
    assert all(e.started == 0 for e in h.engines)


async def test_a_surrogate_pair_is_one_valid_character(router_harness):
    h = await router_harness(config={"token_count": "estimate"})
    r = await h.client.post("/v1/completions", data=rb'{"prompt": "\ud83d\ude00", "max_tokens": 2}',
                            headers={"Content-Type": "application/json"})
    assert r.status == 200
    assert "fulcrum_router_input_tokens_sum 1.0" in h.state.metrics.exposition().decode()  # 4 UTF-8 bytes


async def test_the_byte_estimate_survives_a_lone_surrogate():
    from fulcrum.router.schemas import ChatCompletionRequest, CompletionRequest
    from fulcrum.router.tokens import estimate_tokens

    # parsing refuses such prompts; a request built another way must still not crash the estimate
    assert estimate_tokens(CompletionRequest.model_validate({"prompt": "a\udc80b"})) == 2  # 5 bytes
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "\ud83d"}]})
    assert estimate_tokens(chat) == 1 + 4


# ------------------------------------------------------------------------------------ unreadable bodies
async def test_a_body_failing_its_content_encoding_is_a_400_and_the_router_serves_on(router_harness, caplog):
    import gzip

    h = await router_harness(n=1)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for encoding in ("gzip", "deflate"):
        r = await h.client.post("/v1/completions", data=body,
                                headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith("cannot read the request body") and f"content-encoding: {encoding}" in err["message"]
    r = await h.client.post("/v1/completions", data=gzip.compress(body),
                            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status == 200 and len((await r.json())["choices"][0]["text"]) == 2
    assert h.engines[0].started == 1
    assert not [rec for rec in caplog.records if rec.levelno >= 40]  # nothing logged as an unhandled error


# ------------------------------------------------------------------------------------ a misbehaving worker
@pytest_asyncio.fixture
async def odd_worker():
    """``await odd_worker(gen, tokenize=None, **config)``: a plain aiohttp worker whose generation and ``/tokenize``
    answers are the given handlers (``tokenize=None``: a valid answer), and a router in front of it → the router's
    test client. Closed after the test."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from fulcrum.router.app import create_app
    from fulcrum.router.config import parse_config

    made: list = []

    async def valid_tokenize(request):
        return web.json_response({"tokens": [1, 2], "count": 2, "max_model_len": 4096})

    async def health(request):
        return web.Response(text="ok")

    async def make(gen, tokenize=None, **config):
        up = web.Application()
        up.router.add_post("/v1/completions", gen)
        up.router.add_post("/v1/chat/completions", gen)
        up.router.add_post("/tokenize", tokenize or valid_tokenize)
        up.router.add_get("/health", health)
        runner = web.AppRunner(up)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        made.append(runner)
        cfg = {"model": "m", "instances": [{"id": "w0", "url": f"http://127.0.0.1:{runner.addresses[0][1]}"}],
               "max_retries": 0, "timeouts": {"connect_s": 1, "health_s": 1, "first_token_s": 5, "request_s": 5},
               **config}
        client = TestClient(TestServer(create_app(parse_config(cfg), health_checks=False), handler_cancellation=True))
        await client.start_server()
        made.append(client)
        return client

    yield make
    for x in reversed(made):
        await (x.close() if hasattr(x, "close") else x.cleanup())


def _whole(usage):
    return {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}],
            "usage": usage}


def _metric(client, line_start):
    from fulcrum.router.app import ROUTER

    text = client.app[ROUTER].metrics.exposition().decode()
    return next(line for line in text.splitlines() if line.startswith(line_start))


@pytest.mark.parametrize("completion_tokens", ["abc", {"a": 1}, True, -5, 2.5, None])
async def test_a_malformed_usage_in_a_whole_answer_is_relayed_with_an_unknown_count(odd_worker, completion_tokens):
    from aiohttp import web

    async def gen(request):
        return web.json_response(_whole({"prompt_tokens": True, "completion_tokens": completion_tokens}))

    client = await odd_worker(gen)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 200, await r.text()
    data = await r.json()
    assert data["choices"][0]["text"] == "ab" and data["usage"]["completion_tokens"] == completion_tokens
    assert _metric(client, "fulcrum_router_output_tokens_sum") == "fulcrum_router_output_tokens_sum 0.0"


@pytest.mark.parametrize("completion_tokens", ['"x"', "-5", "true", "{}"])
async def test_a_malformed_usage_in_a_stream_falls_back_to_the_counted_tokens(odd_worker, completion_tokens):
    from aiohttp import web

    async def gen(request):
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
        await r.write(b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":'
                      + completion_tokens.encode() + b'}}\n\n')
        await r.write(b"data: [DONE]\n\n")
        await r.write_eof()
        return r

    client = await odd_worker(gen)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert r.status == 200
    text, _, _, done_once = parse_stream(await r.read())
    assert text == "a" and done_once
    assert _metric(client, "fulcrum_router_output_tokens_sum") == "fulcrum_router_output_tokens_sum 1.0"


@pytest.mark.parametrize("answer,reason", [
    ({"tokens": ["a", "b"], "count": 2}, "a token id is not a non-negative integer: 'a'"),
    ({"tokens": [[1], [2]], "count": 2}, "a token id is not a non-negative integer: [1]"),
    ({"tokens": [None], "count": 1}, "a token id is not a non-negative integer: None"),
    ({"tokens": [1, True], "count": 2}, "a token id is not a non-negative integer: True"),
    ({"tokens": [1, 2], "count": 2, "max_model_len": True}, "max_model_len is not a positive integer: True"),
    ({"tokens": [1, 2], "count": 2, "max_model_len": "4096"}, "max_model_len is not a positive integer: '4096'"),
])
async def test_a_malformed_tokenize_answer_is_ignored_for_the_estimate(odd_worker, caplog, answer, reason):
    from aiohttp import web

    from fulcrum.router.app import ROUTER

    async def gen(request):
        return web.json_response(_whole({"prompt_tokens": 2, "completion_tokens": 2}))

    async def tokenize(request):
        return web.json_response(answer)

    client = await odd_worker(gen, tokenize)
    r = await client.post("/v1/completions", json={"prompt": "hello world!", "max_tokens": 2})
    assert r.status == 200, await r.text()
    assert (await r.json())["choices"][0]["text"] == "ab"
    assert _metric(client, "fulcrum_router_input_tokens_sum") == "fulcrum_router_input_tokens_sum 3.0"  # 12 bytes / 4
    assert client.app[ROUTER].pool.learned_max_model_len is None  # not learned from a malformed answer
    assert any(f"w0 answered /tokenize with a malformed body ({reason})" in rec.getMessage() for rec in caplog.records)


async def test_an_engines_4xx_that_is_not_json_is_relayed_in_openais_error_shape(odd_worker):
    from aiohttp import web

    async def gen(request):
        return web.Response(status=400, text="plain text error")

    client = await odd_worker(gen)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 400 and r.content_type == "application/json"
    assert await r.json() == {"error": {"message": "plain text error", "type": "invalid_request_error", "param": None,
                                        "code": 400}}


async def test_an_engines_json_4xx_is_still_relayed_byte_for_byte(odd_worker):
    from aiohttp import web

    raw = b'{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}'

    async def gen(request):
        return web.Response(status=422, body=raw, content_type="application/json")

    client = await odd_worker(gen)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 422 and await r.read() == raw


async def test_an_engine_answering_204_is_a_502_not_an_empty_json_answer(odd_worker):
    from aiohttp import web

    async def gen(request):
        return web.Response(status=204)

    client = await odd_worker(gen)
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status == 502 and r.content_type == "application/json"
    err = (await r.json())["error"]
    assert err["type"] == "upstream_error" and err["message"] == "the engine answered HTTP 204 with no body"
