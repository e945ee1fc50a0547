"""Reading the router's answers in tests: whole JSON answers and SSE streams, completions or chat."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_stream", "answer_text"]


def parse_stream(raw: bytes) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]], bool]:
    """(text, usage chunk's usage or None, every JSON chunk, whether it ended with [DONE] exactly once)."""
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    chunks: list[dict[str, Any]] = []
    text = ""
    usage = None
    dones = 0
    for ev in events:
        assert ev.startswith(b"data: "), ev
        payload = ev[6:]
        if payload == b"[DONE]":
            dones += 1
            continue
        obj = json.loads(payload)
        chunks.append(obj)
        if obj.get("usage") and not obj.get("choices"):
            usage = obj["usage"]
        for ch in obj.get("choices") or []:
            if "text" in ch:
                text += ch["text"]
            elif isinstance(ch.get("delta"), dict):
                text += ch["delta"].get("content") or ""
    return text, usage, chunks, dones == 1 and events[-1] == b"data: [DONE]"


def answer_text(data: dict[str, Any]) -> str:
    """The generated text of a whole answer."""
    ch = data["choices"][0]
    return ch["text"] if "text" in ch else ch["message"]["content"]
