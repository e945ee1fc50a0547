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
