"""A FAKE routing policy for router tests: a fixed kind of decision over the available instances in turn.

It implements :class:`fulcrum.routing.base.Policy` and records the notifications it gets; it is not one
of Fulcrum's policies (those live in ``fulcrum.routing``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

from fulcrum.routing.base import NO_CAPABILITIES, InstanceView, NoInstanceError, RequestInfo, RouteDecision

__all__ = ["FakePolicy"]


class FakePolicy:
    """Round robin over available instances; every decision is of ``kind`` (split: after ``k`` tokens).

    ``pair`` pins (A, B) for handoffs instead of taking the next two available instances.
    """

    name = "fake"
    capabilities = NO_CAPABILITIES

    def __init__(self, kind: Literal["colocated", "disaggregated", "split"] = "colocated", k: int = 0,
                 pair: tuple[str, str] | None = None) -> None:
        self.kind = kind
        self.k = k
        self.pair = pair
        self.started: list[tuple[str, RouteDecision]] = []
        self.finished: list[str] = []
        self.seen: list[list[InstanceView]] = []
        self._turn = itertools.count()

    def route(self, req: RequestInfo, instances: Sequence[InstanceView], now: float) -> RouteDecision:
        self.seen.append(list(instances))
        avail = [v.id for v in instances if v.available]
        if not avail:
            raise NoInstanceError("fake policy: nothing available")
        if self.pair is not None and self.kind != "colocated" and all(i in avail for i in self.pair):
            a, b = self.pair
        else:
            t = next(self._turn)
            a = avail[t % len(avail)]
            b = avail[(t + 1) % len(avail)]
        p = req.prompt_tokens
        if self.kind == "colocated" or len(avail) < 2 and self.pair is None:
            return RouteDecision("colocated", a, split_token=p + req.max_tokens, reason="fake colocated")
        if self.kind == "disaggregated":
            return RouteDecision("disaggregated", a, b, split_token=p, reason="fake disaggregated")
        total = p + req.predicted_output_tokens
        return RouteDecision("split", a, b, split_token=p + self.k, handoff_after=self.k,
                             phi=(p + self.k) / max(1, total), reason="fake split")

    def on_start(self, req: RequestInfo, decision: RouteDecision, now: float) -> None:
        self.started.append((req.request_id, decision))

    def on_finish(self, request_id: str, now: float) -> None:
        self.finished.append(request_id)
