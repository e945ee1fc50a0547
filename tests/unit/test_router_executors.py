"""The router's table from decision kind to executor, driven through the router in front of FAKE engines."""

from __future__ import annotations

import typing

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("pytest_asyncio")

from fakes.fake_policy import FakePolicy  # noqa: E402
from fulcrum.router import app as router_app  # noqa: E402
from fulcrum.routing.base import RouteDecision  # noqa: E402
from fulcrum.router.relay import Outcome  # noqa: E402

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4}


def metric(h, line: str) -> float:
    for row in h.state.metrics.exposition().decode().splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_every_kind_of_decision_has_exactly_one_executor():
    kinds = set(typing.get_args(typing.get_type_hints(RouteDecision)["kind"]))
    assert set(router_app.EXECUTORS) == kinds == {"colocated", "disaggregated", "split"}
    assert len(set(router_app.EXECUTORS.values())) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["colocated", "disaggregated", "split"])
async def test_a_decision_runs_the_executor_of_its_kind(router_harness, monkeypatch, kind):
    ran: list[tuple[str, RouteDecision]] = []

    def fake_executor(name):
        async def run(st, ex, d, sink):
            ran.append((name, d))
            return Outcome(200, b'{"fake": "%s"}' % name.encode(), completion_tokens=1)
        return run

    for k in router_app.EXECUTORS:
        monkeypatch.setitem(router_app.EXECUTORS, k, fake_executor(k))  # type: ignore[index]
    h = await router_harness(policy=FakePolicy(kind, k=2 if kind == "split" else 0))
    r = await h.client.post("/v1/completions", json=BODY)
    assert r.status == 200 and (await r.json()) == {"fake": kind}
    assert [(name, d.kind) for name, d in ran] == [(kind, kind)]
    assert h.engines_active() == 0 and all(e.finished == 0 for e in h.engines)  # nothing reached an engine


class UnknownKindFakePolicy(FakePolicy):
    """A FAKE policy whose decisions are of a kind the router has no executor for."""

    def route(self, req, instances, now):
        d = super().route(req, instances, now)
        return RouteDecision("teleport", d.first, d.second, reason="fake teleport")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_decision_of_an_unknown_kind_is_a_policy_error_served_on_the_least_loaded_instance(router_harness):
    h = await router_harness(policy=UnknownKindFakePolicy("disaggregated"))
    r = await h.client.post("/v1/completions", json=BODY)
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
    assert metric(h, 'fulcrum_router_policy_decisions_total{kind="colocated",policy="fake",reason="policy-error"}') == 1.0
    assert sum(e.finished for e in h.engines) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["disaggregated", "split"])
async def test_a_two_instance_decision_that_cannot_be_handed_off_runs_colocated_on_b(router_harness, kind):
    h = await router_harness(policy=FakePolicy(kind, k=2 if kind == "split" else 0, pair=("e0", "e1")))
    r = await h.client.post("/v1/completions", json={**BODY, "n": 2})  # n > 1 cannot be handed off
    assert r.status == 200
    assert (h.engine("e0").finished, h.engine("e1").finished) == (0, 1)
    assert metric(h, 'fulcrum_router_handoff_guard_total{action="not-handed-off"}') == 1.0
