"""Server-sent events as the OpenAI streaming API writes them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``.

:class:`EventSplitter` cuts a byte stream (arbitrary chunk boundaries) into whole events, so the router can relay
event by event, look at the few it must (the usage chunk), and never hand a client half an event.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "EventSplitter", "split_events", "plain_token_events", "event_payload", "encode_event",
           "is_usage_only"]

DONE = b"data: [DONE]\n\n"
"""The stream's last event."""


class EventSplitter:
    """Accumulates bytes and yields complete events (each ending in a blank line, ``\\n\\n`` or ``\\r\\n\\r\\n``)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add a chunk; return the events it completed, each with its trailing ``\\n\\n``."""
        return split_events(self.feed_block(chunk))

    def feed_block(self, chunk: bytes) -> bytes:
        """Add a chunk; return the events it completed as one block (``b""`` for none; line ends ``\\n``)."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2 :]
        return buf[: end + 2]

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete event still buffered."""
        return self._buf


def split_events(block: bytes) -> list[bytes]:
    """The events of a block of whole events (:meth:`EventSplitter.feed_block`), each with its ``\\n\\n``."""
    events: list[bytes] = []
    start = 0
    while True:
        end = block.find(b"\n\n", start)
        if end < 0:
            return events
        events.append(block[start : end + 2])
        start = end + 2


def plain_token_events(block: bytes) -> int:
    """How many events a block of whole events holds when every one is a ``data:`` event of generated output that
    can be relayed untouched — no usage, error or ``[DONE]`` event, no comment — else 0 (look at each event)."""
    n = block.count(b"\n\n")
    if (n == 0 or not block.startswith(b"data:") or block.count(b"\n\ndata:") != n - 1 or b'"usage"' in block
            or b'"error"' in block or b"data: [DONE]" in block):
        return 0
    return n


def event_payload(event: bytes) -> bytes | None:
    """The ``data:`` payload of one event (multi-line data joined by ``\\n``), or None for comments/keep-alives."""
    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines)


def encode_event(obj: Any) -> bytes:
    """One ``data: <json>\\n\\n`` event."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def is_usage_only(obj: Any) -> bool:
    """True for the final usage chunk of ``stream_options.include_usage`` (no choices, a usage object)."""
    return isinstance(obj, dict) and not obj.get("choices") and isinstance(obj.get("usage"), dict)
