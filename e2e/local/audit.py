"""Read the local API server's audit log (``ControlPlane.audit_log``: JSON lines, policy level Metadata): what one
user — e.g. an operator's ServiceAccount ``system:serviceaccount:<ns>:<sa>`` — asked for, and what it was told.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Call", "calls_of", "summarise"]


@dataclass(frozen=True)
class Call:
    """One audited request."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int
    uri: str

    @property
    def what(self) -> str:
        """``verb group/resource[/subresource]`` (``core`` for the core group; the URI when not a resource)."""
        if not self.resource:
            return f"{self.verb} {self.uri.split('?')[0]}"
        res = self.resource + (f"/{self.subresource}" if self.subresource else "")
        return f"{self.verb} {self.group or 'core'}/{res}"


def calls_of(log: Path, username: str, since: float = 0.0) -> list[Call]:
    """The requests ``username`` made, oldest first; ``since``: Unix seconds.

    One Call per request (``auditID``), from its last stage: ResponseComplete (or Panic), else ResponseStarted
    — a watch still open has only that one. Rotated files (``audit-*.log`` beside ``log``) are read too.
    """
    from datetime import datetime

    by_id: dict[str, Call] = {}
    files = sorted(log.parent.glob(log.stem + "-*" + log.suffix)) + [log]
    for path in files:
        if not path.is_file():
            continue
        with path.open(errors="replace") as f:
            for line in f:
                try:
                    ev: dict[str, Any] = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if (ev.get("user") or {}).get("username") != username:
                    continue
                if ev.get("stage") not in ("ResponseStarted", "ResponseComplete", "Panic"):
                    continue
                if ev.get("stage") == "ResponseStarted" and ev.get("auditID") in by_id:
                    continue
                if since:
                    ts = ev.get("requestReceivedTimestamp", "")
                    try:
                        if datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() < since:
                            continue
                    except ValueError:
                        pass
                ref = ev.get("objectRef") or {}
                by_id[str(ev.get("auditID") or len(by_id))] = Call(
                    verb=str(ev.get("verb", "")), group=str(ref.get("apiGroup", "")),
                    resource=str(ref.get("resource", "")), subresource=str(ref.get("subresource", "")),
                    namespace=str(ref.get("namespace", "")), name=str(ref.get("name", "")),
                    code=int((ev.get("responseStatus") or {}).get("code") or 0), uri=str(ev.get("requestURI", "")))
    return list(by_id.values())


def summarise(calls: list[Call]) -> dict[str, Counter[int]]:
    """``{"verb group/resource": Counter({code: n})}``, sorted by the key."""
    table: dict[str, Counter[int]] = {}
    for c in calls:
        table.setdefault(c.what, Counter())[c.code] += 1
    return dict(sorted(table.items()))
