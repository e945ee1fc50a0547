"""The router's HTTP surface on FAKE engines: each endpoint, streaming relay, usage, and bad input answers."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

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
