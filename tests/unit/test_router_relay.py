"""Reading a relayed whole answer's usage without parsing the whole answer."""

from __future__ import annotations

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
