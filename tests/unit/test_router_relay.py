"""Reading a relayed whole answer's usage without parsing the whole answer."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp")

from fulcrum.router.relay import whole_usage  # noqa: E402


def test_the_usage_written_last_is_read_without_parsing_the_rest():
    raw = json.dumps({"id": "x", "choices": [{"text": "hi"}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}}).encode()
    assert whole_usage(raw) == {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}
    assert whole_usage(b'{"usage":{"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2}}}') == {
        "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}


@pytest.mark.parametrize("raw", [
    b'{"choices": [{"text": "say \\"usage\\": {\\"completion_tokens\\": 99}"}]}',  # only inside a string
    b'{"usage": null}',
    b'{"choices": []}',
    b'["usage", {"completion_tokens": 1}]',
    b'not json "usage": {"completion_tokens": 1}',
])
def test_anything_else_is_left_to_a_whole_parse(raw):
    assert whole_usage(raw) is None


def test_whole_events_come_out_as_one_block_and_split_back_into_the_same_events():
    from fulcrum.router.sse import EventSplitter, split_events

    s = EventSplitter()
    assert s.feed_block(b"data: {\"a\":1}\r\n\r\ndata: {\"b\"") == b'data: {"a":1}\n\n'
    assert s.feed_block(b":2}\n\n: keep-alive\n\ndata: [DO") == b'data: {"b":2}\n\n: keep-alive\n\n'
    assert s.pending == b"data: [DO"
    assert split_events(b'data: 1\n\n: ka\n\n') == [b"data: 1\n\n", b": ka\n\n"]
    assert EventSplitter().feed(b"data: 1\n\ndata: 2\n\ndata") == [b"data: 1\n\n", b"data: 2\n\n"]


@pytest.mark.parametrize("block,n", [
    (b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n', 2),
    (b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n', 0),  # usage: looked at
    (b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n', 0),
    (b'data: {"error":{"message":"x"}}\n\n', 0),
    (b'data: {"choices":[{"text":"a"}]}\n\n: keep-alive\n\n', 0),  # a comment is not relayed
    (b"", 0),
])
def test_only_blocks_of_plain_output_events_skip_the_per_event_look(block, n):
    from fulcrum.router.sse import plain_token_events

    assert plain_token_events(block) == n


# ---------------------------------------------------------------------------------------------- stream timeouts
# timeouts.first_token_s covers the wait for the first streamed event (vLLM sends the answer's headers at once,
# before prefill); timeouts.idle_s only the silences after it. Tiny limits keep the tests short.
TIMEOUTS = {"connect_s": 1.0, "first_token_s": 5.0, "idle_s": 0.25, "request_s": 10.0, "health_s": 1.0}


def _slow_first_token(engine, seconds: float) -> None:
    """The FAKE engine sends its answer's headers, then waits ``seconds`` before generating (a slow prefill)."""
    generate = engine._generate

    async def slow(*args, **kwargs):
        await asyncio.sleep(seconds)
        return await generate(*args, **kwargs)

    engine._generate = slow


def _router_lines(h, prefix: str) -> dict[str, float]:
    out = {}
    for row in h.state.metrics.exposition().decode().splitlines():
        if row.startswith(prefix) and not row.startswith("#"):
            name, value = row.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _errors_and_ejections(h) -> dict[str, float]:
    got = _router_lines(h, "fulcrum_router_upstream_errors_total")
    got.update({k: v for k, v in _router_lines(h, "fulcrum_router_ejections_total").items()})
    return {k: v for k, v in got.items() if v}


@pytest.mark.asyncio
async def test_a_first_token_slower_than_idle_s_but_within_first_token_s_streams_and_ejects_nothing(router_harness):
    from fakes.sse_client import parse_stream

    h = await router_harness(n=1, config={"timeouts": TIMEOUTS})
    _slow_first_token(h.engine("e0"), 0.8)  # > idle_s, < first_token_s
    r = await h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True})
    assert r.status == 200
    text, _, chunks, done_once = parse_stream(await r.read())
    assert done_once and len(text) == 4 and not any("error" in c for c in chunks)
    assert _errors_and_ejections(h) == {}
    assert h.state.pool.available_ids() == ["e0"]


@pytest.mark.asyncio
async def test_a_stream_silent_between_events_longer_than_idle_s_ends_with_a_timeout(router_harness):
    from fakes.fake_engine import FakeEngineSettings
    from fakes.sse_client import parse_stream

    # every token 0.6 s after the last: the first is within first_token_s, the gap after it is past idle_s
    h = await router_harness(n=1, settings=FakeEngineSettings(token_delay_s=0.6), config={"timeouts": TIMEOUTS})
    r = await h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True})
    assert r.status == 200
    text, _, chunks, done_once = parse_stream(await r.read())  # whole: an error event and [DONE], not a cut
    assert done_once and len(text) == 1
    assert "sent nothing for 0.25 s" in chunks[-1]["error"]["message"]
    assert _errors_and_ejections(h) == {'fulcrum_router_upstream_errors_total{cause="timeout"}': 1.0,
                                        'fulcrum_router_ejections_total{cause="timeout",instance="e0"}': 1.0}


@pytest.mark.asyncio
async def test_bytes_from_the_engine_between_events_keep_a_stream_alive(router_harness):
    from aiohttp import web
    from fakes.sse_client import parse_stream

    h = await router_harness(n=1, config={"timeouts": TIMEOUTS})

    async def keep_alive(request, chat):  # one event, 0.8 s of keep-alive comments, then the rest
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n')
        for _ in range(8):
            await asyncio.sleep(0.1)
            await resp.write(b": keep-alive\n\n")
        await resp.write(b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    h.engine("e0")._serve = keep_alive
    r = await h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True})
    text, _, chunks, done_once = parse_stream(await r.read())
    assert r.status == 200 and done_once and text == "ab"
    assert _errors_and_ejections(h) == {}
